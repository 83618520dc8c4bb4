"""One step's forward and backward: the task's loss over the batch, whole or in pieces (gradient
accumulation, and the micro-batches the noise measurement needs), leaving the batch-mean
gradient in `.grad`; and the measured noise scale converted to the task's example unit."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Any

import torch

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.common import split_batch
from gnsweep.noise import NoiseEstimate
from gnsweep.tasks import Task
from gnsweep.tasks.protocol import first_dim
from gnsweep.training.recipe import Precision


def pieces(monitor: NoiseScaleMonitor, microbatch_size: int, wanted: int, samples: int) -> int:
    """Forward/backward passes for this step's `samples`.

    `microbatch_size` > 0 bounds the memory: ceil(samples / microbatch_size) pieces of at most
    that many samples (gradient accumulation), and the monitor's micro-batch estimate reuses
    them where it needs micro-batches (at no extra pass). Otherwise micro-batches only where
    the monitor needs them (method microbatch, or per_example with layers it cannot handle,
    or the preconditioned pair of an adaptive optimizer: `wants_microbatches`) and measures:
    `wanted` (noise.microbatches) of them, each of at least one sample."""
    if microbatch_size and samples > microbatch_size:
        return math.ceil(samples / microbatch_size)
    return monitor.microbatches(wanted, samples)


def backward(trained: torch.nn.Module, task: Task, batch: Any, k: int,
             monitor: NoiseScaleMonitor, precision: Precision | None = None) -> float:
    """Forward and backward over `k` pieces; `.grad` ends as the batch-mean gradient (times
    the precision's loss scale until it is unscaled). Returns the batch-mean loss.

    Pieces are weighted by their share of the batch's first dimension; the monitor records
    each (`accumulate()`). Under DDP the gradients are all-reduced once, with the last piece
    (`no_sync` before it). The task's loss runs under the precision's autocast. A batch that
    cannot be split (`split_batch`) is back-propagated whole, said once. `precision`: fp32 when
    not given."""
    precision = precision if precision is not None else Precision("fp32", torch.device("cpu"))
    parts = split_batch(batch, k) if k > 1 else None
    if k > 1 and parts is None:
        monitor.warn_once("nosplit", f"this task's batch cannot be split into {k} pieces "
                          "along dim 0; back-propagating it whole")
    if parts is None:
        with precision.autocast():
            loss = _scalar(task.loss(trained, batch))
        precision.scale(loss).backward()
        return float(loss.detach())
    total, n = 0.0, first_dim(batch) or 1
    for j, part in enumerate(parts):
        weight = (first_dim(part) or 0) / n
        last = j == len(parts) - 1
        with _sync(trained, last):
            with precision.autocast():
                loss = _scalar(task.loss(trained, part))
            precision.scale(loss * weight).backward()
        total += weight * float(loss.detach())
        monitor.accumulate()
    return total


def _sync(trained: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager[Any]:
    """DDP's `no_sync` before the last piece (the gradients accumulate locally, then one
    all-reduce); nothing outside DDP."""
    if last or not isinstance(trained, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return trained.no_sync()


def _scalar(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"task.loss must return the batch-mean loss as a scalar tensor, got "
                         f"{shape}")
    return loss


def in_task_units(estimate: NoiseEstimate | None, per_sample: float) -> NoiseEstimate | None:
    """The estimate with batch sizes and noise scales in the task's example unit.

    The monitor counts samples, the batch's first dimension (a language model's windows,
    cartpole's environments); a task counting `per_sample` examples in each (tokens,
    environment steps) has B_simple, B_noise, tr(Sigma) and tr(H Sigma) per example
    `per_sample` times those per sample, so that B / B_simple is unit-free."""
    if estimate is None or per_sample == 1:
        return estimate
    return replace(estimate, b_small=estimate.b_small * per_sample,
                   b_big=estimate.b_big * per_sample,
                   trace_sigma_step=estimate.trace_sigma_step * per_sample,
                   trace_sigma=estimate.trace_sigma * per_sample,
                   b_simple=estimate.b_simple * per_sample,
                   b_simple_se=estimate.b_simple_se * per_sample,
                   trace_sigma_precond=estimate.trace_sigma_precond * per_sample,
                   b_simple_precond=estimate.b_simple_precond * per_sample,
                   trace_h_sigma=estimate.trace_h_sigma * per_sample,
                   b_noise=estimate.b_noise * per_sample)
