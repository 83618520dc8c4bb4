"""Typed configuration: dataclass schemas, validation, and Hydra composition of `conf/`.

Hydra is used only here, in the CLI process. Everything below the CLI receives these
dataclasses (or their JSON form in a run folder), never a DictConfig: workers started by
torchrun or Slurm load a run's `config.json` without Hydra.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gnsweep import store, tasks, tracking
from gnsweep.errors import ConfigError
from gnsweep.errors import choice as _choice
from gnsweep.errors import integer as _integer
from gnsweep.errors import number as _number
from gnsweep.errors import positive_list as _positive_list

__all__ = [
    "EXECUTORS",
    "LOSS_KINDS",
    "METHODS",
    "OPTIMIZERS",
    "SCHEDULES",
    "AnalysisConfig",
    "BranchConfig",
    "Config",
    "ConfigError",
    "ExecutorConfig",
    "LoggerConfig",
    "NoiseConfig",
    "SweepConfig",
    "TaskConfig",
    "compose",
    "conf_dir",
]


METHODS = ("auto", "per_example", "microbatch", "ddp")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
EXECUTORS = ("local", "torchrun", "slurm")
LOSS_KINDS = ("smoothed", "raw", "eval")
SCHEDULES = ("constant", "adaptive", "along")


@dataclass
class TaskConfig:
    """Which model and data a run trains; the task's own options are checked by the task."""

    name: str = "digits"
    """Registered task name (`gnsweep tasks` lists them)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Task-specific options (hidden width, dimension, noise...), validated by the task."""

    def __post_init__(self) -> None:
        self.options = tasks.validate_options(self.name, dict(self.options))

    # The task's direction and unit come from the registry (no torch), not from config.yaml: a
    # sweep folder names its task, and the task declares what its targets mean. A task outside
    # the registry (a user's own, by import path) declares nothing there: its targets are
    # losses and B counts its examples.
    def _declared(self, name: str, default: Any) -> Any:
        entry = tasks.REGISTRY.get(self.name)
        return getattr(entry, name) if entry is not None else default

    @property
    def metric(self) -> str:
        """What the targets are values of: "loss" or the task's metric (e.g. "return")."""
        return str(self._declared("metric", "loss"))

    @property
    def higher_is_better(self) -> bool:
        """True when a target is reached by rising to it (a return), False for a loss."""
        return bool(self._declared("higher_is_better", False))

    @property
    def unit(self) -> str:
        """What a batch size counts: examples, tokens or environment steps."""
        return str(self._declared("unit", "examples"))

    def reached(self, value: float, target: float) -> bool:
        """Whether a (smoothed) metric value has reached `target` in the task's direction."""
        return value >= target if self.higher_is_better else value <= target

    def hardest(self, targets: list[float]) -> float:
        """The target a run stops at: the largest return, the smallest loss."""
        return max(targets) if self.higher_is_better else min(targets)


