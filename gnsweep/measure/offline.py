"""B_simple (eq. 2.9) and B_noise (eq. 2.8) once, at a model's current parameters
(`measure_noise_scale`): a `NoiseScaleMonitor` driven over a few batches without an optimizer
step, the estimate pooled over all of them."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gnsweep.measure.common import Batch, LossFn, TaskLoss, batch_len, batch_loss, split_batch
from gnsweep.measure.monitor import NoiseScaleMonitor
from gnsweep.noise import Method, NoiseEstimate


def measure_noise_scale(model: nn.Module, loss_fn: LossFn | None, batches: Iterable[Batch],
                        method: str = "auto", hessian: bool = False, *,
                        microbatches: int = 4, hessian_microbatches: int = 2,
                        parameters: Iterable[nn.Parameter] | None = None,
                        task_loss: TaskLoss | None = None) -> NoiseEstimate:
    """B_simple (eq. 2.9), and with `hessian=True` B_noise (eq. 2.8), at the model's current
    parameters: no optimizer step is taken and `.grad` is left as it was.

    `loss_fn(outputs, targets)` returns the batch-mean loss; `batches` yields `(inputs, targets)`
    (inputs a tensor, or a tuple of tensors passed as `model(*inputs)`). The squared norms of
    all batches are pooled with equal weights (eq. A.2 on the means), so the estimate sharpens
    with more batches. `microbatches`: the split for method="microbatch" (and for layers without
    per-example norms). `parameters`: the measured block, as for `NoiseScaleMonitor`.
    `method="auto"`: micro-batches for a model with batch statistics, else per-example norms.

    A model with batch statistics (BatchNorm in train mode, docs/noise.md): per-example norms
    are refused (ValueError); with `method="microbatch"` each batch is one draw of the batch
    gradient with its own statistics, exactly as it trains, and the batches pooled are the
    larger batch of eq. A.2 (b_small = a batch, b_big = all of them): this needs >= 2
    batches and measures the noise at the batches' size.
    With `task_loss(model, batch)` instead of `loss_fn` (pass `loss_fn=None`), `batches` yields
    whatever a task samples (a tensor or a tuple / list / dict of tensors, split along dim 0),
    e.g. `measure_noise_scale(model, None, batches, task_loss=task.loss)`.
    """
    if microbatches < 2:
        raise ValueError(f"microbatches={microbatches}: need >= 2")
    if (loss_fn is None) == (task_loss is None):
        raise ValueError("give exactly one of loss_fn(outputs, targets) and "
                         "task_loss(model, batch)")
    monitor = NoiseScaleMonitor(model, method, ema_steps=math.inf, loss_fn=loss_fn,
                                hessian_every=1 if hessian else 0,
                                hessian_microbatches=hessian_microbatches,
                                parameters=parameters, task_loss=task_loss)
    saved = [p.grad for p in monitor.params]
    if monitor.method == Method.MICROBATCH and any(m.training for m in monitor._batch_stats):
        try:
            if hessian:
                raise ValueError("B_noise (hessian=True) cannot be measured on a model with "
                                 "batch statistics: its Hessian passes split the batch; use "
                                 "hessian=False, or put those layers in eval() mode")
            return _whole_batches(monitor, model, loss_fn, task_loss, list(batches))
        finally:
            monitor.close()
            for p, grad in zip(monitor.params, saved, strict=True):
                p.grad = grad
    try:
        for batch in batches:
            n = batch_len(batch if task_loss is not None else batch[0])
            if monitor.method == Method.MICROBATCH and n < 2:
                raise ValueError("method='microbatch' cannot split a batch of one example into "
                                 "micro-batches; use larger batches or method='per_example'")
            for again in (False, True):
                k = min(microbatches, n) if monitor.needs_microbatches else 1
                for p in monitor.params:
                    p.grad = None
                for part, share in _pieces(batch, k, n, task_loss is not None):
                    if task_loss is not None:
                        with torch.enable_grad():
                            loss = task_loss(model, part)
                    else:
                        assert loss_fn is not None
                        loss = batch_loss(model, loss_fn, *part)
                    (loss * share).backward()
                    monitor.accumulate()
                if again:  # B_noise was measured on this batch the first time
                    monitor.hessian_every, hessian_every = 0, monitor.hessian_every
                    monitor.step(batch=batch)
                    monitor.hessian_every = hessian_every
                else:
                    monitor.step(batch=batch)
                if not monitor.auto.redo:
                    break
                # The measurement of this batch was discarded where the method or coverage
                # changed: measured again the new way, as one batch, not two.
                monitor.auto.redo = False
                monitor._since_examples = monitor._since_steps = 0
    finally:
        monitor.close()
        for p, grad in zip(monitor.params, saved, strict=True):
            p.grad = grad
    if monitor.estimate is None:
        raise ValueError("no batch could be measured: give at least one batch of >= 2 examples")
    return monitor.estimate



def _whole_batches(monitor: NoiseScaleMonitor, model: nn.Module, loss_fn: LossFn | None,
                   task_loss: TaskLoss | None, batches: list[Batch]) -> NoiseEstimate:
    """Eq. A.2 with each batch's gradient (its own batch statistics) as one small batch and
    their mean as the big one: the brute-force definition of a batch-statistics model's noise,
    without splitting a batch."""
    if len(batches) < 2:
        raise ValueError("a model with batch statistics is measured from >= 2 independent "
                         "batches (each with its own statistics): give more batches")
    sizes = [batch_len(b if task_loss is not None else b[0]) for b in batches]
    total = sum(sizes)
    monitor._whole_batches = True
    for p in monitor.params:
        p.grad = None
    for batch, n in zip(batches, sizes, strict=True):
        if task_loss is not None:
            with torch.enable_grad():
                loss = task_loss(model, batch)
        else:
            assert loss_fn is not None
            loss = batch_loss(model, loss_fn, *batch)
        (loss * (n / total)).backward()
        monitor.accumulate()
    monitor.step()
    assert monitor.estimate is not None
    return monitor.estimate


def _pieces(batch: Batch, k: int, n: int, whole: bool) -> list[tuple[Any, float]]:
    """`batch` in k micro-batches along dim 0 (`split_batch`: `(inputs, targets)` are cut alike
    for loss_fn), each with its share of the n examples."""
    if k == 1:
        return [(batch, 1.0)]
    parts = split_batch(batch, k)
    if parts is None:
        raise ValueError("the batch cannot be split along dim 0 into micro-batches; use "
                         "method='per_example' or batches of tensors of equal length")
    return [(part, batch_len(part if whole else part[0]) / n) for part in parts]
