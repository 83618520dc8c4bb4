"""One step's forward and backward: the task's loss over the batch, whole or in the micro-batches
the noise measurement needs, leaving the batch-mean gradient in `.grad`; and the measured noise
scale converted to the task's example unit."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.common import split_batch
from gnsweep.noise import NoiseEstimate
from gnsweep.tasks import Task
from gnsweep.tasks.protocol import first_dim


def microbatches(monitor: NoiseScaleMonitor, wanted: int, samples: int) -> int:
    """Micro-batches for this step: only where the monitor needs them (method microbatch, or
    per_example with layers it cannot handle) and measures, each of at least one sample."""
    return min(wanted, samples) if monitor.measuring and monitor.needs_microbatches else 1


def backward(model: torch.nn.Module, task: Task, batch: Any, k: int,
             monitor: NoiseScaleMonitor) -> float:
    """Forward and backward over `k` micro-batches; `.grad` ends as the batch-mean gradient.

    Micro-batches are weighted by their share of the batch's first dimension. A batch that
    cannot be split (`split_batch`) is back-propagated whole, said once."""
    parts = split_batch(batch, k) if k > 1 else None
    if k > 1 and parts is None:
        monitor.warn_once("nosplit", f"noise scale: this task's batch cannot be split into {k} "
                          "micro-batches along dim 0; back-propagating it whole")
    if parts is None:
        loss = _scalar(task.loss(model, batch))
        loss.backward()
        return float(loss.detach())
    total, n = 0.0, first_dim(batch) or 1
    for part in parts:
        weight = (first_dim(part) or 0) / n
        loss = _scalar(task.loss(model, part))
        (loss * weight).backward()
        total += weight * float(loss.detach())
        monitor.accumulate()
    return total


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
                   trace_h_sigma=estimate.trace_h_sigma * per_sample,
                   b_noise=estimate.b_noise * per_sample)
