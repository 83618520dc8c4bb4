"""Tasks: a torch-free registry (name -> options schema, import path, description) and the
`Task` protocol. One module per built-in task holds its model, data and loss.

The registry is read by the config (validation, `gnsweep tasks`) without importing torch; only
`make_task` imports the task's module, in the process that trains. An entry's `target` is an
import path `module:function`, the same shape as a Hydra `_target_`, so a user's own task can
sit beside the built-in ones.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from gnsweep.errors import ConfigError
from gnsweep.tasks.options import CartpoleOptions, DigitsOptions, LinregOptions

if TYPE_CHECKING:
    import torch
    from torch import nn


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


@dataclass(frozen=True)
class TaskEntry:
    """One registered task."""

    options: type
    """Dataclass of the task's settings, validated in its `__post_init__` (no torch)."""
    target: str
    """`module:function` building the task: `function(options, seed) -> Task`."""
    description: str
    """One line for `gnsweep tasks`."""
    requires: tuple[str, ...] = ()
    """Optional packages the task needs; it is listed only where they are installed."""
    unit: str = "examples"
    """What a batch size counts (the task's `examples(batch)`): examples, tokens or environment
    steps. B, E_min and B_crit are in this unit."""
    metric: str = "loss"
    """What the sweep's targets are values of: "loss", or the name of the task's own metric
    (its `metric(model)`, logged by the loop in the metrics' `metric` column)."""
    higher_is_better: bool = False
    """The metric's direction: a target is reached when the metric rises to it (True) or falls
    to it (False, every loss). The same as the task object's `higher_is_better`."""


REGISTRY: dict[str, TaskEntry] = {
    "digits": TaskEntry(
        DigitsOptions, "gnsweep.tasks.digits:make",
        "MLP on scikit-learn's bundled digits (1797 x 64, 10 classes), cross-entropy."),
    "linreg": TaskEntry(
        LinregOptions, "gnsweep.tasks.linreg:make",
        "Linear regression, anisotropic Gaussian inputs, label noise; closed-form G, Sigma, H "
        "(true B_simple and B_noise at any parameters)."),
}


PREPARED: dict[str, TaskEntry] = {
    # Registered (moved into REGISTRY) once the training loop follows the task protocol of
    # issue 10 and logs the task's metric: the loop must call `task.metric(model)` at every
    # logged step into the metrics' `metric` column and stop at `TaskConfig.hardest(targets)`
    # tested with `TaskConfig.reached` on that metric (docs/compare.md, "Wiring cartpole").
    "cartpole": TaskEntry(
        CartpoleOptions, "gnsweep.tasks.cartpole:make",
        "Advantage actor-critic on gymnasium's CartPole-v1; B in environment steps "
        "(environments x steps per update); target: mean episode return (higher is better).",
        requires=("gymnasium",), unit="environment steps", metric="return",
        higher_is_better=True),
}
"""Built-in tasks whose entries are ready but that the training loop cannot run yet."""


def task_names() -> list[str]:
    """The registered tasks whose optional packages are installed."""
    return [name for name, entry in REGISTRY.items()
            if all(importlib.util.find_spec(p) is not None for p in entry.requires)]


def entry(name: str) -> TaskEntry:
    if name not in REGISTRY or name not in task_names():
        raise ConfigError(f"task={name}: no such task; choose one of {', '.join(task_names())}")
    return REGISTRY[name]


def describe() -> dict[str, str]:
    """Task name -> one-line description with its default options."""
    out = {}
    for name in task_names():
        task = REGISTRY[name]
        defaults = ", ".join(f"{k}={v}" for k, v in asdict(task.options()).items())
        out[name] = f"{task.description} Options: {defaults}."
    return out


def validate_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Check a task's options against its schema; return them complete with defaults."""
    schema = entry(name).options
    known = {f.name for f in fields(schema)}
    unknown = set(options) - known
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"task.{key}: not an option of task {name}; "
                          f"known: {', '.join(sorted(known))}")
    return asdict(schema(**options))


def resolve(target: str) -> Any:
    """The object a `module:function` (or dotted `module.function`) path names."""
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def make_task(name: str, options: dict[str, Any], seed: int) -> Task:
    task = entry(name)
    made: Task = resolve(task.target)(task.options(**options), seed)
    return made
