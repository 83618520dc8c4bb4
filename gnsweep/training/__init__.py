"""Training one run: the loop (`loop`), the run's state built in one place (`state`), the
optimizer and learning rate (`recipe`), each step's batch (`data`), the forward/backward
(`backward`) and the loss watch (`watch`).

Importing the package imports nothing heavy: the names below load their module (and torch) on
first use, so that the pure parts (`gnsweep.training.lr_schedule`) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gnsweep.errors import StopRequested

if TYPE_CHECKING:
    from gnsweep.training.loop import RunResult, run, train
    from gnsweep.training.state import TrainState, build_run, placement, resolve_method
    from gnsweep.training.watch import Diverged, LossWatch

__all__ = ["Diverged", "LossWatch", "RunResult", "StopRequested", "TrainState", "build_run",
           "placement", "resolve_method", "run", "train"]


def __getattr__(name: str) -> Any:
    """The package's names from their modules, imported on first use."""
    if name in ("RunResult", "run", "train"):
        from gnsweep.training import loop
        return getattr(loop, name)
    if name in ("TrainState", "build_run", "placement", "resolve_method"):
        from gnsweep.training import state
        return getattr(state, name)
    if name in ("Diverged", "LossWatch"):
        from gnsweep.training import watch
        return getattr(watch, name)
    raise AttributeError(f"module 'gnsweep.training' has no attribute {name!r}")