@dataclass
class SweepConfig:
    """The batch-size x learning-rate grid and what every run in it does."""

    name: str = "digits"
    """Sweep name; the default sweep folder is runs/<name>."""
    # The defaults are the default sweep (conf/sweep/digits.yaml names only the sweep); the
    # YAML files of the sweep group list only what differs from these.
    batch_sizes: list[int] = field(
        default_factory=lambda: [8, 16, 32, 64, 128, 256, 512, 1024])
    """Batch sizes (global, in examples) to sweep."""
    learning_rates: list[float] = field(
        default_factory=lambda: [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4])
    """Learning rates to sweep at every batch size."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Seeds; each grid point runs once per seed."""
    targets: list[float] = field(default_factory=lambda: [0.3, 0.1, 0.03])
    """Training-loss targets; a run stops once it reaches the hardest (smallest)."""
    max_steps: int = 5000
    """Step budget of one run."""
    max_examples: int = 0
    """Example budget of one run (0: none)."""
    optimizer: str = "sgd"
    """sgd, momentum (SGD with sweep.momentum, else 0.9), adam or adamw
    (gnsweep.training.recipe)."""
    momentum: float = 0.0
    """SGD momentum (0: plain SGD, the setting the paper's eps_opt(B) describes)."""
    loss_ema_examples: float = 128.0
    """Time constant of the smoothed training loss, in examples: per-step decay exp(-B/this), so
    every batch size averages over the same number of examples (same noise, same lag in E)."""
    divergence_factor: float = 3.0
    """A run diverges when its loss is NaN/inf or its smoothed loss exceeds this x its first
    loss (a loss task only: a task with its own metric, cartpole's return, diverges only on a
    NaN/inf loss)."""
    log_every: int = 1
    """Write a metrics row every this many steps."""
    eval_every: int = 0
    """Evaluate on the held-out split every this many steps (0: never)."""
    max_retries: int = 2
    """How often a run that raised is retried before it counts as failed."""
    schedule: str = "constant"
    """constant: the grid's fixed batch sizes only; adaptive: also one run per exchange rate
    whose batch size follows the noise scale, B = sqrt(r B_noise) (appendix D, docs/adaptive.md)."""
    exchange_rates: list[float] = field(default_factory=list)
    """schedule=adaptive: exchange rates r (examples per step), one adaptive run per rate and
    seed."""
    eps_max: float = 0.0
    """schedule=adaptive: eps_max of the learning-rate rule eps(B) = eps_max / (1 + B_noise/B)
    (eq. 2.7); 0: the fixed-batch fit of the sweep folder (`gnsweep analyze` first)."""
    adaptive_min_batch: int = 0
    """schedule=adaptive: smallest batch size (0: the grid's smallest)."""
    adaptive_max_batch: int = 0
    """schedule=adaptive: largest batch size (0: the grid's largest)."""
    adaptive_min_change: float = 0.1
    """schedule=adaptive: change the batch size only when sqrt(r B_noise) moves this much
    (relative), so that it does not jitter with the estimate's noise."""
    adaptive_lr: str = "fit"
    """schedule=adaptive: the B_noise of the learning-rate rule eps_max / (1 + B_noise/B) (eq.
    2.7). `fit` (default): a constant, `adaptive_lr_noise` when given, else `b_noise_lr` of the
    folder's fixed-batch fit (the B_noise its best learning rates imply); `measured`: the run's
    own noise scale each step. `measured` is the literal rule but feeds back on itself (a lower
    rate raises the measured noise scale, which lowers the rate): on digits and linreg it took
    2-10x more examples than `fit` (docs/adaptive.md)."""
    adaptive_lr_noise: float = 0.0
    """schedule=adaptive, adaptive_lr=fit: the constant B_noise of the learning-rate rule (0:
    take `b_noise_lr` from the folder's fits.parquet at launch); schedule=along: the same."""
    along_from: str = ""
    """schedule=along: an analysed branch sweep (`gnsweep branch`, its along.parquet) whose
    measured local B_crit the along run's batch size follows (docs/along.md)."""
    along_points: list[list[float]] = field(default_factory=list)
    """schedule=along: [examples, B_crit] pairs the batch size follows; read from
    `along_from` at launch (set it only to give the curve by hand)."""

    def __post_init__(self) -> None:
        self.batch_sizes = _positive_list("sweep.batch_sizes", self.batch_sizes, _integer)
        self.learning_rates = _positive_list("sweep.learning_rates", self.learning_rates, _number)
        self.targets = _positive_list("sweep.targets", self.targets, _number)
        self.seeds = [_integer("sweep.seeds", s) for s in self.seeds] or [0]
        self.max_steps = _integer("sweep.max_steps", self.max_steps)
        if self.max_steps < 1:
            raise ConfigError(f"sweep.max_steps: {self.max_steps} is not allowed; must be >= 1")
        self.max_examples = _integer("sweep.max_examples", self.max_examples)
        self.optimizer = _choice("sweep.optimizer", self.optimizer, OPTIMIZERS)
        self.momentum = _number("sweep.momentum", self.momentum)
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"sweep.momentum: {self.momentum} must be in [0, 1)")
        self.loss_ema_examples = _number("sweep.loss_ema_examples", self.loss_ema_examples)
        self.divergence_factor = _number("sweep.divergence_factor", self.divergence_factor)
        if self.divergence_factor <= 1:
            raise ConfigError(f"sweep.divergence_factor: {self.divergence_factor} must be > 1")
        for name in ("log_every", "eval_every", "max_retries"):
            value = _integer(f"sweep.{name}", getattr(self, name))
            if value < (1 if name == "log_every" else 0):
                raise ConfigError(f"sweep.{name}: {value} is not allowed")
            setattr(self, name, value)
        self._check_adaptive()

    def _check_adaptive(self) -> None:
        self.schedule = _choice("sweep.schedule", self.schedule, SCHEDULES)
        if self.exchange_rates not in (None, []):
            self.exchange_rates = sorted(_positive_list("sweep.exchange_rates",
                                                        self.exchange_rates, _number))
        self.exchange_rates = self.exchange_rates or []
        self.eps_max = _number("sweep.eps_max", self.eps_max)
        self.adaptive_min_change = _number("sweep.adaptive_min_change", self.adaptive_min_change)
        self.adaptive_lr_noise = _number("sweep.adaptive_lr_noise", self.adaptive_lr_noise)
        if self.adaptive_lr_noise < 0:
            raise ConfigError(f"sweep.adaptive_lr_noise: {self.adaptive_lr_noise} must be >= 0 "
                              "(0: the fixed-batch fit's b_noise_lr)")
        self.adaptive_lr = _choice("sweep.adaptive_lr", self.adaptive_lr, ("fit", "measured"))
        if self.adaptive_lr == "measured" and self.adaptive_lr_noise:
            raise ConfigError("sweep.adaptive_lr_noise is set but sweep.adaptive_lr=measured "
                              "uses the run's own noise scale; drop one of them")
        for name in ("adaptive_min_batch", "adaptive_max_batch"):
            setattr(self, name, _integer(f"sweep.{name}", getattr(self, name)))
        low, high = self.adaptive_bounds()
        if self.schedule == "constant" and self.exchange_rates:
            raise ConfigError("sweep.exchange_rates is set but sweep.schedule=constant; add "
                              "sweep.schedule=adaptive (or drop the exchange rates)")
        if self.schedule == "adaptive" and not self.exchange_rates:
            raise ConfigError("sweep.schedule=adaptive needs exchange rates: "
                              "sweep.exchange_rates=[100,1000] (examples per step)")
        if self.eps_max < 0 or not 0 <= self.adaptive_min_change < 1:
            raise ConfigError(f"sweep.eps_max ({self.eps_max}) must be >= 0 and "
                              f"sweep.adaptive_min_change ({self.adaptive_min_change}) in [0, 1)")
        if not 0 < low <= high:
            raise ConfigError(f"sweep.adaptive_min_batch/adaptive_max_batch: {low} .. {high} is "
                              "not a range of batch sizes; use 0 < min <= max (0: the grid's)")
        self.along_points = [[_number("sweep.along_points", e), _number("sweep.along_points", b)]
                             for e, b in (self.along_points or [])]
        if self.schedule != "along" and (self.along_from or self.along_points):
            raise ConfigError("sweep.along_from is set but sweep.schedule is not along; add "
                              "sweep.schedule=along (or drop sweep.along_from)")
        if self.schedule == "along" and not (self.along_from or self.along_points):
            raise ConfigError("sweep.schedule=along needs sweep.along_from=DIR: an analysed "
                              "branch sweep (gnsweep branch, then gnsweep analyze DIR)")
        if self.schedule in ("adaptive", "along") and self.optimizer in ("adam", "adamw"):
            raise ConfigError(f"sweep.schedule={self.schedule} with sweep.optimizer="
                              f"{self.optimizer}: its learning-rate rule eps(B) = "
                              "eps_max/(1 + B_noise/B) is SGD's (eq. 2.7); use sgd or momentum")

    def adaptive_bounds(self) -> tuple[int, int]:
        """(smallest, largest) batch size of an adaptive run: the settings, else the grid's."""
        return (self.adaptive_min_batch or min(self.batch_sizes),
                self.adaptive_max_batch or max(self.batch_sizes))


