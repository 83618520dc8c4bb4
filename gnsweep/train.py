"""One run, top to bottom: build the task, train at one (batch size, learning rate), measure
B_simple on the way, stop at the hardest target, the budget, or divergence; write metrics.

Stopping and smoothing follow the paper's appendix A: a target counts as reached when the
exponentially smoothed training loss falls to it. The run then trains on until the analysis's
centred window there is whole, and stops only once that centred reading (what `gnsweep analyze`
uses, free of the EMA's lag) has the hardest target reached too. A task with its own metric
(cartpole's return, `config.task.metric`) has it logged in the `metric` column and its targets
reached on it, in the task's direction.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gnsweep import store
from gnsweep.analysis.smoothing import (
    MIN_WINDOW_EXAMPLES,
    SMOOTHING_FRACTION,
    settled_at_or_below,
)
from gnsweep.config import Config
from gnsweep.errors import StopRequested
from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.common import split_batch
from gnsweep.measure.probe import RunProbes, overrun_steps
from gnsweep.noise import Ema, NoiseEstimate, ema_decay
from gnsweep.optim import make_optimizer
from gnsweep.runs import RunSpec
from gnsweep.schedule import AdaptiveBatch, BatchSchedule, ConstantBatch, Progress
from gnsweep.tasks import Task, examples_of, make_task
from gnsweep.tasks.protocol import first_dim

__all__ = ["Diverged", "RunResult", "StopRequested", "placement", "resolve_method", "train"]


class Diverged(RuntimeError):
    """The loss became NaN/inf or grew far above where it started."""


@dataclass(frozen=True)
class RunResult:
    state: str
    """done or diverged."""
    steps: int
    reason: str
    """Why the run stopped: target, max_steps, max_examples, or what diverged."""
    final_loss: float
    train_seconds: float


def resolve_method(method: str) -> str:
    """`auto`: the DDP hook under torch.distributed, else per-example norms in this process."""
    if method != "auto":
        return method
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "ddp"
    return "per_example"


def train(config: Config, spec: RunSpec, out_dir: Path | None,
          should_stop: Callable[[], bool] | None = None,
          on_row: Callable[[dict[str, float]], None] | None = None) -> RunResult:
    """Train one run; write `out_dir/metrics.parquet` (when given) atomically at the end.

    The task owns the forward pass and the loss (`task.loss(model, batch)`); the loop draws
    each step's batch at the size the schedule asks, counts its examples (`task.examples`),
    measures the noise scale, and stops at the hardest target, the budget or divergence.
    Raises StopRequested when `should_stop()` says so (the run goes back to pending).

    `on_row` sees every metrics row as it is logged (a run logger; it must not raise).

    Under torch.distributed every rank calls this with the same arguments; only rank 0 passes
    `out_dir` (the executors gate every write on the rank).
    """
    sweep, noise = config.sweep, config.noise
    torch.manual_seed(spec.seed)
    task = make_task(config.task.name, config.task.options, spec.seed)
    # Under torchrun (a process group initialised by the worker entry point) every rank trains
    # a DDP replica on its own B/N examples a step; without one, this process does all B.
    world, rank, device = placement()
    model, trained = _build_model(task, device)
    optimizer = make_optimizer(sweep.optimizer, model.parameters(), lr=spec.learning_rate,
                               momentum=sweep.momentum)
    monitor = _make_monitor(model, trained, task, config)
    schedule = _make_schedule(config, spec, world)
    probes = RunProbes(noise, task, spec.seed)  # frozen-parameter probes, exact truth
    # Each rank draws its own examples; rank 0 alone draws what a single process would.
    data_rng = torch.Generator().manual_seed(10_000 + spec.seed + 1_000_003 * rank)
    # A metric task's targets are values of task.metric(model), reached in its direction; its
    # loss (A2C's) has no scale to diverge from, so only a non-finite loss diverges.
    metric_task = config.task.metric != "loss"
    hardest = config.task.hardest(sweep.targets)

    rows: dict[str, list] = {f.name: [] for f in store.METRICS_SCHEMA}
    watch = LossWatch(sweep.loss_ema_examples,
                      None if metric_task else sweep.divergence_factor)
    estimate: NoiseEstimate | None = None
    stop_at: int | None = None
    per_sample = 1.0
    start = time.perf_counter()
    state, reason, step, examples = "done", "max_steps", 0, 0
    loss_value = metric = math.nan
    try:
        while step < sweep.max_steps:
            if sweep.max_examples and examples >= sweep.max_examples:
                reason = "max_examples"
                break
            stop = should_stop is not None and should_stop()
            if stop and world == 1:
                raise StopRequested
            size = schedule.next_batch_size(Progress(step, examples, estimate, per_sample))
            lr = _set_learning_rate(optimizer, schedule, spec.learning_rate)
            batch = _draw(task, size, world, data_rng, device)
            n_examples = examples_of(task, batch) * world
            if step == 0:
                monitor = _fallback_if_unsplittable(monitor, batch, model, trained, task, config)
            per_sample = n_examples / size
            # What the monitor calls a sample: the batch's first dimension (one environment's
            # segment for cartpole, a window for chars), the independent unit it splits on.
            samples = first_dim(batch) or size // world
            optimizer.zero_grad(set_to_none=True)
            k = _microbatches(monitor, noise.microbatches, samples)
            loss_value = _backward(trained, task, batch, k, monitor)
            # Measured before the update, like the loss: the episodes of this step's rollouts.
            metric = _metric(task, model) if metric_task else math.nan
            if world > 1:
                # Every rank must decide alike (stop, diverged, done): one small all-reduce.
                loss_value, metric, stop = _agree(loss_value, metric, stop, device)
                if stop:
                    raise StopRequested
            # Every step: the monitor counts steps and measures every noise.every of them;
            # the batch lets it measure B_noise every noise.hessian_every steps.
            # The EMA's time constant (noise.ema_examples) counts this rank's examples in the
            # task's unit, as its forward calls would count samples.
            estimate = _in_task_units(monitor.step(batch=batch, examples=n_examples // world),
                                      n_examples / (samples * world))
            optimizer.step()
            step += 1
            examples += n_examples

            smooth = watch.update(loss_value, n_examples, step)
            # Past the hardest target, train on until the analysis's centred window is whole
            # (a metric is read as logged, no window: stop at once). NaN reaches nothing.
            if stop_at is None and config.task.reached(metric if metric_task else smooth,
                                                       hardest):
                stop_at = step + (0 if metric_task else overrun_steps(
                    step, n_examples, SMOOTHING_FRACTION, MIN_WINDOW_EXAMPLES))
            done = stop_at is not None and step >= stop_at
            if step % sweep.log_every == 0 or done:
                eval_loss = math.nan
                if sweep.eval_every and step % sweep.eval_every == 0:
                    exact = probes.exact_loss(model)
                    eval_loss = exact if exact is not None else _eval_loss(model, task)
                row = _log(rows, step, examples, spec, loss_value, smooth, metric, eval_loss,
                           estimate, time.perf_counter() - start,
                           {**probes.values(model, examples), "batch_size": size, "lr": lr})
                if on_row is not None:
                    on_row(row)
            if done and not metric_task and not _analysis_reached(rows, hardest, n_examples):
                # The causal EMA crossed, but the analysis's centred reading of the logged
                # losses has not (near a loss floor they differ): train on and look again.
                stop_at, done = None, False
            if done:
                reason = "target"
                break
    except Diverged as err:
        state, reason = "diverged", str(err)
    finally:
        monitor.close()
    if out_dir is not None:
        store.write_table(out_dir / store.METRICS, store.metrics_table(rows))
    return RunResult(state, step, reason, loss_value, time.perf_counter() - start)


class LossWatch:
    """The smoothed training loss (paper appendix A), and divergence: a NaN/inf loss, or a
    smoothed loss above `factor` x the first (None: only a NaN/inf loss, for a loss that may be
    negative or grow, like A2C's)."""

    def __init__(self, ema_examples: float, factor: float | None) -> None:
        self.ema_examples, self.factor = ema_examples, factor
        self.ema, self.first = Ema(), math.nan

    def update(self, loss: float, examples: int, step: int) -> float:
        """Fold in step `step`'s loss over `examples` examples; the smoothed loss, or Diverged.

        The time constant is in examples (decay exp(-examples / ema_examples) per step), so
        every batch size averages over the same amount of data."""
        if not math.isfinite(loss):
            raise Diverged(f"loss is {loss} at step {step}")
        if step == 1:
            self.first = loss
        self.ema.update(loss, ema_decay(examples, examples_scale=self.ema_examples))
        smooth = self.ema.value
        if self.factor is not None and smooth > self.factor * self.first:
            raise Diverged(f"smoothed loss {smooth:.3g} > {self.factor:g} x first loss "
                           f"{self.first:.3g} at step {step}")
        return smooth


def _make_schedule(config: Config, spec: RunSpec, world: int) -> BatchSchedule:
    """The grid point's fixed batch size, or an adaptive run's B = sqrt(r B_noise) (appendix D)
    with its learning-rate rule (eq. 2.7; `spec.learning_rate` is then eps_max)."""
    if not spec.adaptive:
        return ConstantBatch(spec.batch_size)
    sweep = config.sweep
    low, high = sweep.adaptive_bounds()
    return AdaptiveBatch(spec.exchange_rate, spec.learning_rate, low, high,
                         sweep.adaptive_min_change, world, spec.lr_noise)


def _set_learning_rate(optimizer: torch.optim.Optimizer, schedule: BatchSchedule,
                       learning_rate: float) -> float:
    """This step's learning rate: the run's, or an adaptive schedule's eps(B) (set on the
    optimizer before its step)."""
    if isinstance(schedule, AdaptiveBatch):
        learning_rate = schedule.learning_rate()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
    return learning_rate


def _build_model(task: Task, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the task's model on `device`, the module to train: DDP-wrapped under torchrun)."""
    model = task.model().to(device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.nn.parallel import DistributedDataParallel

        return model, DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None)
    return model, model


def _make_monitor(model: torch.nn.Module, trained: torch.nn.Module, task: Task, config: Config,
                  method: str | None = None) -> NoiseScaleMonitor:
    noise = config.noise
    method = method or resolve_method(noise.method)
    if isinstance(trained, torch.nn.parallel.DistributedDataParallel) and method != "ddp":
        raise ValueError(f"noise.method={method} under torchrun: use ddp (or auto), which "
                         "reads each worker's gradient before the all-reduce")
    # The Hessian passes run the task's own loss on the unwrapped model (`task_loss`).
    return NoiseScaleMonitor(trained, method=method, every=noise.every,
                             ema_steps=noise.ema_steps, ema_examples=noise.ema_examples,
                             task_loss=task.loss, hessian_every=noise.hessian_every,
                             ema_fraction=noise.ema_fraction,
                             parameters=_noise_parameters(task, model))


def _noise_parameters(task: Task, model: torch.nn.Module) -> list[torch.nn.Parameter] | None:
    """The task's `noise_parameters(model)` (the block whose gradient the noise scale is
    measured on: an actor-critic's actor), or None: every trainable parameter."""
    choose = getattr(task, "noise_parameters", None)
    return None if choose is None else list(choose(model))


def _fallback_if_unsplittable(monitor: NoiseScaleMonitor, batch: Any, model: torch.nn.Module,
                              trained: torch.nn.Module, task: Task,
                              config: Config) -> NoiseScaleMonitor:
    """noise.method=microbatch on a batch that cannot be cut along dim 0: per-example norms
    instead, said once (they need no split, except for layers they do not cover; a batch of one
    sample, cartpole's one environment, they leave unmeasured, NaN)."""
    if monitor.method != "microbatch" or split_batch(batch, 2) is not None:
        return monitor
    monitor.warn_once("nosplit", "noise scale: this task's batch cannot be split along dim 0 "
                      "(no tensor, tensors of different lengths, or one sample): measuring "
                      "with per-example norms instead of micro-batches")
    monitor.close()
    return _make_monitor(model, trained, task, config, method="per_example")


def _draw(task: Task, size: int, world: int, generator: torch.Generator,
          device: torch.device) -> Any:
    """This rank's share (size / world samples) of the step's batch, on `device`."""
    if size % world:
        raise ValueError(f"batch size {size} is not divisible by the {world} DDP workers")
    return _to_device(task.sample(size // world, generator), device)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def placement() -> tuple[int, int, torch.device]:
    """(world size, rank, device): one GPU per local rank under an nccl process group, else the
    CPU; (1, 0, cpu) without torch.distributed."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, torch.device("cpu")
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_world_size(), dist.get_rank(), device


def _analysis_reached(rows: dict[str, list], target: float, batch_examples: int) -> bool:
    """Whether `gnsweep analyze` will read the hardest loss target as reached from the rows
    logged so far: the centred smooth of the training loss (at step - 1 updates, as
    analysis.steps reads it) at or below it where its window is already whole."""
    x = np.asarray(rows["step"], float) - 1.0
    return settled_at_or_below(x, np.asarray(rows["loss"], float), target, SMOOTHING_FRACTION,
                               MIN_WINDOW_EXAMPLES / batch_examples)


def _agree(loss: float, metric: float, stop: bool,
           device: torch.device) -> tuple[float, float, bool]:
    """The global batch-mean loss (equal per-rank batches), the ranks' mean metric (NaN while
    any rank has none) and whether any rank must stop."""
    values = torch.tensor([loss, metric, float(stop)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(values)
    world = torch.distributed.get_world_size()
    return float(values[0]) / world, float(values[1]) / world, bool(values[2] > 0)


def _microbatches(monitor: NoiseScaleMonitor, wanted: int, samples: int) -> int:
    """Micro-batches for this step: only where the monitor needs them (method microbatch, or
    per_example with layers it cannot handle) and measures, each of at least one sample."""
    return min(wanted, samples) if monitor.measuring and monitor.needs_microbatches else 1


def _backward(model: torch.nn.Module, task: Task, batch: Any, k: int,
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


def _in_task_units(estimate: NoiseEstimate | None, per_sample: float) -> NoiseEstimate | None:
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


def _metric(task: Task, model: torch.nn.Module) -> float:
    """The task's own metric, `task.metric(model)` (NaN until it has one: no episode ended)."""
    measure: Callable[[torch.nn.Module], float] = getattr(task, "metric")  # noqa: B009
    return float(measure(model))


@torch.no_grad()
def _eval_loss(model: torch.nn.Module, task: Task) -> float:
    """The task's `eval_loss(model)` in eval mode (NaN when the task has none)."""
    evaluate = getattr(task, "eval_loss", None)
    if evaluate is None:
        return math.nan
    was_training = model.training
    model.eval()
    try:
        return float(evaluate(model))
    finally:
        model.train(was_training)


def _log(rows: dict[str, list], step: int, examples: int, spec: RunSpec, loss: float,
         smooth: float, metric: float, eval_loss: float, estimate: NoiseEstimate | None,
         wall: float, extra: dict[str, float]) -> dict[str, float]:
    nan = math.nan
    values = {
        "step": step, "examples": examples, "loss": loss, "loss_smooth": smooth,
        "eval_loss": eval_loss, "lr": spec.learning_rate, "wall_time": wall, "metric": metric,
    }
    # The noise columns of the schema are the estimate's fields, by name.
    for field in fields(NoiseEstimate):
        values[field.name] = getattr(estimate, field.name) if estimate is not None else nan
    values.update(extra)  # probes and exact truth (gnsweep.measure.probe)
    for name, value in values.items():
        rows[name].append(value)
    return values
