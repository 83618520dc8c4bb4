"""Models whose examples interact through batch statistics (BatchNorm of any dimension,
SyncBatchNorm, any layer that keeps running statistics), and the measurement method each case
allows.

In such a model the gradient of a batch is not the mean of independent per-example gradients:
every example's output depends on the whole batch's mean and variance. The noise scale of such
a model is defined for the batch gradient at the batch that normalises together (eq. A.1 with
`tr(Sigma) = b Cov(G_b)`, `b` the examples normalised together): what brute force measures from
many independent batches. Independent batches that each keep their own statistics (micro-batches
of gradient accumulation, DDP ranks, separate batches at fixed parameters) measure it; the sum of
per-example norms does not (docs/noise.md, "Models with batch statistics").
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from gnsweep.measure.common import is_ddp, say_once
from gnsweep.measure.fsdp import fsdp_refusal, sharded_parameters
from gnsweep.noise import Method

_RUNNING = ("running_mean", "running_var")


def batch_statistics_layers(model: nn.Module, *, training_only: bool = True
                            ) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every layer that normalises with statistics of the batch: BatchNorm1d/2d/
    3d, their lazy forms, SyncBatchNorm, and any other layer holding `running_mean` or
    `running_var` buffers (instance norms excepted: they normalise each example alone).
    `training_only`: only layers in train mode (in eval mode they use running statistics and
    the examples are independent)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.instancenorm._InstanceNorm):
            continue
        batch_norm = isinstance(module, nn.modules.batchnorm._BatchNorm)
        running = _own_buffer(module)
        # A BatchNorm without running statistics normalises with the batch's even in eval().
        batch_always = batch_norm and not getattr(module, "track_running_stats", True)
        if (batch_norm or running) and (module.training or batch_always or not training_only):
            found.append((name or type(module).__name__, module))
    return found


def _own_buffer(module: nn.Module) -> bool:
    own = {name for name, buffer in module.named_buffers(recurse=False) if buffer is not None}
    return any(b in own for b in _RUNNING)


def _names(layers: Sequence[tuple[str, nn.Module]]) -> str:
    shown = ", ".join(f"{name} ({type(m).__name__})" for name, m in layers[:3])
    return shown + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")


def per_example_refusal(model: nn.Module) -> str | None:
    """Why per-example norms cannot measure this model (one line), or None."""
    layers = batch_statistics_layers(model)
    if not layers:
        return None
    return (f"per-example gradient norms cannot measure this model: {_names(layers)} normalise "
            "with statistics of the batch, so its examples are not independent and the sum of "
            "per-example norms is not the batch gradient's noise; use method='microbatch' "
            "(independent batches, each with its own statistics), method='ddp' under torchrun, "
            "or put those layers in eval() mode")


def ddp_refusal(model: nn.Module) -> str | None:
    """Why the per-worker gradients of a DDP model are not independent batches, or None."""
    sync = [(n, m) for n, m in batch_statistics_layers(model)
            if isinstance(m, nn.SyncBatchNorm)]
    if not sync:
        return None
    return (f"the noise scale cannot be measured on this model: {_names(sync)} share batch "
            "statistics across ranks, so the ranks' gradients are not independent batches and "
            "no split of the batch keeps the training's statistics; use BatchNorm (per-rank "
            "statistics) to measure it")


def choose_method(model: nn.Module, requested: str, *, distributed: bool | None = None) -> str:
    """The measurement method for `model`: `requested`, or for "auto" the right one for this
    model and launch (fsdp for a model sharded by `fully_shard`, ddp for a
    DistributedDataParallel model on several ranks, micro-batches
    for a model with batch statistics, else per-example norms). Raises ValueError, one line
    saying why and what to use, where the requested method would be wrong for this model.
    `distributed`: whether `.grad` is all-reduced over several ranks (default: a DDP model in
    an initialised process group of more than one rank)."""
    import torch.distributed as dist

    if sharded_parameters(model):
        # FSDP: each rank's micro-step gradients and the sharded global gradient (measure.fsdp).
        reason = fsdp_refusal(model) or ddp_refusal(model)
        if reason is not None:
            raise ValueError(reason)
        if requested not in (Method.AUTO, Method.FSDP):
            raise ValueError(f"method={requested!r} cannot measure a model sharded by FSDP (its "
                             "gradients are reduce-scattered shards): use method='auto' or "
                             "'fsdp' (each rank's micro-steps against the global gradient)")
        return "fsdp"
    if requested == Method.FSDP:
        raise ValueError("method='fsdp' needs a model sharded by "
                         "torch.distributed.fsdp.fully_shard; use method='auto'")
    if distributed is None:
        distributed = is_ddp(model) and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1
    if requested == Method.AUTO:
        requested = "ddp" if distributed else (
            "microbatch" if batch_statistics_layers(model) else "per_example")
    if requested == Method.DDP and distributed:
        reason = ddp_refusal(model)
        if reason is not None:
            raise ValueError(reason)
    if requested == Method.PER_EXAMPLE:
        reason = per_example_refusal(model)
        if reason is not None:
            raise ValueError(reason)
    return requested


def say_ghost_batches(layers: Sequence[nn.Module], k: int) -> None:
    """Say once that layers with batch statistics normalise each of a measured step's `k`
    micro-batches on its own (ghost batches), where any of `layers` is in train mode."""
    training = [m for m in layers if m.training]
    if training and k > 1:
        say_once("ghost", f"noise scale: {type(training[0]).__name__} and any other layer "
                 f"with batch statistics normalise each of the {k} micro-batches of a "
                 "measured step on its own (ghost batches): the noise measured is that of the "
                 "gradient trained with, but where a batch is split only to measure, statistics "
                 f"come from B/{k} examples instead of B and running statistics are updated {k} "
                 "times a step (docs/noise.md)")