@dataclass
class NoiseConfig:
    """How B_simple (and optionally B_noise) is measured during every run."""

    method: str = "auto"
    """per_example, microbatch, ddp, or auto (ddp under torchrun, else per_example)."""
    microbatches: int = 4
    """Micro-batches per step for method=microbatch (b_small = B / this)."""
    every: int = 1
    """Measure every this many steps."""
    ema_steps: float = 0.0
    """EMA time constant of G2 and S in steps (0: use ema_examples)."""
    ema_examples: float = 2048.0
    """EMA time constant of G2 and S in examples (used when ema_steps is 0)."""
    hessian_every: int = 0
    """Measure B_noise with Hessian-vector products every this many steps (0: never)."""
    ema_fraction: float = 0.2
    """EMA window as this fraction of the examples seen so far (0: ema_steps / ema_examples);
    a window that follows training (docs/noise.md)."""
    probe_per_octave: float = 0.0
    """Frozen-parameter probes of B_simple and B_noise, this many per doubling of the examples
    seen (0: none); each costs about probe_batches * probe_batch_size examples of gradients."""
    probe_batches: int = 16
    """Fresh batches per probe, pooled at the probe's fixed parameters."""
    probe_batch_size: int = 512
    """Examples per probe batch (B_noise's b_big is half of it: keep it >> B_noise)."""
    probe_hessian_microbatches: int = 4
    """Hessian-vector-product micro-batches per probe batch."""

    def __post_init__(self) -> None:
        self.method = _choice("noise.method", self.method, METHODS)
        self.microbatches = _integer("noise.microbatches", self.microbatches)
        if self.microbatches < 2:
            raise ConfigError(f"noise.microbatches: {self.microbatches} must be >= 2")
        self.every = _integer("noise.every", self.every)
        if self.every < 1:
            raise ConfigError(f"noise.every: {self.every} must be >= 1")
        self.ema_steps = _number("noise.ema_steps", self.ema_steps)
        self.ema_examples = _number("noise.ema_examples", self.ema_examples)
        if self.ema_steps < 0 or self.ema_examples <= 0:
            raise ConfigError("noise.ema_steps must be >= 0 and noise.ema_examples > 0")
        self.hessian_every = _integer("noise.hessian_every", self.hessian_every)
        if self.hessian_every < 0:
            raise ConfigError(f"noise.hessian_every: {self.hessian_every} must be >= 0")
        self.ema_fraction = _number("noise.ema_fraction", self.ema_fraction)
        self.probe_per_octave = _number("noise.probe_per_octave", self.probe_per_octave)
        if self.ema_fraction < 0 or self.probe_per_octave < 0:
            raise ConfigError("noise.ema_fraction and noise.probe_per_octave must be >= 0")
        for name in ("probe_batches", "probe_batch_size", "probe_hessian_microbatches"):
            value = _integer(f"noise.{name}", getattr(self, name))
            if value < (1 if name == "probe_batches" else 2):
                raise ConfigError(f"noise.{name}: {value} is too small")
            setattr(self, name, value)


