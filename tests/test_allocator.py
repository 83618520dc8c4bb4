"""gnsweep.allocator: the malloc settings of the training processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gnsweep import allocator

# A 24 MiB block, as a training step's activations are, made and freed: where it came from
# (glibc's mallinfo2: bytes in mmapped blocks) and what the heap keeps at its top after the free.
BLOCK = """
import ctypes, sys
from gnsweep import allocator
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
tuned = allocator.tune() if sys.argv[1] == "tune" else False
before = libc.mallinfo2().hblkhd
block = libc.malloc(24 << 20)
mapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print(tuned, mapped, libc.mallinfo2().keepcost)
"""


def _block(how: str, **env: str) -> tuple[bool, int, int]:
    """(tuned, bytes mmapped for the block, bytes kept free at the heap's top after it)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD",
                                                          allocator.ENV)}
    out = subprocess.run([sys.executable, "-c", BLOCK, how], capture_output=True, text=True,
                         check=True, env={**clean, **env}).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


@pytest.mark.skipif(allocator.why_untouched() == "not glibc", reason="glibc's malloc only")
@pytest.mark.process
def test_tuned_malloc_keeps_a_steps_temporaries_on_the_heap():
    # glibc's own settings: the block is mmapped, and its pages go back to the kernel on free
    # (to be faulted in again, zero-filled, at the next step).
    tuned, mapped, kept = _block("leave")
    assert not tuned and mapped >= 24 << 20 and kept < 24 << 20
    # gnsweep's: the block comes from the heap, and the heap keeps it for the next step.
    tuned, mapped, kept = _block("tune")
    assert tuned and mapped == 0 and kept >= 24 << 20
    # The user's choice wins: left alone.
    tuned, mapped, kept = _block("tune", GNSWEEP_MALLOC="default")
    assert not tuned and mapped >= 24 << 20 and kept < 24 << 20


@pytest.mark.parametrize(("env", "reason"), [
    ({"GNSWEEP_MALLOC": "default"}, "GNSWEEP_MALLOC=default"),
    ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES sets glibc.malloc"),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "an allocator is preloaded (LD_PRELOAD)")])
def test_a_users_own_malloc_choice_is_left_alone(monkeypatch, env, reason):
    for name in ("MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD", allocator.ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert allocator.why_untouched() == reason
    assert not allocator.tune()


def test_tunables_of_other_parts_of_glibc_do_not_stop_it(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")  # set by some container images
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "MALLOC_MMAP_MAX_", "LD_PRELOAD", allocator.ENV):
        monkeypatch.delenv(name, raising=False)
    assert allocator.why_untouched() in (None, "not glibc")
