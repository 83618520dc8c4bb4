"""A branch run's start: the model and optimizer of a base run's checkpoint, everything else new.

A branch sweep (`gnsweep branch`, docs/along.md) asks how large the batch may be *at this point*
of the base run: every branch run continues the base run's training from the same state, at its
own batch size and learning rate, and is timed from there. So it keeps what *is* the point of
training and resets what belongs to one run's measurement of its own path:

kept   model parameters and buffers; the optimizer's state (momentum buffers, Adam's moments and
       step count), so that Adam does not restart its bias-corrected warm-up and a momentum run
       does not lose its velocity: both are part of where training stands.
reset  the learning rate of every parameter group: the grid's (the swept variable); step and
       example counters: S and E of eq. 2.11 count from the branch point; the loss smoother
       and divergence reference: they would carry the base run's losses at its batch size;
       the noise monitor's EMAs and the probes: each branch run measures its own path; the
       batch schedule: the grid point's; random state and data position: drawn from the branch
       run's own seed, so branch runs are independent of the base run and of each other;
       the logged rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gnsweep.config import ConfigError
from gnsweep.errors import StoreError
from gnsweep.training.checkpoint import verify
from gnsweep.training.state import TrainState


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A base run's checkpoint, verified (`checkpoint.verify`: its sidecar, size and checksum),
    on the CPU. The one place a branch reads a checkpoint file."""
    if not path.is_file():
        raise StoreError(f"{path}: missing (the branch point's checkpoint)")
    state = verify(path, run_id=path.parent.parent.name)  # the run whose folder holds it
    if not {"model", "optimizer", "progress"} <= set(state):
        raise StoreError(f"{path}: not a run's saved state (no model, optimizer and progress)")
    return state


def start_branch(state: TrainState) -> None:
    """Start a freshly built branch run (`spec.at_examples`) from its point's checkpoint
    (`branch.points`): `start_from` with the run's own learning rate."""
    point = state.config.branch.point(state.spec.at_examples)
    start_from(state.model, state.optimizer, read_checkpoint(Path(point["checkpoint"])),
               state.spec.learning_rate)


def start_from(model: torch.nn.Module, optimizer: torch.optim.Optimizer, source: dict[str, Any],
               learning_rate: float) -> None:
    """Load the source's model and optimizer state into a freshly built run (module docstring:
    what is kept and what is reset), then set every parameter group's learning rate to the
    run's own (a loaded optimizer state carries the base run's)."""
    try:
        model.load_state_dict(source["model"])
        optimizer.load_state_dict(source["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise ConfigError(f"the branch point's checkpoint does not fit this run's model or "
                          f"optimizer ({str(err).splitlines()[0]}); branch runs train the base "
                          "run's task with its optimizer") from None
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