@dataclass
class ExecutorConfig:
    """Where runs execute: a local process pool, torchrun, or Slurm."""

    kind: str = "local"
    """local, torchrun or slurm."""
    workers: int = 0
    """Local worker processes (0: one per core)."""
    threads_per_worker: int = 1
    """Torch threads in each worker (two 1-thread processes beat one 2-thread one)."""
    nproc_per_node: int = 2
    """torchrun/Slurm: processes per node for each run (DDP world size per node)."""
    nodes: int = 1
    """Slurm: nodes per job."""
    partition: str = ""
    """Slurm partition ('' for the cluster default)."""
    gpus_per_node: int = 0
    """Slurm: GPUs per node."""
    cpus_per_task: int = 1
    """Slurm: CPUs per task."""
    time_min: int = 60
    """Slurm: time limit of one job, minutes."""
    runs_per_job: int = 0
    """Slurm: runs taken in turn by one job (0: spread the runs over `workers` jobs)."""
    sbatch_extra: dict[str, Any] = field(default_factory=dict)
    """Slurm: extra sbatch options, e.g. {account: abc, qos: high}."""

    def __post_init__(self) -> None:
        self.kind = _choice("executor.kind", self.kind, EXECUTORS)
        for name in ("workers", "threads_per_worker", "nproc_per_node", "nodes", "gpus_per_node",
                     "cpus_per_task", "time_min", "runs_per_job"):
            value = _integer(f"executor.{name}", getattr(self, name))
            minimum = 0 if name in ("workers", "gpus_per_node", "runs_per_job") else 1
            if value < minimum:
                raise ConfigError(f"executor.{name}: {value} is not allowed; must be >= {minimum}")
            setattr(self, name, value)

    def n_workers(self) -> int:
        return self.workers or max(1, os.cpu_count() or 1)

    def world_size(self) -> int:
        """DDP processes that train one run (the one place this is computed)."""
        if self.kind == "local":
            return 1
        if self.kind == "torchrun":
            return self.nproc_per_node
        return self.nproc_per_node * self.nodes


