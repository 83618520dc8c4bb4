"""Training one run: the loop (`loop`), the run's state built in one place (`state`), the
optimizer and learning rate (`recipe`), each step's batch (`data`), the forward/backward
(`backward`) and the loss watch (`watch`)."""

from gnsweep.errors import StopRequested
from gnsweep.training.loop import RunResult, run, train
from gnsweep.training.state import TrainState, build_run, placement, resolve_method
from gnsweep.training.watch import Diverged, LossWatch

__all__ = ["Diverged", "LossWatch", "RunResult", "StopRequested", "TrainState", "build_run",
           "placement", "resolve_method", "run", "train"]
