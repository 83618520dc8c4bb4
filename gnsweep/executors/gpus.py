"""Which GPUs each of a launcher's concurrent workers trains on (local pool, torchrun jobs).

Without this every process would pick `cuda:LOCAL_RANK` of the whole machine, so 8 local
workers (or 4 torchrun jobs of 2 processes) would all crowd the first GPUs of an 8-GPU node.
As in Ray, dask-cuda and torchx's local scheduler, each worker instead gets its own share of the
GPUs through CUDA_VISIBLE_DEVICES, set in its environment before it initialises CUDA: inside
it, `cuda:0` (or `cuda:LOCAL_RANK` of a torchrun job) is then its own GPU.

The launcher itself never initialises CUDA (local workers are forked from it, and a forked
child cannot use CUDA once its parent has): it counts GPUs with NVML, which leaves CUDA alone,
or, where NVML cannot answer and torch was built with CUDA, in a child process. torch's own
`torch.cuda.device_count()` (torch 2.13) asks NVML first too but falls back to
`cudaGetDeviceCount` in the calling process, which would initialise CUDA in the launcher.

`assign` is the pure rule; `launcher_gpus` reads the setting and the machine, `plan` puts
them together for one launch.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gnsweep.errors import ConfigError

VISIBLE = "CUDA_VISIBLE_DEVICES"
AUTO, NONE = "auto", "none"


def assign(gpus: Sequence[str], slots: int, per_slot: int) -> list[tuple[str, ...]]:
    """The GPUs of each of `slots` concurrent workers that need `per_slot` GPUs each.

    Slot i takes `per_slot` consecutive GPUs from position `i * per_slot`, wrapping around: the
    shares are disjoint while `slots * per_slot <= len(gpus)`; beyond that workers share GPUs
    round-robin, every GPU by as many workers as any other (within one), and a slot's own GPUs
    are always distinct (two ranks of one DDP job never share one). ValueError when a slot needs
    more GPUs than there are.
    """
    if per_slot > len(gpus):
        raise ValueError(f"a worker needs {per_slot} GPUs and there are {len(gpus)}")
    n = len(gpus)
    return [tuple(gpus[(i * per_slot + k) % n] for k in range(per_slot)) for i in range(slots)]


@dataclass(frozen=True)
class GpuPlan:
    """The CUDA_VISIBLE_DEVICES of each worker slot of one launch."""

    shares: list[tuple[str, ...]] | None
    """Each slot's GPUs; None: leave the workers' environment as it is (no GPUs to share out:
    a machine without GPUs trains on the CPU as before); an empty share hides every GPU."""

    def env(self, slot: int) -> dict[str, str]:
        """The environment variables slot `slot` (a replacement worker keeps its slot) gets."""
        if self.shares is None:
            return {}
        return {VISIBLE: ",".join(self.shares[slot % len(self.shares)])}


def _entries(text: str) -> list[str]:
    """A CUDA_VISIBLE_DEVICES value as CUDA reads it: ids until the first that is not one."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not (item.isdigit() or item.startswith(("GPU-", "MIG-"))):
            break
        out.append(item)
    return out


def launcher_gpus(setting: str, environ: Mapping[str, str] | None = None,
                  count: Callable[[], int] | None = None) -> list[str] | None:
    """The GPUs a launcher may share out under `executor.gpus=setting` (already validated by
    `ExecutorConfig`): None when it shares none out and leaves the environment alone (auto on
    a machine without GPUs), [] for none (the workers see no GPU: CPU training).

    auto: the launcher's own CUDA_VISIBLE_DEVICES when set, else every GPU of the machine
    (`count`, default `count_gpus`). An explicit list must lie within the launcher's
    CUDA_VISIBLE_DEVICES when that is set (a launcher fenced to some GPUs stays there).
    """
    environ = os.environ if environ is None else environ
    own = environ.get(VISIBLE)
    if setting == NONE:
        return []
    if setting == AUTO:
        if own is not None:
            return _entries(own) or None
        found = (count or count_gpus)()
        return [str(i) for i in range(found)] or None
    wanted = setting.split(",")
    if own is not None:
        outside = [g for g in wanted if g not in _entries(own)]
        if outside:
            raise ConfigError(f"executor.gpus={setting}: {','.join(outside)} not among this "
                              f"launcher's {VISIBLE}={own!r}; choose from those, or "
                              "executor.gpus=auto")
    return wanted


@functools.cache
def count_gpus() -> int:
    """The machine's GPUs, counted once a process without initialising CUDA in it: NVML, else
    (torch built with CUDA, NVML unusable) `torch.cuda.device_count()` in a child process; 0
    on a machine without an NVIDIA driver (no child started) or with a CPU-only torch."""
    if not any(os.path.exists(p) for p in _DRIVER):
        return 0
    found = _nvml_count()
    if found is not None:
        return found
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return 0
    env = {k: v for k, v in os.environ.items() if k != VISIBLE}
    try:
        out = subprocess.run([sys.executable, "-c",
                              "import torch; print(torch.cuda.device_count())"],
                             env=env, capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


_DRIVER = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0")
"""What an NVIDIA driver leaves on a Linux machine."""


def _nvml_count() -> int | None:
    """Every NVIDIA GPU of the machine (CUDA_VISIBLE_DEVICES ignored) by NVML; None when
    NVML is absent or fails."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
    except AttributeError:  # an NVML too old for these entry points
        return None
    try:
        found = ctypes.c_uint(0)
        ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(found)) == 0
        return int(found.value) if ok else None
    except AttributeError:
        return None
    finally:
        nvml.nvmlShutdown()


def plan(gpus: list[str] | None, slots: int, per_slot: int, *, what: str,
         setting: str) -> tuple[GpuPlan, str | None]:
    """Each of `slots` workers' share of `gpus` (`launcher_gpus` of `executor.gpus=setting`),
    `per_slot` GPUs each, and a line to say once when workers share GPUs or GPUs stay idle
    (None: nothing to say). `what` names one worker in it ("worker", "torchrun job").
    ConfigError when one worker needs more GPUs than there are.
    """
    if gpus is None:
        return GpuPlan(None), None
    if not gpus:
        return GpuPlan([()] * slots), None
    try:
        shares = assign(gpus, slots, per_slot)
    except ValueError:
        raise ConfigError(f"executor.nproc_per_node={per_slot}: each DDP process trains on a "
                          f"GPU of its own, and this launcher has {len(gpus)} "
                          f"(executor.gpus={setting}: {','.join(gpus)}); set "
                          f"executor.nproc_per_node to at most {len(gpus)}, or "
                          "executor.gpus=none to train on the CPU") from None
    used = slots * per_slot
    note, what = None, what + ("s" if slots != 1 else "")
    if used > len(gpus):
        note = (f"gnsweep: {slots} {what} share {len(gpus)} GPUs ({','.join(gpus)}), "
                f"round-robin: up to {-(-used // len(gpus))} processes on one GPU")
    elif used < len(gpus):
        note = (f"gnsweep: {slots} {what} {'use' if slots != 1 else 'uses'} {used} of the "
                f"{len(gpus)} GPUs ({','.join(gpus)})")
        if len(gpus) % per_slot == 0:  # else more workers would share GPUs, not fill them
            note += f"; executor.workers={len(gpus) // per_slot} would use them all"
    return GpuPlan(shares), note
