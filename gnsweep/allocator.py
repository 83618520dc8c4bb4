"""glibc malloc settings for gnsweep's processes: the workers that train, the CLI (the analysis),
the benchmarks.

A CPU training step allocates and frees the same large temporaries every step (activations,
gradients, a convolution's per-example gradients). glibc's malloc hands blocks over an adaptive
threshold (128 KiB at first, at most 32 MiB) to the kernel with mmap, and gives back the top of
its heap once more than twice that is free there: so a step's temporaries come back as fresh
pages that the kernel zero-fills on first touch, every step. On the bench's CNN at batch 512 a
plain step goes 29-33 ms -> 20-25 ms with the settings below, at batch 128 6-7 -> 5.7 ms, and
the step time no longer depends on where the adaptive threshold happened to settle in that
process (the same bench moved by 25% from one process to the next). A small MLP or GPT-2
step, whose temporaries are small, is unchanged.

`tune()` keeps blocks up to `MMAP_THRESHOLD` on the heap and up to `TRIM_THRESHOLD` of free
memory at its top, so a worker holds more than it uses: that much at the top, and freed blocks
below it (what PyTorch's own CUDA caching allocator does on a GPU). It leaves malloc alone where
the user chose: glibc's MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ or
MALLOC_MMAP_MAX_ in the environment, `glibc.malloc.*` in GLIBC_TUNABLES, an allocator preloaded
(jemalloc, tcmalloc, mimalloc), or `GNSWEEP_MALLOC=default`; and off glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

ENV = "GNSWEEP_MALLOC"
"""`default`: leave glibc's malloc as it is in gnsweep's workers and benchmarks."""
MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest adaptive threshold)."""
TRIM_THRESHOLD = 64 << 20
"""Free memory at the heap's top is given back to the kernel past this much."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")
"""glibc's own variables for what `tune()` sets (also `glibc.malloc.*` in GLIBC_TUNABLES)."""
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")
_tuned = False


def why_untouched() -> str | None:
    """Why `tune()` leaves malloc as it is here, or None when it would tune it."""
    if os.environ.get(ENV, "").strip().lower() == "default":
        return f"{ENV}=default"
    chosen = [name for name in _USER_SETTINGS if name in os.environ]
    if chosen:
        return f"{chosen[0]} is set"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in _PRELOADED):
        return "an allocator is preloaded (LD_PRELOAD)"
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    return None


def tune() -> bool:
    """Apply `MMAP_THRESHOLD` and `TRIM_THRESHOLD` to this process's malloc (from the next
    allocation on); False where it is left alone (`why_untouched`) or mallopt refused."""
    global _tuned
    if why_untouched() is not None:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        _tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                      and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False
    return _tuned


def described() -> str:
    """This process's malloc in a few words (for a benchmark's header)."""
    if _tuned:
        return (f"glibc malloc as in gnsweep's workers (blocks <= {MMAP_THRESHOLD >> 20} MiB on "
                f"the heap, {TRIM_THRESHOLD >> 20} MiB kept free: gnsweep.allocator)")
    return f"malloc left as it is ({why_untouched() or 'not tuned in this process'})"
