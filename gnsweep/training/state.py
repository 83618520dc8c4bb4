"""A run's state, gathered in one place and built in one place (`build_run`).

Every part that changes as the run trains has `state_dict()` / `load_state_dict()` (torch's
`Stateful` idea): `TrainState.state_dict()` is the run's whole state at a step boundary, and a
`TrainState` built alike by `build_run(config, spec)` that loads it continues bit for bit as the
run would have. A state dict holds tensors, numbers, strings, lists and dicts only (what
`torch.load(weights_only=True)` reads); like torch's, its tensors are the live ones, so save
or copy it before training on.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from gnsweep import tables
from gnsweep.config import Config
from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.common import split_batch
from gnsweep.measure.run_probes import RunProbes
from gnsweep.noise import Method, NoiseEstimate, estimate_state, load_estimate
from gnsweep.runs import RunSpec, run_config
from gnsweep.schedule import AdaptiveBatch, AlongBatch, BatchSchedule, ConstantBatch
from gnsweep.tasks import Task, about, make_task
from gnsweep.tasks.protocol import first_dim
from gnsweep.training.data import DatasetSource, DataSource, as_dataset, make_data
from gnsweep.training.lr_schedule import LrSchedule
from gnsweep.training.recipe import Precision, make_optimizer
from gnsweep.training.watch import LossWatch

PARTS = ("model", "optimizer", "lr_schedule", "precision", "schedule", "watch", "monitor",
         "probes", "data")
"""The parts with a `state_dict()` of their own, by attribute name."""


@dataclass
class TrainState:
    """One run's parts and where it stands. Built by `build_run`; the loop
    (`gnsweep.training.loop.run`) advances it one step at a time."""

    config: Config
    spec: RunSpec
    task: Task
    world: int
    """DDP world size (1 without torch.distributed)."""
    rank: int
    device: torch.device
    model: torch.nn.Module
    """The task's model on `device`."""
    trained: torch.nn.Module
    """The module the loop trains: `model`, DDP-wrapped under torchrun."""
    optimizer: torch.optim.Optimizer
    lr_schedule: LrSchedule
    """The learning rate's warmup and decay (`config.train`)."""
    precision: Precision
    """Autocast and fp16's gradient scaler (`config.train.precision`)."""
    schedule: BatchSchedule
    """The batch size of each step (`gnsweep.schedule`)."""
    watch: LossWatch
    """The smoothed loss and divergence."""
    monitor: NoiseScaleMonitor
    """The noise scale, measured on the training steps."""
    probes: RunProbes
    """Frozen-parameter probes and exact truth at log-spaced points."""
    data: DataSource | DatasetSource
    """Each step's batch: from the task's `sample()`, or its `dataset()`."""
    eval_set: Dataset | None = None
    """The task's `eval_dataset()` (None without one): `eval_loss` is the mean loss over it
    where the task has no `eval_loss(model)` of its own."""
    step: int = 0
    """Optimizer steps taken."""
    examples: int = 0
    """Examples trained on (the task's unit), all ranks."""
    estimate: NoiseEstimate | None = None
    """The monitor's latest estimate in the task's example unit (the batch schedule reads it)."""
    per_sample: float = 1.0
    """Examples per sample in the last batch (tokens per window; 1 for most tasks)."""
    loss: float = math.nan
    """The last step's batch-mean loss."""
    grad_norm: float = math.nan
    """The last step's global gradient norm, before clipping (unscaled)."""
    metric: float = math.nan
    """The last step's task metric (NaN for a task whose metric is the loss)."""
    stop_at: int | None = None
    """The step to stop at once the hardest target is reached (None: not reached yet)."""
    elapsed: float = 0.0
    """Seconds trained so far (the `wall_time` column goes on from it)."""
    cpu_elapsed: float = 0.0
    """CPU seconds of the training process so far, its threads included: a run's compute,
    which other jobs on the machine do not inflate (status.json `train_cpu_seconds`)."""
    rows: dict[str, list] = field(default_factory=lambda: {
        f.name: [] for f in tables.METRICS_SCHEMA})
    """The metrics rows logged so far, by column (`tables.METRICS_SCHEMA`)."""

    def state_dict(self) -> dict[str, Any]:
        """Each part's `state_dict()` by name (`PARTS`), torch's global random state (`rng`:
        the CPU generator's, and the device's on CUDA), where the run stands (`progress`) and
        the rows logged so far (`rows`)."""
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {**{name: getattr(self, name).state_dict() for name in PARTS}, "rng": rng,
                "progress": {"step": self.step, "examples": self.examples,
                             "estimate": estimate_state(self.estimate),
                             "per_sample": self.per_sample, "loss": self.loss,
                             "grad_norm": self.grad_norm,
                             "metric": self.metric, "stop_at": self.stop_at,
                             "elapsed": self.elapsed, "cpu_elapsed": self.cpu_elapsed},
                "rows": {name: list(values) for name, values in self.rows.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` of a run built alike (same config and spec)."""
        method = self.monitor.resumed_method(state["monitor"])
        if method is not None:  # the saved run fell back at its first step: so does this one
            self.monitor = _rebuilt_monitor(self, method)
        for name in PARTS:
            getattr(self, name).load_state_dict(state[name])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        progress = state["progress"]
        self.step, self.examples = int(progress["step"]), int(progress["examples"])
        self.estimate = load_estimate(progress["estimate"])
        self.per_sample = float(progress["per_sample"])
        self.loss, self.metric = float(progress["loss"]), float(progress["metric"])
        self.grad_norm = float(progress["grad_norm"])
        self.stop_at, self.elapsed = progress["stop_at"], float(progress["elapsed"])
        self.cpu_elapsed = float(progress.get("cpu_elapsed", 0.0))  # absent before it was kept
        self.rows = {name: list(values) for name, values in state["rows"].items()}
        # A checkpoint written before a column existed: NaN on its rows (e.g. b_simple_precond).
        n = len(self.rows.get("step", []))
        for column in tables.METRICS_SCHEMA.names:
            self.rows.setdefault(column, [math.nan] * n)


def build_run(config: Config, spec: RunSpec) -> TrainState:
    """The run's parts at step 0, each built here and only here.

    Seeds torch's global generator from `spec.seed` first (the model's initialisation). The
    config is the sweep's; what this run trains with is derived from it (`runs.run_config`)."""
    config = run_config(config, spec)
    torch.manual_seed(spec.seed)
    task = make_task(config.task.name, config.task.options, spec.seed)
    # Under torchrun (a process group initialised by the worker entry point) every rank trains
    # a DDP replica on its own B/N examples a step; without one, this process does all B.
    world, rank, device = placement()
    model, trained = _build_model(task, device)
    sweep = config.sweep
    optimizer = make_optimizer(config.train.optimizer, model.parameters(),
                               lr=spec.learning_rate, train=config.train)
    lr_schedule = LrSchedule.of(config)
    precision = Precision(config.train.precision, device)
    monitor = make_monitor(model, trained, task, config, optimizer=optimizer)
    schedule = _make_schedule(config, spec, world)
    probes = RunProbes(config.noise, task, spec.seed)  # frozen-parameter probes, exact truth
    data = make_data(task, spec.seed, world, rank, device, config.train.loader_workers)
    # A metric task's loss (A2C's) has no scale to diverge from: only a non-finite one diverges.
    metric_task = about(config.task).metric != "loss"
    watch = LossWatch(sweep.loss_ema_examples, None if metric_task else sweep.divergence_factor)
    eval_build = getattr(task, "eval_dataset", None)
    eval_set = None if eval_build is None else as_dataset(eval_build(), "eval_dataset()")
    return TrainState(config, spec, task, world, rank, device, model, trained, optimizer,
                      lr_schedule, precision, schedule, watch, monitor, probes, data, eval_set)


def placement() -> tuple[int, int, torch.device]:
    """(world size, rank, device). Under torch.distributed: one GPU per local rank (LOCAL_RANK,
    set by torchrun and the Slurm executor) with an nccl process group, else the CPU. In one
    process: the GPU of LOCAL_RANK (0 unless set) when CUDA is present, else the CPU.

    Device numbers count the GPUs this process sees: the launcher gives each local worker and
    each torchrun job its own through CUDA_VISIBLE_DEVICES (`gnsweep.executors.gpus`), so a
    local worker's `cuda:0` is its GPU, not the machine's first."""
    dist = torch.distributed
    local_gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, local_gpu if torch.cuda.is_available() else torch.device("cpu")
    device = local_gpu if dist.get_backend() == "nccl" else torch.device("cpu")
    return dist.get_world_size(), dist.get_rank(), device


def resolve_method(method: str) -> str:
    """`auto` without a model: the DDP hook under torch.distributed, else per-example norms in
    this process (the monitor itself resolves `auto` for its model:
    `gnsweep.measure.batchstats.choose_method`)."""
    if method != Method.AUTO:
        return method
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "ddp"
    return "per_example"


def make_monitor(model: torch.nn.Module, trained: torch.nn.Module, task: Task, config: Config,
                 method: str | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> NoiseScaleMonitor:
    """The noise-scale monitor of `config.noise` on the trained module (`method`: instead of
    `config.noise.method`); with `optimizer`, B_simple_P in its preconditioner too."""
    noise = config.noise
    # auto is resolved by the monitor from the model and the launch (`choose_method`): the DDP
    # hook under torchrun, micro-batches for a model with batch statistics, else the cheaper
    # of per-example norms and micro-batches, timed on the run's first measured steps (the
    # loop splits the batch when the monitor asks: `pieces`).
    method = method or noise.method
    if isinstance(trained, torch.nn.parallel.DistributedDataParallel) and \
            method not in (Method.DDP, Method.AUTO, Method.NONE):
        raise ValueError(f"noise.method={method} under torchrun: use ddp (or auto), which "
                         "reads each worker's gradient before the all-reduce")
    # The Hessian passes run the task's own loss on the unwrapped model (`task_loss`).
    return NoiseScaleMonitor(trained, method=method, every=noise.every,
                             ema_steps=noise.ema_steps, ema_examples=noise.ema_examples,
                             task_loss=task.loss, hessian_every=noise.hessian_every,
                             ema_fraction=noise.ema_fraction,
                             parameters=_noise_parameters(task, model),
                             timed_auto=method == Method.AUTO, optimizer=optimizer,
                             pooled=noise.pooled)


def fall_back_if_unsplittable(state: TrainState, batch: Any) -> None:
    """A first batch that cannot be cut along dim 0: the monitor says its fallback
    (`NoiseScaleMonitor.unsplittable`); a new method means a monitor built again with it."""
    if split_batch(batch, 2) is not None:
        return
    method = state.monitor.unsplittable()
    if method is not None:
        state.monitor = _rebuilt_monitor(state, method)


def ride_accumulation(state: TrainState, batch: Any) -> None:
    """A step the loop cuts into micro-batches anyway (`train.microbatch_size` smaller than the
    batch): method auto measures from those micro-batches (eq. A.2 with b_small = the
    micro-batch), which costs a few norms a step, instead of adding per-example hooks."""
    size, samples = state.config.train.microbatch_size, first_dim(batch)
    if size and samples and samples > size and split_batch(batch, 2) is not None:
        state.monitor.rides_pieces(f"train.microbatch_size={size} cuts each step of {samples} "
                                   "samples into micro-batches anyway: B_simple from them "
                                   "costs a few norms a step")


def _rebuilt_monitor(state: TrainState, method: str) -> NoiseScaleMonitor:
    state.monitor.close()
    return make_monitor(state.model, state.trained, state.task, state.config, method=method,
                        optimizer=state.optimizer)


def _noise_parameters(task: Task, model: torch.nn.Module) -> list[torch.nn.Parameter] | None:
    """The task's `noise_parameters(model)` (the block whose gradient the noise scale is
    measured on: an actor-critic's actor), or None: every trainable parameter."""
    choose = getattr(task, "noise_parameters", None)
    return None if choose is None else list(choose(model))


def _make_schedule(config: Config, spec: RunSpec, world: int) -> BatchSchedule:
    """The grid point's fixed batch size, or an adaptive run's B = sqrt(r B_noise) (appendix D)
    with its learning-rate rule (eq. 2.7; `spec.learning_rate` is then eps_max)."""
    sweep = config.sweep
    low, high = sweep.adaptive_bounds()
    if spec.along:  # the measured local B_crit along training (docs/along.md)
        return AlongBatch([(e, b) for e, b in sweep.along_points], spec.learning_rate,
                          spec.lr_noise, low, high, world)
    if not spec.adaptive:
        return ConstantBatch(spec.batch_size)
    return AdaptiveBatch(spec.exchange_rate, spec.learning_rate, low, high,
                         sweep.adaptive_min_change, world, spec.lr_noise)


def _build_model(task: Task, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the task's model on `device`, the module to train: DDP-wrapped under torchrun)."""
    model = task.model().to(device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.nn.parallel import DistributedDataParallel

        return model, DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None)
    return model, model
