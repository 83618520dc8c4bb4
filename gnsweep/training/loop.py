"""One run, top to bottom: train at one (batch size, learning rate), measure B_simple on the way,
stop at the hardest target, the budget, or divergence; write metrics.

Stopping and smoothing follow the paper's appendix A: a target counts as reached when the
exponentially smoothed training loss falls to it. The run then trains on until the analysis's
centred window there is whole, and stops only once that centred reading (what `gnsweep analyze`
uses, free of the EMA's lag) has the hardest target reached too. A task with its own metric
(cartpole's return, `tasks.about(config.task).metric`) has it logged in the `metric` column
and its targets reached on it, in the task's direction.

The run's parts and counters live in a `TrainState` (`gnsweep.training.state`): `train` builds
one and `run` advances it, so a run can be continued from its `state_dict()`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from gnsweep import store
from gnsweep.config import Config
from gnsweep.errors import StopRequested
from gnsweep.noise import Method, NoiseEstimate
from gnsweep.runs import RunSpec, unmeasured_share
from gnsweep.schedule import Progress
from gnsweep.tasks import Task, about, examples_of
from gnsweep.tasks.protocol import first_dim
from gnsweep.training.backward import backward, in_task_units, pieces
from gnsweep.training.branch_start import start_branch
from gnsweep.training.checkpoint import Checkpointer
from gnsweep.training.data import mean_loss
from gnsweep.training.recipe import clip_gradients, set_learning_rate
from gnsweep.training.state import (
    TrainState,
    build_run,
    fall_back_if_unsplittable,
    ride_accumulation,
)
from gnsweep.training.stop_rule import analysis_reached, stop_step
from gnsweep.training.watch import Diverged

log = logging.getLogger("gnsweep.training")

MIN_LOSS_SCALE = 2.0 ** -14
"""fp16: a loss scale halved below this (30 skipped steps from torch's 2^16) ends the run."""


@dataclass(frozen=True)
class RunResult:
    state: str
    """done or diverged."""
    steps: int
    reason: str
    """Why the run stopped: target, max_steps, max_examples, or what diverged."""
    final_loss: float
    train_seconds: float
    noise_method: dict[str, Any] | None = None
    """The method the noise scale was measured with: {"method", "reason", ...}; for
    noise.method=auto its choice and the measured step time, in seconds
    (`NoiseScaleMonitor.choice`)."""
    b_simple_nan_share: float | None = None
    """The share of the run's logged steps whose B_simple is NaN (`runs.unmeasured_share`)."""
    rows: int | None = None
    """Metrics rows the run logged (its metrics.parquet's row count)."""
    examples: int | None = None
    """Examples at its last logged row. The run's status records both: a table cut short or
    rewritten disagrees with them (`store.metrics_problem`)."""
    noise_measured: dict[str, Any] | None = None
    train_cpu_seconds: float | None = None
    """CPU seconds the run's training took (`RunState.cpu_elapsed`; None where not measured:
    a script's run)."""
    """What was measured (`measured_share`): the method (`none`: measurement off), noise.every,
    steps and measured steps, and their share."""


def train(config: Config, spec: RunSpec, out_dir: Path | None,
          should_stop: Callable[[], bool] | None = None,
          on_row: Callable[[dict[str, float]], None] | None = None,
          resume: bool = True) -> RunResult:
    """Train one run, from its latest checkpoint in `out_dir` when it has one (`resume`), else
    from step 0; checkpoints and rows go to `out_dir` as it trains (`train.checkpoint_every`,
    `train.checkpoint_seconds`), `out_dir/metrics.parquet` at the end. See `run`.

    Under torch.distributed every rank calls it; only rank 0 passes `out_dir`."""
    state = build_run(config, spec)
    if spec.at_examples:  # a branch run: the base run's model and optimizer at its point
        start_branch(state)  # (a resume below goes on from the run's own checkpoint instead)
    checkpoints = None
    if out_dir is not None or state.world > 1:
        checkpoints = make_checkpointer(config, out_dir)
        if resume:
            checkpoints.resume(state)
    return run(state, out_dir, should_stop, on_row, checkpoints)


def run(state: TrainState, out_dir: Path | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_row: Callable[[dict[str, float]], None] | None = None,
        checkpoints: Checkpointer | None = None) -> RunResult:
    """Train `state` on from where it stands to the end of the run.

    The task owns the forward pass and the loss (`task.loss(model, batch)`); the loop draws
    each step's batch at the size the schedule asks, counts its examples (`task.examples`),
    measures the noise scale, and stops at the hardest target, the budget or divergence.
    Raises StopRequested when `should_stop()` says so, between two steps (the run goes back to
    pending; `state` then stands at a step boundary, whole, and its monitor and data are
    closed: the run goes on from its checkpoint, `train`, and `run` refuses the same state).

    `on_row` sees every metrics row as it is logged (a run logger; it must not raise).

    `checkpoints` saves the state when a checkpoint is due, and when the run is stopped, at a
    step boundary; its rows reach `out_dir` on the way (`Checkpointer.flush_rows`).

    Under torch.distributed every rank calls this with the same arguments; only rank 0 passes
    `out_dir` (the executors gate every write on the rank).
    """
    if state.monitor.closed:
        raise ValueError("this run state already ended (stopped, finished or failed): its "
                         "monitor and data are closed; build it again from its checkpoint, "
                         "e.g. train(config, spec, out_dir)")
    config, spec, task = state.config, state.spec, state.task
    sweep, world = config.sweep, state.world
    # A metric task's targets are values of task.metric(model), reached in its direction.
    declared = about(config.task)
    metric_task = declared.metric != "loss"
    # A branch run with automatic targets trains its window and stops at no target; so does a
    # run of a sweep whose targets the analysis chooses (sweep.targets=auto), or of a
    # fixed-budget sweep (sweep.budget): its budget.
    hardest = None if (config.branch.points and config.branch.automatic) \
        or not sweep.stops_at_target else declared.hardest(sweep.targets)
    params = [p for p in state.model.parameters() if p.requires_grad]
    start = time.perf_counter() - state.elapsed
    cpu_start = time.process_time() - state.cpu_elapsed
    outcome, reason = "done", "max_steps"
    try:
        while state.step < sweep.max_steps:
            if sweep.max_examples and state.examples >= sweep.max_examples:
                reason = "max_examples"
                break
            stop = should_stop is not None and should_stop()
            if stop and world == 1:
                raise StopRequested  # here, before the draw: at a step boundary
            # Draw.
            size = state.schedule.next_batch_size(
                Progress(state.step, state.examples, state.estimate, state.per_sample))
            batch = state.data.draw(size)
            n_examples = examples_of(task, batch) * world
            if state.step == 0:
                fall_back_if_unsplittable(state, batch)
                ride_accumulation(state, batch)  # micro-batches the step is cut into anyway
            state.per_sample = n_examples / size
            # This step's rate: where it brings the run (steps, examples) on the warmup and
            # decay, or the adaptive rule's eps(B).
            lr = set_learning_rate(state.optimizer, state.schedule, state.lr_schedule,
                                   spec.learning_rate, state.step + 1,
                                   state.examples + n_examples, n_examples)
            # What the monitor calls a sample: the batch's first dimension (one environment's
            # segment for cartpole, a window for chars), the independent unit it splits on.
            samples = first_dim(batch) or size // world
            # Forward and backward, in pieces of at most train.microbatch_size samples.
            state.optimizer.zero_grad(set_to_none=True)
            k = pieces(state.monitor, config.train.microbatch_size, config.noise.microbatches,
                       samples)
            loss = backward(state.trained, task, batch, k, state.monitor, state.precision)
            # Measured before the update, like the loss: the episodes of this step's rollouts.
            metric = _metric(task, state.model) if metric_task else math.nan
            # A checkpoint at the end of this step? Asked here, so that ranks agree on it.
            save = checkpoints is not None and checkpoints.due(state.step + 1,
                                                               state.examples + n_examples)
            if world > 1:
                # Every rank must decide alike (stop, checkpoint, diverged, done): one small
                # all-reduce. A stop agreed on here is taken at the end of this step, its
                # batch drawn: there the state is whole.
                loss, metric, stop, save = _agree(loss, metric, stop, save, state.device)
            state.loss, state.metric = loss, metric
            # Measure. Every step: the monitor counts steps and measures every noise.every of
            # them; the batch lets it measure B_noise every noise.hessian_every steps. The EMA's
            # time constant (noise.ema_examples) counts this rank's examples in the task's unit.
            # The gradient is still unclipped here; fp16's loss scale is divided out.
            state.estimate = in_task_units(
                state.monitor.step(batch=batch, examples=n_examples // world,
                                   loss_scale=state.precision.loss_scale),
                n_examples / (samples * world))
            # Step: unscale (fp16), clip, and step unless fp16's scaler found an overflow.
            state.precision.unscale(state.optimizer)
            state.grad_norm = clip_gradients(params, config.train.grad_clip)
            if not state.precision.step(state.optimizer) and math.isfinite(loss):
                _skipped(state)
                continue
            state.step += 1
            state.examples += n_examples
            smooth = state.watch.update(loss, n_examples, state.step)
            # Past the hardest target, train on until the analysis's centred window is whole
            # (a metric is read as logged, no window: stop at once). NaN reaches nothing.
            if state.stop_at is None and hardest is not None and declared.reached(
                    metric if metric_task else smooth, hardest):
                state.stop_at = state.step if metric_task else stop_step(state.step, size)
            done = state.stop_at is not None and state.step >= state.stop_at
            # Log.
            if state.step % sweep.log_every == 0 or done:
                row = _log(state, smooth, size, lr, start)
                if on_row is not None:
                    on_row(row)
            # Stop.
            if done and hardest is not None and not metric_task and not analysis_reached(
                    state.rows["step"], state.rows["loss"], hardest, size):
                # The causal EMA crossed, but the analysis's centred reading of the logged
                # losses has not (near a loss floor they differ): train on and look again.
                state.stop_at, done = None, False
            state.elapsed = time.perf_counter() - start
            state.cpu_elapsed = time.process_time() - cpu_start
            if done:
                reason = "target"
                break
            # A step boundary: `state.state_dict()` here is the whole run so far.
            if checkpoints is not None:
                if save and not stop:  # a stop saves below
                    checkpoints.save(state)
                else:
                    checkpoints.flush_rows(state)
            if stop:
                raise StopRequested
    except Diverged as err:
        outcome, reason = "diverged", str(err)
    except StopRequested:
        state.elapsed = time.perf_counter() - start
        state.cpu_elapsed = time.process_time() - cpu_start
        if checkpoints is not None:
            checkpoints.save(state)  # before the monitor's close folds in its last all-reduce
        raise
    finally:
        state.monitor.close()
        state.data.close()  # the DataLoader's worker processes, if any
        state.elapsed = time.perf_counter() - start
        state.cpu_elapsed = time.process_time() - cpu_start
    if out_dir is not None:
        store.end_metrics(out_dir, state.rows)
    if checkpoints is not None:
        checkpoints.finish()
    monitor = state.monitor
    method = monitor.choice or {"method": monitor.method,
                                "reason": f"noise.method={config.noise.method}"}
    logged = state.rows["step"]
    # Measurement off (noise.method=none): B_simple absent by design, not missing.
    missing = (None if monitor.method == Method.NONE
               else unmeasured_share(list(state.rows["b_simple"])))
    return RunResult(outcome, state.step, reason, state.loss, time.perf_counter() - start,
                     method, missing, rows=len(logged), train_cpu_seconds=state.cpu_elapsed,
                     examples=int(state.rows["examples"][-1]) if len(logged) else None,
                     noise_measured=measured_share(state))


def measured_share(state: TrainState) -> dict[str, Any]:
    """The run's measurement for its status.json: `method` (`none` where measurement was off,
    so that an absent B_simple is said, never silent), `every` (an int or auto), `steps`,
    `measured` (steps whose norms were measured) and `share` (measured / steps)."""
    schedule = state.monitor.schedule
    share = schedule.share
    return {"method": state.monitor.measures, "every": schedule.every,
            "steps": schedule.steps, "measured": schedule.measured,
            "share": None if math.isnan(share) else round(share, 4)}


def make_checkpointer(config: Config, run_dir: Path | None) -> Checkpointer:
    """The run's checkpointer from the `train` settings (rank 0 passes its folder)."""
    settings = config.train
    keep_at: list[int] = list(settings.keep_checkpoints_at)
    if settings.keep_checkpoints == "log":
        keep_at += [2 ** k for k in range(63)]
    return Checkpointer(run_dir, every_steps=settings.checkpoint_every,
                        every_seconds=settings.checkpoint_seconds, keep_at=keep_at)


def eval_due(step: int, every: int, per_octave: int) -> bool:
    """Whether step `step` evaluates: every `every` steps, and `per_octave` times per doubling
    of the steps (`sweep.eval_per_octave`: steps 1..2 per_octave, then every 2nd ...)."""
    if every and step % every == 0:
        return True
    if per_octave and step >= 1:
        spacing = max(1, (1 << (step.bit_length() - 1)) // per_octave)
        return step % spacing == 0
    return False


def _log(state: TrainState, smooth: float, size: int, lr: float,
         start: float) -> dict[str, float]:
    """Append this step's row to `state.rows` (evaluating where `sweep.eval_every` says) and
    return it; `wall_time` is the seconds since `start`."""
    sweep, model = state.config.sweep, state.model
    eval_loss = math.nan
    if eval_due(state.step, sweep.eval_every, sweep.eval_per_octave):
        exact = state.probes.exact_loss(model)
        eval_loss = exact if exact is not None else _eval_loss(model, state)
    state.elapsed = time.perf_counter() - start
    values = {
        "step": state.step, "examples": state.examples, "loss": state.loss,
        "loss_smooth": smooth, "eval_loss": eval_loss, "lr": lr,
        "wall_time": state.elapsed, "metric": state.metric, "grad_norm": state.grad_norm,
        "skipped_steps": state.precision.skipped, "epoch": state.data.epochs,
    }
    # The noise columns of the schema are the estimate's fields, by name.
    estimate = state.estimate
    for field in fields(NoiseEstimate):
        values[field.name] = getattr(estimate, field.name) if estimate is not None else math.nan
    # Probes and exact truth (gnsweep.measure.run_probes), then this step's batch size.
    values.update({**state.probes.values(model, state.examples), "batch_size": size})
    for name, value in values.items():
        state.rows[name].append(value)
    return values


def _skipped(state: TrainState) -> None:
    """fp16's scaler skipped this step (inf/NaN gradients): not an optimizer step, so neither
    the step nor its examples count; said, and counted in the `skipped_steps` column. A scale
    that keeps falling means gradients that overflow at any scale: diverged."""
    scale = state.precision.loss_scale
    log.warning("fp16: step %d skipped (gradients overflowed); loss scale now %g",
                state.step + 1, scale)
    if scale < MIN_LOSS_SCALE:
        raise Diverged(f"fp16: gradients overflow even at loss scale {scale:g} (step "
                       f"{state.step + 1})")


def _agree(loss: float, metric: float, stop: bool, save: bool,
           device: torch.device) -> tuple[float, float, bool, bool]:
    """The global batch-mean loss (equal per-rank batches), the ranks' mean metric (NaN while
    any rank has none), whether any rank must stop and whether any rank's checkpoint is due
    (a time-based one: the ranks' clocks differ)."""
    values = torch.tensor([loss, metric, float(stop), float(save)], dtype=torch.float64,
                          device=device)
    torch.distributed.all_reduce(values)
    world = torch.distributed.get_world_size()
    return (float(values[0]) / world, float(values[1]) / world, bool(values[2] > 0),
            bool(values[3] > 0))


def _metric(task: Task, model: torch.nn.Module) -> float:
    """The task's own metric, `task.metric(model)` (NaN until it has one: no episode ended)."""
    measure: Callable[[torch.nn.Module], float] = getattr(task, "metric")  # noqa: B009
    return float(measure(model))


@torch.no_grad()
def _eval_loss(model: torch.nn.Module, state: TrainState) -> float:
    """In eval mode: the task's `eval_loss(model)`, else its mean loss over its
    `eval_dataset()` (NaN when it has neither)."""
    evaluate = getattr(state.task, "eval_loss", None)
    held_out = state.eval_set
    if evaluate is None and held_out is None:
        return math.nan
    was_training = model.training
    model.eval()
    try:
        if evaluate is not None:
            return float(evaluate(model))
        assert held_out is not None
        return mean_loss(state.task, model, held_out, state.device)
    finally:
        model.train(was_training)
