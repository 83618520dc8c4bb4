"""Built-in tasks: one module each, a model + data + loss behind the `Task` protocol.

A task module defines `Options` (a dataclass of its settings, validated in `__post_init__`),
`DESCRIPTION` (one line for `gnsweep tasks`) and `make(options, seed) -> Task`.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

_MODULES = {"digits": "gnsweep.tasks.digits", "linreg": "gnsweep.tasks.linreg"}


class Task(Protocol):
    """What a run needs from a task. All tensors live on the CPU unless moved by the run."""

    def model(self) -> nn.Module:
        """A freshly initialised model (seeded by the task's seed)."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch-mean loss (a scalar)."""

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`size` training examples drawn i.i.d. (with replacement) from the training data."""

    def eval_data(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Held-out inputs and targets for the eval loss, or None."""


def task_names() -> list[str]:
    return [name for name in _MODULES if _available(name)]


def _available(name: str) -> bool:
    try:
        importlib.import_module(_MODULES[name])
    except ModuleNotFoundError as err:
        if err.name == _MODULES[name]:
            return False
        raise
    return True


def _module(name: str) -> Any:
    return importlib.import_module(_MODULES[name])


def describe() -> dict[str, str]:
    """Task name -> one-line description with its default options."""
    out = {}
    for name in task_names():
        module = _module(name)
        defaults = ", ".join(f"{k}={v}" for k, v in asdict(module.Options()).items())
        out[name] = f"{module.DESCRIPTION} Options: {defaults}."
    return out


def validate_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Check a task's options against its schema; return them complete with defaults."""
    from gnsweep.config import ConfigError

    schema = _module(name).Options
    known = {f.name for f in fields(schema)}
    unknown = set(options) - known
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"task.{key}: not an option of task {name}; "
                          f"known: {', '.join(sorted(known))}")
    return asdict(schema(**options))


def make_task(name: str, options: dict[str, Any], seed: int) -> Task:
    module = _module(name)
    task: Task = module.make(module.Options(**options), seed)
    return task
