"""What the measurement sources share: the logger, batch helpers, squared norms, and the
small view of the monitor (`Gate`) a source may consult while it captures."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

log = logging.getLogger("gnsweep.measure")

LossFn = Callable[[Any, Any], torch.Tensor]
"""`loss_fn(outputs, targets)`: the batch-mean loss of the model's outputs."""
TaskLoss = Callable[[nn.Module, Any], torch.Tensor]
"""`task_loss(model, batch)`: the batch-mean loss of a whole batch (a task's `loss`)."""
Batch = Any
"""`(inputs, targets)` with `loss_fn`; with `task_loss`, whatever the task samples: a tensor or
a tuple / list / dict of tensors whose first dimension indexes the examples."""


class Gate(Protocol):
    """What a source asks of the monitor that owns it."""

    @property
    def capturing(self) -> bool:
        """This step is measured and no measurement pass of the monitor's own is running."""

    def warn_once(self, key: str, message: str) -> None:
        """Log `message` the first time `key` is seen."""


def fp32(device: str) -> AbstractContextManager[Any]:
    """Autocast off where it is on; nothing elsewhere (entering the context costs more than
    the small products it guards, several times per layer and step)."""
    if torch.is_autocast_enabled(device):
        return torch.autocast(device, enabled=False)
    return nullcontext()


def sq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares, without a squared copy."""
    return torch.linalg.vector_norm(t).square()


def is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def world_size(model: nn.Module) -> int:
    import torch.distributed as dist

    return dist.get_world_size(getattr(model, "process_group", None))


def first_tensor(values: Iterable[Any]) -> torch.Tensor | None:
    if isinstance(values, dict):
        values = values.values()
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list, dict)):
            found = first_tensor(value)
            if found is not None:
                return found
    return None


def batch_len(inputs: Any) -> int:
    first = inputs if isinstance(inputs, torch.Tensor) else first_tensor(inputs)
    if first is None or first.dim() == 0:
        raise ValueError("inputs must be a tensor (or a tuple, list or dict of tensors) with a "
                         "batch dimension")
    return int(first.shape[0])


def take(values: Any, index: slice) -> Any:
    if isinstance(values, torch.Tensor):
        return values[index]
    if isinstance(values, (tuple, list)):
        return type(values)(take(v, index) for v in values)
    if isinstance(values, dict):
        return {k: take(v, index) for k, v in values.items()}
    return values


def split_batch(batch: Any, k: int) -> list[Any] | None:
    """`batch` cut into `k` micro-batches along dim 0 (sizes differing by at most one): a
    tensor, or a tuple / list / dict of them, nested; other values are shared by every piece.
    None when the batch cannot be cut: no tensor, tensors whose first dimensions differ, or
    fewer than `k` examples."""
    sizes = set(_first_dims(batch))
    if len(sizes) != 1:
        return None
    n = sizes.pop()
    if k < 1 or n < k:
        return None
    bounds = [round(j * n / k) for j in range(k + 1)]
    return [take(batch, slice(lo, hi)) for lo, hi in itertools.pairwise(bounds)]


def _first_dims(values: Any) -> Iterable[int]:
    if isinstance(values, torch.Tensor):
        yield int(values.shape[0]) if values.dim() else -1
    elif isinstance(values, (tuple, list)):
        for v in values:
            yield from _first_dims(v)
    elif isinstance(values, dict):
        for v in values.values():
            yield from _first_dims(v)


def check_scalar(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor (the batch-mean loss), got "
                         f"{shape}; reduce it with .mean()")


def grad_sq_norm(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """Squared norm of the parameters' `.grad` (float64, 0-d)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack(torch._foreach_norm(grads)).double()
    return torch.dot(norms, norms)


def batch_loss(module: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any) -> torch.Tensor:
    with torch.enable_grad():
        outputs = module(*inputs) if isinstance(inputs, (tuple, list)) else module(inputs)
        loss = loss_fn(outputs, targets)
    check_scalar(loss)
    return loss


_SAID: set[str] = set()


def say_once(key: str, message: str, *, per_launch: bool = False) -> None:
    """Log `message` once per process: facts about an architecture (which layers fall back to
    micro-batches, how batch statistics are measured) hold for every run of a sweep, and a
    worker process runs many. `per_launch`: once per launch by `key`, not by the message's
    text (`gnsweep.notices`), for a message whose numbers differ from run to run."""
    if key not in _SAID:
        _SAID.add(key)
        log.warning(message, extra={"once": key} if per_launch else None)


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` (a tensor, or a tuple / list / dict of them) with its tensors on `device`;
    `non_blocking`: a copy from pinned memory to a GPU overlaps the work queued before it (on
    the CPU it changes nothing)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def measured_parameters(model: nn.Module, parameters: Iterable[nn.Parameter] | None
              ) -> list[nn.Parameter]:
    """The measured parameters: the given ones (trainable parameters of the model, each once),
    or every trainable parameter of the model."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if parameters is None:
        if not trainable:
            raise ValueError("the model has no trainable parameters: nothing to measure")
        return trainable
    ids = {id(p) for p in parameters}
    if not ids:
        raise ValueError("parameters= is empty: nothing to measure")
    if not ids <= {id(p) for p in trainable}:
        raise ValueError("parameters= must be trainable parameters of the model (one is not, "
                         "or does not require grad)")
    # The model's order, so that flattened gradients line up with DDP's and the optimizer's.
    return [p for p in trainable if id(p) in ids]


def now(device: torch.device) -> float:
    """Seconds, after the device's queued work (a GPU runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
