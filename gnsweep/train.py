"""One run, top to bottom: build the task, train at one (batch size, learning rate), measure
B_simple on the way, stop at the hardest target, the budget, or divergence; write metrics.

Stopping and smoothing follow the paper's appendix A: a target counts as reached when the
exponentially smoothed training loss falls to it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from gnsweep import store
from gnsweep.analysis.smoothing import MIN_WINDOW_EXAMPLES, SMOOTHING_FRACTION
from gnsweep.config import Config
from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.probe import RunProbes, overrun_steps
from gnsweep.noise import Ema, NoiseEstimate, ema_decay
from gnsweep.runs import RunSpec
from gnsweep.tasks import make_task


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
          should_stop: Callable[[], bool] | None = None) -> RunResult:
    """Train one run; write `out_dir/metrics.parquet` (when given) atomically at the end.

    Under torch.distributed every rank calls this with the same arguments; only rank 0 passes
    `out_dir` (the executors gate every write on the rank).
    """
    sweep, noise = config.sweep, config.noise
    torch.manual_seed(spec.seed)
    task = make_task(config.task.name, config.task.options, spec.seed)
    # Under torchrun (a process group initialised by the worker entry point) every rank trains
    # a DDP replica on its own B/N examples a step; without one, this process does all B.
    world, rank, device = placement()
    if spec.batch_size % world:
        raise ValueError(f"batch size {spec.batch_size} is not divisible by the {world} "
                         "DDP workers")
    per_worker = spec.batch_size // world
    model = task.model().to(device)
    trained: torch.nn.Module = model
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None)
    if sweep.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=spec.learning_rate, momentum=sweep.momentum)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=spec.learning_rate)
    method = resolve_method(noise.method)
    if trained is not model and method != "ddp":
        raise ValueError(f"noise.method={method} under torchrun: use ddp (or auto), which "
                         "reads each worker's gradient before the all-reduce")
    monitor = NoiseScaleMonitor(trained, method=method, every=noise.every,
                                ema_steps=noise.ema_steps, ema_examples=noise.ema_examples,
                                loss_fn=task.loss, hessian_every=noise.hessian_every,
                                ema_fraction=noise.ema_fraction)
    probes = RunProbes(noise, task, spec.seed)  # frozen-parameter probes, exact truth
    # Micro-batches only where the monitor needs them (method microbatch, or per_example with
    # layers it cannot handle), each of at least one example.
    k = min(noise.microbatches, spec.batch_size) if monitor.needs_microbatches else 1
    # Each rank draws its own examples; rank 0 alone draws what a single process would.
    data_rng = torch.Generator().manual_seed(10_000 + spec.seed + 1_000_003 * rank)
    eval_data = task.eval_data() if sweep.eval_every else None
    if eval_data is not None:
        eval_data = (eval_data[0].to(device), eval_data[1].to(device))
    hardest = min(sweep.targets)
    loss_decay = ema_decay(spec.batch_size, examples_scale=sweep.loss_ema_examples)

    rows: dict[str, list] = {f.name: [] for f in store.METRICS_SCHEMA}
    loss_ema, first_loss = Ema(), math.nan
    estimate, stop_at = None, None
    start = time.perf_counter()
    state, reason, step, loss_value = "done", "max_steps", 0, math.nan
    try:
        while step < sweep.max_steps:
            if sweep.max_examples and step * spec.batch_size >= sweep.max_examples:
                reason = "max_examples"
                break
            stop = should_stop is not None and should_stop()
            if stop and world == 1:
                raise KeyboardInterrupt
            x, y = task.batch(per_worker, data_rng)
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            measure = monitor.measuring
            loss_value = _backward(trained, task, x, y, k if measure else 1, monitor, measure)
            if world > 1:
                # Every rank must decide alike (stop, diverged, done): one small all-reduce.
                loss_value, stop = _agree(loss_value, stop, device)
                if stop:
                    raise KeyboardInterrupt
            # Every step: the monitor counts steps and measures every noise.every of them;
            # the batch lets it measure B_noise every noise.hessian_every steps.
            estimate = monitor.step(batch=(x, y))
            optimizer.step()
            step += 1

            if not math.isfinite(loss_value):
                raise Diverged(f"loss is {loss_value} at step {step}")
            if step == 1:
                first_loss = loss_value
            loss_ema.update(loss_value, loss_decay)
            smooth = loss_ema.value
            if smooth > sweep.divergence_factor * first_loss:
                raise Diverged(f"smoothed loss {smooth:.3g} > {sweep.divergence_factor:g} x "
                               f"first loss {first_loss:.3g} at step {step}")
            # Past the hardest target, train on until the analysis's centred window is whole.
            if stop_at is None and smooth <= hardest:
                stop_at = step + overrun_steps(step, spec.batch_size, SMOOTHING_FRACTION,
                                               MIN_WINDOW_EXAMPLES)
            done = stop_at is not None and step >= stop_at
            if step % sweep.log_every == 0 or done:
                eval_loss = math.nan
                if sweep.eval_every and step % sweep.eval_every == 0:
                    exact = probes.exact_loss(model)
                    eval_loss = exact if exact is not None else (
                        _eval_loss(model, task, eval_data) if eval_data is not None else math.nan)
                _log(rows, step, spec, loss_value, smooth, eval_loss, estimate,
                     time.perf_counter() - start, probes.values(model, step * spec.batch_size))
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


def _agree(loss: float, stop: bool, device: torch.device) -> tuple[float, bool]:
    """The global batch-mean loss (equal per-rank batches) and whether any rank must stop."""
    both = torch.tensor([loss, float(stop)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(both)
    return float(both[0]) / torch.distributed.get_world_size(), bool(both[1] > 0)


def _backward(model: torch.nn.Module, task, x: torch.Tensor, y: torch.Tensor, k: int,
              monitor: NoiseScaleMonitor, measure: bool) -> float:
    """Forward and backward over `k` micro-batches; `.grad` ends as the batch-mean gradient."""
    total = 0.0
    for xs, ys in zip(x.tensor_split(k), y.tensor_split(k), strict=True):
        weight = len(xs) / len(x)
        loss = task.loss(model(xs), ys)
        (loss * weight).backward()
        total += weight * float(loss.detach())
        if measure and k > 1:
            monitor.accumulate()
    return total


@torch.no_grad()
def _eval_loss(model: torch.nn.Module, task, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    was_training = model.training
    model.eval()
    loss = float(task.loss(model(data[0]), data[1]))
    model.train(was_training)
    return loss


def _log(rows: dict[str, list], step: int, spec: RunSpec, loss: float, smooth: float,
         eval_loss: float, estimate: NoiseEstimate | None, wall: float,
         extra: dict[str, float]) -> None:
    nan = math.nan
    values = {
        "step": step, "examples": step * spec.batch_size, "loss": loss, "loss_smooth": smooth,
        "eval_loss": eval_loss, "lr": spec.learning_rate, "wall_time": wall,
    }
    # The noise columns of the schema are the estimate's fields, by name.
    for field in fields(NoiseEstimate):
        values[field.name] = getattr(estimate, field.name) if estimate is not None else nan
    values.update(extra)  # probes and exact truth (gnsweep.measure.probe)
    for name, value in values.items():
        rows[name].append(value)