@dataclass
class AnalysisConfig:
    """How runs become steps-to-target and fits."""

    loss: str = "smoothed"
    """Which loss decides reaching a target: smoothed (training EMA), raw, or eval."""
    bootstrap: int = 0
    """Bootstrap resamples for confidence intervals (0: standard errors only)."""

    def __post_init__(self) -> None:
        self.loss = _choice("analysis.loss", self.loss, LOSS_KINDS)
        self.bootstrap = _integer("analysis.bootstrap", self.bootstrap)


@dataclass
class LoggerConfig:
    """Where every run's per-step metrics also go: an experiment tracker (`gnsweep.tracking`).

    One dataclass for every kind; a kind reads only its own options (conf/logger/*.yaml).
    """

    kind: str = "none"
    """none, tensorboard, mlflow or wandb."""
    tracking_uri: str | None = None
    """mlflow: the tracking store (null: $MLFLOW_TRACKING_URI, else <sweep>/mlflow/mlflow.db)."""
    experiment: str | None = None
    """mlflow: the experiment (null: the sweep folder's name)."""
    project: str | None = None
    """wandb: the project (null: the sweep folder's name)."""
    entity: str | None = None
    """wandb: the entity (null: W&B's default)."""
    mode: str | None = None
    """wandb: online, offline or disabled (null: offline unless W&B is set up)."""
    flush_secs: int = 10
    """tensorboard: how often a live run's events reach the files."""

    def __post_init__(self) -> None:
        self.kind = _choice("logger.kind", self.kind, tracking.KINDS)
        self.flush_secs = _integer("logger.flush_secs", self.flush_secs)
        if self.flush_secs < 1:
            raise ConfigError(f"logger.flush_secs: {self.flush_secs} must be >= 1")
        try:
            tracking.make_logger(self.kind, ".", **self.options())
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def options(self) -> dict[str, Any]:
        """The options `make_logger` takes for this kind: those set (not null) that the kind
        reads. One set for another kind is refused (it would silently do nothing)."""
        defaults = LoggerConfig.__dataclass_fields__
        accepted = set(tracking.options_of(self.kind))
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "kind" or value is None:
                continue
            if f.name in accepted:
                out[f.name] = value
            elif value != defaults[f.name].default:
                raise ConfigError(f"logger.{f.name}: not an option of logger={self.kind}; "
                                  f"it takes {', '.join(sorted(accepted)) or 'none'}")
        return out


