"""The task protocol: what a run needs from a task, built-in or a user's own (docs/tasks.md).

A task owns its data and its loss; gnsweep owns the loop. Torch is imported for type checking
only, so the config can name this module where torch is missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

Batch = Any
"""A tensor, or a tuple / list / dict of tensors whose first dimension indexes the examples."""


@runtime_checkable
class Task(Protocol):
    """What a run needs from a task. Optional: `eval_loss(model) -> float` (a held-out or exact
    loss, logged every `sweep.eval_every` steps), `examples(batch) -> int` (the examples a
    batch counts for: default its first dimension; a language model returns tokens, so B, the
    examples column and B_crit are counted in tokens) and
    `noise_parameters(model) -> Iterable[nn.Parameter]` (the parameters whose gradient the
    noise scale is measured on; default all trainable ones: B_simple = tr(Sigma)/|G|^2 of that
    block of the gradient, eq. 2.9. For a model whose loss adds an auxiliary network's loss to
    the one that sets the target, e.g. an actor-critic's critic: cartpole returns its actor's)
    and `resumable = False` (the task keeps state of its own between steps, such as
    environments: its runs take no checkpoints and an interrupted one starts again).

    The batch's first dimension indexes the independent samples: the noise monitor takes the
    rows as independent draws and micro-batches split along it. Correlated examples (a
    window's tokens, an environment's consecutive steps) belong in one row, (samples,
    positions, ...), with `examples(batch)` counting them; B_simple is then converted from
    samples to that unit."""

    def model(self) -> nn.Module:
        """A freshly initialised model (seed it from the task's `seed` for reproducible runs)."""

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        """`batch_size` i.i.d. training examples, drawn with `generator`: a tensor, or a tuple,
        list or dict of tensors whose first dimension indexes the examples, so that gnsweep can
        split the batch into micro-batches along it."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The batch-mean loss (a scalar tensor) of `model` on `batch`. Call `model(...)`
        itself: under DDP it is the wrapped model, and the noise monitor's hooks live on it."""


def first_dim(batch: Batch) -> int | None:
    """The first dimension of the batch's first tensor (None when it has none)."""
    if hasattr(batch, "shape"):
        return int(batch.shape[0]) if len(batch.shape) else None
    values = batch.values() if isinstance(batch, dict) else batch
    if isinstance(values, (tuple, list)) or isinstance(batch, dict):
        for value in values:
            found = first_dim(value)
            if found is not None:
                return found
    return None


def examples_of(task: Any, batch: Batch) -> int:
    """The examples `batch` counts for: `task.examples(batch)` when defined, else its first
    dimension."""
    count = task.examples(batch) if hasattr(task, "examples") else first_dim(batch)
    if count is None:
        raise ValueError("the batch has no tensor with a first dimension; give the task an "
                         "examples(batch) method")
    return int(count)
