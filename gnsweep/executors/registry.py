"""Executor kind -> the function that runs a launch's runs there; `executor.kind` picks one.

Each entry is `module:function` with the signature of `Launch`, imported only when chosen (the
Slurm backend needs submitit, the local one nothing beyond torch).
"""

from __future__ import annotations

import importlib
from typing import Protocol

from gnsweep.config import EXECUTORS, ExecutorConfig
from gnsweep.errors import ConfigError
from gnsweep.executors.rounds import Summary
from gnsweep.folder import SweepFolder
from gnsweep.progress import SweepProgress


class Launch(Protocol):
    def __call__(self, sweep: SweepFolder, run_ids: list[str], executor: ExecutorConfig, *,
                 max_retries: int, progress: SweepProgress | None,
                 wait: bool = True) -> Summary: ...


REGISTRY: dict[str, str] = {
    "local": "gnsweep.executors.local:launch",
    "torchrun": "gnsweep.executors.torchrun:launch",
    "slurm": "gnsweep.executors.slurm:launch",
}
assert tuple(REGISTRY) == EXECUTORS, "every executor kind the config accepts has an entry"


SCRIPT_TORCHRUN = "gnsweep.executors.local:launch_scripts_under_torchrun"
"""task=script with executor=torchrun: a local pool whose runs start their command under
torchrun (the script does its own DDP), not gnsweep's worker under torchrun."""


def executor_for(kind: str, script: bool = False) -> Launch:
    """The launch function of executor `kind` (for a task=script sweep with `script`)."""
    if script and kind == "torchrun":
        kind_path = SCRIPT_TORCHRUN
        module, _, name = kind_path.partition(":")
        scripts: Launch = getattr(importlib.import_module(module), name)
        return scripts
    if kind not in REGISTRY:
        raise ConfigError(f"executor.kind: {kind!r} is not one of {', '.join(REGISTRY)}")
    module, _, name = REGISTRY[kind].partition(":")
    launch: Launch = getattr(importlib.import_module(module), name)
    return launch