POINT_KEYS = ("at_examples", "at_step", "at_loss", "b_simple", "b_noise", "checkpoint")
"""What `gnsweep branch` records of each branch point (`branch.points`)."""


@dataclass
class BranchConfig:
    """Short runs branched from checkpoints of one base run (`gnsweep branch`, docs/along.md).

    `targets` is the user's setting; `base` and `points` are written by `gnsweep branch` and
    name what a branch sweep's runs start from (a run's `at_examples` picks its point)."""

    targets: list[float] = field(default_factory=lambda: [0.97, 0.94, 0.9])
    """Targets relative to each branch point: fractions of the loss there (0.9: ten per cent
    below it); for a metric that rises, the mirror L + (1 - f)|L|."""
    probe_batches: int = 16
    """Fresh batches on which `gnsweep branch` measures the loss at each branch point (at the
    grid's largest batch size, parameters fixed)."""
    base: str = ""
    """The base run's folder ('': not a branch sweep). Written by `gnsweep branch`."""
    points: list[dict[str, Any]] = field(default_factory=list)
    """One per branch point: at_examples, at_step, at_loss (the loss there), b_simple and
    b_noise (the base run's there, NaN where not measured) and checkpoint (the file the runs
    start from). Written by `gnsweep branch`."""

    def __post_init__(self) -> None:
        self.targets = _positive_list("branch.targets", self.targets, _number)
        bad = [t for t in self.targets if not 0 < t < 1]
        if bad:
            raise ConfigError(f"branch.targets: {bad[0]:g} is not a fraction in (0, 1); give "
                              "fractions of the loss at the branch point, e.g. [0.97,0.94,0.9]")
        self.probe_batches = _integer("branch.probe_batches", self.probe_batches)
        if self.probe_batches < 1:
            raise ConfigError(f"branch.probe_batches: {self.probe_batches} must be >= 1")
        points = []
        for point in self.points or []:
            if not isinstance(point, dict) or set(point) != set(POINT_KEYS):
                raise ConfigError(f"branch.points: {point!r}: a point has exactly "
                                  f"{', '.join(POINT_KEYS)} (written by `gnsweep branch`)")
            # Not measured: None, never NaN (NaN != NaN would read as a changed setting).
            scales = {k: None if point[k] is None or not math.isfinite(float(point[k]))
                      else float(point[k]) for k in ("b_simple", "b_noise")}
            points.append({**point, **scales, "at_examples": int(point["at_examples"]),
                           "at_step": int(point["at_step"]), "at_loss": float(point["at_loss"]),
                           "checkpoint": str(point["checkpoint"])})
        self.points = sorted(points, key=lambda p: p["at_examples"])

    def point(self, at_examples: int) -> dict[str, Any]:
        """The branch point a run starts from, by the examples the base run had seen there."""
        for point in self.points:
            if point["at_examples"] == at_examples:
                return point
        raise ConfigError(f"no branch point at {at_examples} examples in branch.points "
                          f"({', '.join(str(p['at_examples']) for p in self.points) or 'none'})")


@dataclass
class Config:
    """The whole sweep: task, grid, noise measurement, executor, analysis, run logging."""

    task: TaskConfig = field(default_factory=TaskConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    branch: BranchConfig = field(default_factory=BranchConfig)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """The rules that span sections (each section checks its own values)."""
        world, method = self.executor.world_size(), self.noise.method
        # With DDP only the communication hook sees the per-worker gradients; without DDP
        # there is no hook.
        if world > 1 and method not in ("auto", "ddp"):
            raise ConfigError(f"noise.method={method} with {world} DDP processes per run: use "
                              "noise.method=ddp (or auto)")
        if world == 1 and method == "ddp":
            raise ConfigError("noise.method=ddp needs DDP: executor=torchrun (or slurm) with "
                              "executor.nproc_per_node >= 2, or noise.method=auto")
        # Each DDP worker trains on B / world examples a step.
        for batch in self.sweep.batch_sizes:
            if batch % world:
                raise ConfigError(f"sweep.batch_sizes: {batch} does not split over {world} "
                                  f"DDP processes; use multiples of {world}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        sections = {"task": TaskConfig, "sweep": SweepConfig, "noise": NoiseConfig,
                    "executor": ExecutorConfig, "analysis": AnalysisConfig,
                    "logger": LoggerConfig, "branch": BranchConfig}
        unknown = set(data) - set(sections)
        if unknown:
            raise ConfigError(f"unknown config section(s): {', '.join(sorted(unknown))}")
        return cls(**{k: _section(k, t, data.get(k) or {}) for k, t in sections.items()})

    @classmethod
    def load(cls, sweep_dir: Path) -> Config:
        """The typed config of a sweep folder (its config.yaml); needs no torch and no Hydra.

        StoreError names a missing or unreadable file; ConfigError one whose settings this
        version of gnsweep does not accept (the message names the setting).
        """
        loaded = store.read_sweep_config(Path(sweep_dir))
        try:
            return cls.from_dict(loaded)
        except ConfigError as err:
            raise ConfigError(f"{Path(sweep_dir) / store.SWEEP_CONFIG}: {err}") from None


def _section(name: str, schema: type, values: dict[str, Any]) -> Any:
    known = {f.name for f in fields(schema)}
    if name == "task":
        # Everything but the name is the task's own option; the task validates it.
        values = dict(values)
        task_name = values.pop("name", "digits")
        values = {"name": task_name, "options": {**values.pop("options", {}), **values}}
    unknown = set(values) - known
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"{name}.{key}: unknown option; known: {', '.join(sorted(known))}")
    return schema(**values)


def conf_dir() -> Path:
    """The `conf/` folder: $GNSWEEP_CONF, else the one beside the package (repo checkout)."""
    env = os.environ.get("GNSWEEP_CONF")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here / "conf", here.parent / "conf"]
    for path in candidates:
        if (path / "config.yaml").is_file():
            return path
    raise ConfigError("cannot find conf/config.yaml; set GNSWEEP_CONF to your conf folder")


def compose(overrides: list[str] | None = None) -> Config:
    """Compose conf/ with Hydra overrides (e.g. `task=digits sweep.batch_sizes=[8,64]`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides or [])
    _store_defaults()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except MissingConfigException as err:
        raise ConfigError(_missing_config_message(str(err))) from None
    except (HydraException, OmegaConfBaseException) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"bad override: {first}") from None
    finally:
        GlobalHydra.instance().clear()
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    return Config.from_dict({str(k): v for k, v in data.items()})


def _store_defaults() -> None:
    """Give Hydra the dataclass defaults, the one place they are kept: `gnsweep_defaults` (every
    section but the task) is merged first, so a group's YAML lists only what it changes and
    every setting can be overridden; `task_defaults/<name>` holds a task's options, which its
    YAML file extends."""
    from hydra.core.config_store import ConfigStore

    store_ = ConfigStore.instance()
    base = Config().to_dict()
    del base["task"]
    store_.store(name="gnsweep_defaults", node=base)
    for name in tasks.task_names():
        options = asdict(tasks.REGISTRY[name].options())
        store_.store(group="task_defaults", name=name, node={"name": name, **options})


def _missing_config_message(text: str) -> str:
    import re

    match = re.search(r"Could not load '(\w+)/(\w[\w-]*)'", text) or re.search(
        r"'(\w+)/(\w[\w-]*)'", text)
    if not match:
        return text.strip().splitlines()[0]
    group, choice = match.groups()
    options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
    return f"{group}={choice}: no such {group}; choose one of {', '.join(options)}"
