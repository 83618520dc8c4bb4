"""Typed configuration: the dataclass schemas, one per section, each field documented and
validated in `__post_init__`. The bottom floor: it imports only `errors`, `targets`, `noise`
(the noise methods' names) and the standard library.

Above it: `gnsweep.compose` composes `conf/` with Hydra (the CLI process only);
`gnsweep.tasks.checked` checks a task's name and options against the task registry and
`gnsweep.tasks.about` says what its targets and batch sizes mean; `gnsweep.folder` reads a
sweep folder's config.yaml (`read_config`, `SweepFolder.open`). Everything below the CLI
receives these dataclasses (or their JSON form in a run folder), never a DictConfig: workers
started by torchrun or Slurm load a run's `config.json` without Hydra.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from gnsweep import targets
from gnsweep.errors import ConfigError
from gnsweep.errors import choice as _choice
from gnsweep.errors import integer as _integer
from gnsweep.errors import number as _number
from gnsweep.errors import positive_list as _positive_list
from gnsweep.noise import DEFAULT_EMA_FRACTION, EVERY_AUTO, METHOD_NAMES, Method
from gnsweep.targets import LOSS_EMA_SAMPLES

__all__ = [
    "DECAYS",
    "EXECUTORS",
    "LOSS_KINDS",
    "METHOD_NAMES",
    "OPTIMIZERS",
    "PRECISIONS",
    "SCHEDULES",
    "SCRIPT",
    "AnalysisConfig",
    "BranchConfig",
    "Config",
    "ConfigError",
    "ExecutorConfig",
    "LoggerConfig",
    "NoiseConfig",
    "SweepConfig",
    "TaskConfig",
    "TrainConfig",
]


OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
EXECUTORS = ("local", "torchrun", "slurm")
LOSS_KINDS = ("smoothed", "raw", "eval")
SCHEDULES = ("constant", "adaptive", "along")
NOISE_RUNS = ("auto", "all")
"""`noise.runs`: the sweep plans which runs measure (`gnsweep.noise_plan`), or every run does."""
MAX_BATCH = 2**24
"""Largest batch size (samples a step) a sweep accepts: 16.8M sequences is more than any
training run uses, and a larger one fails only later, by running out of memory."""
DECAYS = ("constant", "cosine", "linear", "step")
PRECISIONS = ("fp32", "bf16", "fp16")
KEEP_CHECKPOINTS = ("none", "log")
SCRIPT = "script"
"""The task name of a sweep that runs the user's own training command (task=script,
docs/scripts.md): its rules span sections (`Config.check`), so the name lives here, on the
bottom floor; `gnsweep.tasks` takes it from here."""
MOVED = {("sweep", "optimizer"): "train.optimizer", ("sweep", "momentum"): "train.momentum"}
"""Settings that moved: the old name -> the new one (the old is refused, naming the new)."""


@dataclass
class TaskConfig:
    """Which model and data a run trains: a task's name and its options, as config.yaml holds
    them. The task registry checks both where a config enters (`gnsweep.tasks.checked`, called
    by the composition and by the sweep folder's open) and says what the task's targets and
    batch sizes mean (`gnsweep.tasks.about`); this schema only checks their types."""

    name: str = "digits"
    """Registered task name (`gnsweep tasks` lists them)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Task-specific options (hidden width, dimension, noise...), validated by the task."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"task.name: {self.name!r} is not a task name; give one that "
                              "`gnsweep tasks` lists")
        if not isinstance(self.options, dict):
            raise ConfigError(f"task: {type(self.options).__name__} where the task's options "
                              "(a mapping) belong")
        self.options = {str(k): v for k, v in self.options.items()}


def secret_is_text(where: str, value: Any, holds_uri: bool = False,
                   secret_name: bool = False) -> None:
    """A setting that holds a secret (`secret_name`: its name says so, `gnsweep.redact`) or a
    URI (which may carry a password) is a string or unset: a list or a number would be written
    and printed unmasked, or mangled (a number loses its leading zeros). ConfigError naming the
    setting, never its value."""
    if value is None or isinstance(value, str):
        return
    if holds_uri or secret_name:
        raise ConfigError(f"{where}: a {type(value).__name__} where a string is expected (a "
                          f"secret or a URI is one string); quote it: '{where}=\"...\"'")


@dataclass
class ScaleConfig:
    """The sweep's place in a family of scales (`gnsweep laws`, docs/laws.md)."""

    params: float = 0.0
    """The model's parameter count N (0: counted at launch from the task's model, without its
    embeddings; a task whose model cannot be built here, such as a training script, must give
    it). The data budget D is sweep.max_examples."""

    def __post_init__(self) -> None:
        self.params = _number("sweep.scale.params", self.params)
        if self.params < 0:
            raise ConfigError(f"sweep.scale.params: {self.params:g} must be >= 0 (0: counted at "
                              "launch)")


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
    """Seeds; each grid point runs once per seed (at least one)."""
    targets: list[float] = field(default_factory=lambda: [0.3, 0.1, 0.03])
    """Training-loss targets; a run stops once it reaches the hardest (smallest). `auto` (kept
    as []; the default for a custom task that names none): every run trains its whole budget
    and `gnsweep analyze` chooses the levels from what the runs reached
    (`analysis.auto_targets`)."""
    max_steps: int = 5000
    """Step budget of one run."""
    max_examples: int = 0
    """Example budget of one run (0: none)."""
    budget: int = 0
    """A fixed-budget sweep (0: not one): every run trains exactly this many examples (the
    task's unit: tokens for a language model) with no early stop at a target, and is read by
    its final smoothed (or eval) loss (`gnsweep laws`, docs/laws.md). Sets max_examples to it
    and max_steps high enough for the smallest batch size; the targets are then read by the
    analysis only (`stops_at_target`)."""
    loss_ema_examples: float = LOSS_EMA_SAMPLES
    """Time constant of the smoothed training loss, in examples (the task's unit): per-step
    decay exp(-B/this), so every batch size averages over the same number of examples (same
    noise, same lag in E). Left at this default it means 128 samples: `gnsweep launch`
    converts it to the task's unit (128 x tokens a sequence for a language model,
    `in_task_units`); a value given is taken in the task's unit as before."""
    divergence_factor: float = 3.0
    """A run diverges when its loss is NaN/inf or its smoothed loss exceeds this x its initial
    loss: the mean loss of its first steps until they hold 16 samples (an eighth of the loss
    window; the first step alone from B = 16 up), not one small batch's, which at B = 2 can be
    far below the loss by chance (`training.watch.LossWatch`). A loss task only: a task with
    its own metric, cartpole's return, diverges only on a NaN/inf loss."""
    log_every: int = 1
    """Write a metrics row every this many steps."""
    eval_every: int = 0
    """Evaluate on the held-out split every this many steps (0: never)."""
    eval_per_octave: int = 0
    """Also evaluate this many times per doubling of the steps: every step for the first 2N
    steps, every 2nd up to 4N, every 4th up to 8N ... (0: off). Dense where a run has just
    started: a branch run's targets lie a few steps from its start at large batch sizes and
    hundreds at small ones, and the same relative resolution serves both."""
    max_retries: int = 2
    """How often a run that raised is retried before it counts as failed."""
    stall_seconds: float = 1800.0
    """A run that logs no step for this long (a data server gone, a deadlock) is stopped,
    recorded failed with the reason "stalled" and retried like any failure (0: never)."""
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
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    """The model size N for `gnsweep laws` (sweep.scale.params; 0: counted at launch)."""

    @property
    def auto_targets(self) -> bool:
        """Whether the targets are chosen by the analysis (`sweep.targets=auto`): runs then stop
        at no target."""
        return not self.targets

    @property
    def stops_at_target(self) -> bool:
        """Whether a run stops once it reaches the hardest target: not with automatic targets,
        nor in a fixed-budget sweep (`budget`), where the targets serve the analysis only."""
        return not self.auto_targets and not self.budget

    def __post_init__(self) -> None:
        self.batch_sizes = _positive_list("sweep.batch_sizes", self.batch_sizes, _integer)
        self.learning_rates = _positive_list("sweep.learning_rates", self.learning_rates, _number)
        if self.targets == targets.AUTO or (isinstance(self.targets, (list, tuple))
                                            and not self.targets):
            self.targets = []  # automatic: chosen by the analysis from what the runs reached
        else:
            self.targets = _positive_list("sweep.targets", self.targets, _number)
        if not self.seeds:
            raise ConfigError("sweep.seeds: an empty list runs nothing; give at least one seed, "
                              "e.g. sweep.seeds=[0]")
        self.seeds = [_integer("sweep.seeds", s) for s in self.seeds]
        if len(set(self.seeds)) != len(self.seeds):  # one run id, trained once: refused
            raise ConfigError(f"sweep.seeds: {self.seeds} has repeated values")
        self.max_steps = _integer("sweep.max_steps", self.max_steps)
        if self.max_steps < 1:
            raise ConfigError(f"sweep.max_steps: {self.max_steps} is not allowed; must be >= 1")
        self.max_examples = _integer("sweep.max_examples", self.max_examples)
        self._check_budget()
        if isinstance(self.scale, dict):
            unknown = sorted(set(self.scale) - {"params"})
            if unknown:
                raise ConfigError(f"sweep.scale.{unknown[0]}: unknown option; known: params")
            self.scale = ScaleConfig(**self.scale)
        self.loss_ema_examples = _number("sweep.loss_ema_examples", self.loss_ema_examples)
        self.divergence_factor = _number("sweep.divergence_factor", self.divergence_factor)
        if self.divergence_factor <= 1:
            raise ConfigError(f"sweep.divergence_factor: {self.divergence_factor} must be > 1")
        for name in ("log_every", "eval_every", "eval_per_octave", "max_retries"):
            value = _integer(f"sweep.{name}", getattr(self, name))
            if value < (1 if name == "log_every" else 0):
                raise ConfigError(f"sweep.{name}: {value} is not allowed")
            setattr(self, name, value)
        self.stall_seconds = _number("sweep.stall_seconds", self.stall_seconds)
        if self.stall_seconds < 0:
            raise ConfigError(f"sweep.stall_seconds: {self.stall_seconds} must be >= 0 "
                              "(0: no stall watchdog)")
        if max(self.batch_sizes) > MAX_BATCH:
            raise ConfigError(f"sweep.batch_sizes: {max(self.batch_sizes)} samples a step is "
                              f"beyond what one step can hold (at most {MAX_BATCH}); use "
                              "smaller batch sizes")
        self._check_adaptive()

    def _check_budget(self) -> None:
        self.budget = _integer("sweep.budget", self.budget)
        if self.budget < 0:
            raise ConfigError(f"sweep.budget: {self.budget} must be >= 0 (0: no fixed budget)")
        if not self.budget:
            return
        if self.max_examples not in (0, self.budget):
            raise ConfigError(f"sweep.budget={self.budget} and sweep.max_examples="
                              f"{self.max_examples} disagree; give the budget alone")
        self.max_examples = self.budget
        # One step trains at least one sample, which holds at least one example.
        self.max_steps = max(self.max_steps, -(-self.budget // min(self.batch_sizes)))

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

    def adaptive_bounds(self) -> tuple[int, int]:
        """(smallest, largest) batch size of an adaptive run: the settings, else the grid's."""
        return (self.adaptive_min_batch or min(self.batch_sizes),
                self.adaptive_max_batch or max(self.batch_sizes))


@dataclass
class TrainConfig:
    """How every run trains, apart from what the sweep varies (batch size, learning rate): the
    optimizer, the learning-rate schedule, clipping, accumulation and precision
    (`gnsweep.training.recipe`, docs/training.md); and its checkpoints
    (`gnsweep.training.checkpoint`, docs/executors.md)."""

    optimizer: str = "sgd"
    """sgd, momentum (SGD with train.momentum, else 0.9), adam or adamw."""
    momentum: float = 0.0
    """SGD momentum (0: plain SGD, the setting the paper's eps_opt(B) describes)."""
    weight_decay: float = 0.0
    """Weight decay as torch defines it for each optimizer: added to the gradient (L2) for sgd,
    momentum and adam; decoupled (the weights shrink by lr x this each step) for adamw."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """adam, adamw: the decay rates of the first and second moment estimates."""
    eps: float = 1e-8
    """adam, adamw: added to the denominator."""
    grad_clip: float = 0.0
    """Clip the gradient's global norm to this (0: no clipping). The `grad_norm` column logs
    the norm before clipping; the noise scale is measured on the unclipped gradient."""
    warmup_steps: int = 0
    """Linear warmup from 0 over this many optimizer steps (0: none). Each batch size then
    warms up on a different number of examples: prefer warmup_examples in a sweep."""
    warmup_examples: int = 0
    """Linear warmup from 0 over this many examples, in the task's unit (0: none): the same
    data schedule at every batch size. Set at most one of the two warmups."""
    decay: str = "constant"
    """After the warmup: constant, cosine, linear, or step (two drops, at 1/3 and 2/3 of the
    horizon, each by sqrt(min_lr_ratio)), down to min_lr_ratio x the run's rate."""
    decay_examples: int = 0
    """The decay's horizon in examples, counted from the start of the run (0: the run's budget,
    sweep.max_examples when set, else sweep.max_steps in steps)."""
    min_lr_ratio: float = 0.0
    """The rate at the end of the decay, as a fraction of the run's rate (in [0, 1])."""
    microbatch_size: int = 0
    """Samples per forward/backward: each step's batch is cut into pieces of at most this many
    samples and their gradients accumulated (0: the whole per-rank batch at once)."""
    precision: str = "fp32"
    """fp32, bf16 or fp16: autocast around the task's loss (fp16 with a gradient scaler; a
    step it skips is not counted). The noise scale is measured on unscaled fp32 gradients."""
    loader_workers: int = 0
    """A task with a `dataset()`: the DataLoader's worker processes fetching and collating its
    items while the model trains (0: in the training process)."""
    checkpoint_every: int = 0
    """Save the run's state every this many optimizer steps (0: time-based only)."""
    checkpoint_seconds: float = 600.0
    """Save the run's state at least this often, seconds of training (0: steps only)."""
    keep_checkpoints_at: list[int] = field(default_factory=list)
    """Examples at which a checkpoint is taken and kept after the run (e.g. for branching):
    the first step boundary at or past each (`gnsweep branch --at` the same number takes it)."""
    keep_checkpoints: str = "none"
    """none, or log: also keep one at the first boundary past each power of two of examples."""

    def __post_init__(self) -> None:
        self.optimizer = _choice("train.optimizer", self.optimizer, OPTIMIZERS)
        for name in ("momentum", "weight_decay", "eps", "grad_clip", "min_lr_ratio"):
            setattr(self, name, _number(f"train.{name}", getattr(self, name)))
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"train.momentum: {self.momentum} must be in [0, 1)")
        for name in ("weight_decay", "eps", "grad_clip"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}: {getattr(self, name)} must be >= 0 (0: off)")
        betas = self.betas if isinstance(self.betas, (list, tuple)) else [self.betas]
        self.betas = [_number("train.betas", b) for b in betas]
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas: {self.betas} must be two numbers in [0, 1), e.g. "
                              "train.betas=[0.9,0.95]")
        zero = {"warmup_steps": "none", "warmup_examples": "none",
                "decay_examples": "the run's budget", "microbatch_size": "the whole batch",
                "loader_workers": "in the training process"}
        for name, meaning in zero.items():
            value = _integer(f"train.{name}", getattr(self, name))
            if value < 0:
                raise ConfigError(f"train.{name}: {value} must be >= 0 (0: {meaning})")
            setattr(self, name, value)
        if self.warmup_steps and self.warmup_examples:
            raise ConfigError("train.warmup_steps and train.warmup_examples are both set; keep "
                              "one (warmup_examples gives every batch size the same warmup)")
        self.decay = _choice("train.decay", self.decay, DECAYS)
        if self.decay != "constant" and 0 < self.decay_examples <= self.warmup_examples:
            raise ConfigError(f"train.decay_examples ({self.decay_examples}) ends the decay "
                              f"before train.warmup_examples ({self.warmup_examples}) ends the "
                              "warmup; the horizon counts from the start of the run")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio: {self.min_lr_ratio} must be in [0, 1]")
        if self.decay == "step" and self.min_lr_ratio <= 0:
            raise ConfigError("train.decay=step drops the rate twice by sqrt(train.min_lr_ratio):"
                              " set train.min_lr_ratio > 0, e.g. 0.01")
        self.precision = _choice("train.precision", self.precision, PRECISIONS)
        self._check_checkpoints()

    def _check_checkpoints(self) -> None:
        self.checkpoint_every = _integer("train.checkpoint_every", self.checkpoint_every)
        self.checkpoint_seconds = _number("train.checkpoint_seconds", self.checkpoint_seconds)
        for name in ("checkpoint_every", "checkpoint_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}: {getattr(self, name)} must be >= 0 (0: off)")
        self.keep_checkpoints_at = [
            _integer("train.keep_checkpoints_at", v) for v in self.keep_checkpoints_at or []]
        if any(v < 1 for v in self.keep_checkpoints_at):
            raise ConfigError(f"train.keep_checkpoints_at: {self.keep_checkpoints_at} must be "
                              "examples >= 1")
        self.keep_checkpoints = _choice("train.keep_checkpoints", self.keep_checkpoints,
                                        KEEP_CHECKPOINTS)

    @property
    def lr_scheduled(self) -> bool:
        """Whether the rate moves within a run (a warmup or a decay)."""
        return bool(self.warmup_steps or self.warmup_examples or self.decay != "constant")


@dataclass
class NoiseConfig:
    """How B_simple (and optionally B_noise) is measured during every run."""

    method: str = "auto"
    """One of `gnsweep.noise.Method`: per_example, microbatch, ddp, fsdp (a model sharded by
    FSDP), norm_layers (per-example norms of the LayerNorm/RMSNorm parameters only), none (no
    measurement: the baseline), or auto (fsdp or ddp under torchrun as the model says, else the
    cheaper right one of per_example and microbatch: docs/noise.md)."""
    microbatches: int = 4
    """Micro-batches per step for method=microbatch (b_small = B / this); where a step is
    already cut into train.microbatch_size pieces, those pieces are used instead."""
    every: int | str = "auto"
    """Measure every this many steps (1: every step), or auto: the steps needed to keep
    B_simple's standard error within 4% of a measurement on every step, at least one in 16
    (docs/noise.md, "Measuring a subset of steps")."""
    pooled: int = 1
    """This run's B_simple is one of this many (batch sizes) whose median the sweep reads: under
    every=auto it may measure the fewer steps that keep the median's error within 10% of one
    run measured on every step (`noise.pooled_variance_growth`). The noise plan sets it on the
    runs it measures (noise.runs=auto); 1: the run alone."""
    runs: str = "auto"
    """Which runs measure: auto (the sweep plans it: at each batch size the runs nearest the
    best learning rate known measure on the steps `every` says, the others not at all;
    `gnsweep.noise_plan`, docs/noise.md) or all (every run)."""
    ema_steps: float = 0.0
    """EMA time constant of G2 and S in steps (0: use ema_examples)."""
    ema_examples: float = 2048.0
    """EMA time constant of G2 and S in examples (used when ema_steps is 0)."""
    hessian_every: int = 0
    """Measure B_noise with Hessian-vector products every this many steps (0: never)."""
    ema_fraction: float = DEFAULT_EMA_FRACTION
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
        self.method = _choice("noise.method", self.method, METHOD_NAMES)
        self.runs = _choice("noise.runs", self.runs, NOISE_RUNS)
        self.microbatches = _integer("noise.microbatches", self.microbatches)
        self.pooled = _integer("noise.pooled", self.pooled)
        if self.pooled < 1:
            raise ConfigError(f"noise.pooled: {self.pooled} must be >= 1")
        if self.microbatches < 2:
            raise ConfigError(f"noise.microbatches: {self.microbatches} must be >= 2")
        if isinstance(self.every, str) and self.every.strip().lower() == EVERY_AUTO:
            self.every = EVERY_AUTO
        else:
            self.every = _integer("noise.every", self.every)
            if self.every < 1:
                raise ConfigError(f"noise.every: {self.every} must be >= 1 (or auto)")
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
    """Local worker processes (0: one per GPU of `gpus`, else one per core); torchrun: jobs at
    once (0: as many as `gpus` hold); Slurm: jobs to spread the runs over."""
    threads_per_worker: int = 1
    """Torch threads in each worker (two 1-thread processes beat one 2-thread one)."""
    nproc_per_node: int = 2
    """torchrun/Slurm: processes per node for each run (DDP world size per node)."""
    nodes: int = 1
    """Slurm: nodes per job."""
    partition: str = ""
    """Slurm partition ('' for the cluster default)."""
    gpus_per_node: int = 0
    """Slurm: GPUs per node; each DDP process trains on one (its LOCAL_RANK), so
    nproc_per_node is at most this (0: no GPUs asked for)."""
    cpus_per_task: int = 1
    """Slurm: CPUs per task."""
    time_min: int = 60
    """Slurm: time limit of one job, minutes."""
    runs_per_job: int = 0
    """Slurm: runs taken in turn by one job (0: spread the runs over `workers` jobs)."""
    max_restarts: int = 0
    """torchrun/Slurm: elastic restarts of a torchrun job whose process died (`--max-restarts`);
    the restarted job continues its run from the run's checkpoint."""
    sbatch_extra: dict[str, Any] = field(default_factory=dict)
    """Slurm: extra sbatch options, e.g. {account: abc, qos: high}."""
    gpus: str = "auto"
    """local/torchrun: the GPUs this launcher shares out, each worker (local) or torchrun job
    its own through CUDA_VISIBLE_DEVICES: auto (those the launcher sees: its own
    CUDA_VISIBLE_DEVICES, else all; none on a machine without GPUs), none (train on the CPU),
    or a list of CUDA device ids or UUIDs, "0,1,2,3" or [0,1,2,3]. Slurm gives each job its
    own GPUs (gpus_per_node)."""

    def __post_init__(self) -> None:
        self.kind = _choice("executor.kind", self.kind, EXECUTORS)
        for name in ("workers", "threads_per_worker", "nproc_per_node", "nodes", "gpus_per_node",
                     "cpus_per_task", "time_min", "runs_per_job", "max_restarts"):
            value = _integer(f"executor.{name}", getattr(self, name))
            minimum = 0 if name in ("workers", "gpus_per_node", "runs_per_job",
                                    "max_restarts") else 1
            if value < minimum:
                raise ConfigError(f"executor.{name}: {value} is not allowed; must be >= {minimum}")
            setattr(self, name, value)
        self.gpus = _gpu_setting(self.gpus)
        if self.kind == "slurm" and self.gpus != "auto":
            raise ConfigError(f"executor.gpus={self.gpus}: Slurm gives each job its own GPUs; "
                              "ask for them with executor.gpus_per_node (executor.gpus is for "
                              "executor=local and torchrun)")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            raise ConfigError(f"executor.nproc_per_node={self.nproc_per_node} DDP processes on "
                              f"executor.gpus_per_node={self.gpus_per_node} GPUs: each process "
                              "trains on one GPU (its LOCAL_RANK); use at most one per GPU")

    def n_workers(self) -> int:
        return self.workers or max(1, os.cpu_count() or 1)

    def world_size(self) -> int:
        """DDP processes that train one run (the one place this is computed)."""
        if self.kind == "local":
            return 1
        if self.kind == "torchrun":
            return self.nproc_per_node
        return self.nproc_per_node * self.nodes


def _gpu_setting(value: Any) -> str:
    """`executor.gpus` as stored: auto, none, or GPU ids joined by commas (an int is one id; a
    list or a comma-separated string several); ConfigError naming the setting otherwise."""
    if value is None:
        return "none"
    if isinstance(value, str) and value.strip().lower() in ("auto", "none"):
        return value.strip().lower()
    items: list[Any]
    if isinstance(value, str):
        items = [s.strip() for s in value.split(",")]
    elif isinstance(value, (list, tuple)) or hasattr(value, "__iter__"):
        items = [v if isinstance(v, bool) else str(v).strip() for v in value]
    else:
        items = [value if isinstance(value, bool) else str(value)]
    bad = [v for v in items
           if isinstance(v, bool) or not (v.isdigit() or (v.startswith(("GPU-", "MIG-"))
                                                             and len(v) > 4))]
    if bad or not items:
        raise ConfigError(f"executor.gpus: {value!r} is not auto, none or a list of GPU ids "
                          "(CUDA device numbers or UUIDs), e.g. executor.gpus=auto, "
                          "executor.gpus=none or executor.gpus=[0,1,2,3]")
    ids = [str(int(v)) if v.isdigit() else v for v in items]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"executor.gpus: {','.join(ids)} names a GPU twice; list each once")
    return ",".join(ids)


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


LOGGER_OPTIONS: dict[str, tuple[str, ...]] = {
    "none": (), "tensorboard": ("flush_secs",), "mlflow": ("tracking_uri", "experiment"),
    "wandb": ("project", "entity", "mode")}
"""Each tracker kind and the options it reads (`gnsweep.tracking.options_of` says the same of
the backends: a test holds them equal)."""
LOGGER_MODES = ("online", "offline", "disabled")
"""wandb's modes."""


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
        for name in ("tracking_uri", "experiment", "project", "entity", "mode"):
            value = getattr(self, name)
            secret_is_text(f"logger.{name}", value, holds_uri=True)
        self.kind = _choice("logger.kind", self.kind, tuple(LOGGER_OPTIONS))
        self.flush_secs = _integer("logger.flush_secs", self.flush_secs)
        if self.flush_secs < 1:
            raise ConfigError(f"logger.flush_secs: {self.flush_secs} must be >= 1")
        self.options()  # an option another kind reads is refused
        if self.mode is not None and self.mode not in LOGGER_MODES:
            raise ConfigError(f"logger.mode={self.mode}: choose one of {', '.join(LOGGER_MODES)}")

    def options(self) -> dict[str, Any]:
        """The options `make_logger` takes for this kind: those set (not null) that the kind
        reads. One set for another kind is refused (it would silently do nothing)."""
        defaults = LoggerConfig.__dataclass_fields__
        accepted = set(LOGGER_OPTIONS[self.kind])
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

    targets: list[float] = field(default_factory=list)
    """Targets relative to each branch point: fractions of the loss there (0.9: ten per cent
    below it); for a metric that rises, the mirror L + (1 - f)|L|. Empty (the default): every
    run trains one window (`window`, `window_steps`) and the analysis chooses each point's
    targets from the losses its runs reached (`analysis.along.auto_targets`)."""
    window: int = 0
    """Examples (in the task's unit) each branch run trains from its point when the targets are
    automatic, and the window of the tolerance rule (`tolerance`); 0: `window_steps` steps of
    the grid's largest batch size (the same examples for every batch size)."""
    window_steps: int = 16
    """With `window=0`: the window in steps of the grid's largest batch size (a batch half as
    large trains twice the steps)."""
    tolerance: float = 0.5
    """The second definition of the local B_crit (Merrill et al. 2025): the largest batch size
    whose loss decrease over the window is at least (1 - tolerance) x the best smaller batch
    size's. 0.5 puts it where eq. 2.11 puts B_crit while the loss falls linearly in examples
    over the window (a batch of B_crit needs twice the examples: half the progress)."""
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
        if isinstance(self.targets, (list, tuple)) and not self.targets:
            self.targets = []  # automatic: chosen from what the branch runs reach
        else:
            self.targets = _positive_list("branch.targets", self.targets, _number)
        for name in ("window", "window_steps"):
            value = _integer(f"branch.{name}", getattr(self, name))
            least = 1 if name == "window_steps" else 0
            if value < least:
                raise ConfigError(f"branch.{name}: {value} is not allowed; must be >= {least}")
            setattr(self, name, value)
        self.tolerance = _number("branch.tolerance", self.tolerance)
        if not 0 < self.tolerance < 1:
            raise ConfigError(f"branch.tolerance: {self.tolerance:g} is not a fraction in (0, 1); "
                              "give the share of the best smaller batch's loss decrease a larger "
                              "batch may lose, e.g. 0.5")
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

    @property
    def automatic(self) -> bool:
        """Whether the targets are chosen by the analysis (no `branch.targets`): branch runs then
        train one window each and stop at no target."""
        return not self.targets

    def point(self, at_examples: int) -> dict[str, Any]:
        """The branch point a run starts from, by the examples the base run had seen there."""
        for point in self.points:
            if point["at_examples"] == at_examples:
                return point
        raise ConfigError(f"no branch point at {at_examples} examples in branch.points "
                          f"({', '.join(str(p['at_examples']) for p in self.points) or 'none'})")


@dataclass
class Config:
    """The whole sweep: task, grid, training recipe, noise measurement, executor, analysis, run
    logging."""

    task: TaskConfig = field(default_factory=TaskConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
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
        script = self.task.name == SCRIPT
        # A script trains itself (its own DDP): gnsweep measures it from inside its process
        # (auto: its backward passes, `gnsweep.inscript`) or not at all (none); a method of
        # gnsweep's own loop would be ignored, so it is refused rather than silently dropped.
        if script and method not in (Method.AUTO, Method.NONE):
            raise ConfigError(f"noise.method={method} with task=script: gnsweep measures a "
                              "script from its backward passes (noise.method=auto, the "
                              "default) or not at all (none); a script may also measure "
                              "itself (gnsweep.current_run().monitor(model, method=...))")
        # With DDP only the communication hook sees the per-worker gradients; without DDP
        # there is no hook.
        if not script and world > 1 and method not in (Method.AUTO, Method.DDP):
            raise ConfigError(f"noise.method={method} with {world} DDP processes per run: use "
                              "noise.method=ddp (or auto)")
        if not script and world == 1 and method == Method.DDP:
            raise ConfigError("noise.method=ddp needs DDP: executor=torchrun (or slurm) with "
                              "executor.nproc_per_node >= 2, or noise.method=auto")
        if script and self.sweep.schedule != "constant":
            raise ConfigError(f"sweep.schedule={self.sweep.schedule} with task=script: a "
                              "script's batch size is the grid's, fixed for its run; use "
                              "sweep.schedule=constant")
        if script and self.executor.kind == "slurm" and self.executor.nodes > 1:
            raise ConfigError(f"executor.nodes={self.executor.nodes} with task=script: a "
                              "script's command runs under torchrun on one node (its job's); "
                              "use executor.nodes=1")
        sweep, train = self.sweep, self.train
        # An along run (docs/along.md) sets its rate by the same rule as an adaptive one.
        if sweep.schedule in ("adaptive", "along") and train.optimizer in ("adam", "adamw"):
            raise ConfigError(f"sweep.schedule={sweep.schedule} with train.optimizer="
                              f"{train.optimizer}: its learning-rate rule eps(B) = "
                              "eps_max/(1 + B_noise/B) is SGD's (eq. 2.7); use sgd or momentum")
        if sweep.schedule in ("adaptive", "along") and train.lr_scheduled:
            raise ConfigError(f"sweep.schedule={sweep.schedule} sets each step's rate by eps(B) "
                              "(eq. 2.7); drop train.warmup_steps/warmup_examples and use "
                              "train.decay=constant")
        # Each DDP worker trains on B / world examples a step (a script gets the global B as
        # `{batch_size}` and splits it over its ranks itself).
        for batch in [] if script else self.sweep.batch_sizes:
            if batch % world:
                raise ConfigError(f"sweep.batch_sizes: {batch} does not split over {world} "
                                  f"DDP processes; use multiples of {world}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        unknown = set(data) - set(SECTIONS)
        if unknown:
            raise ConfigError(f"unknown config section(s): {', '.join(sorted(unknown))}")
        return cls(**{k: _section(k, t, data.get(k) or {}) for k, t in SECTIONS.items()})


SECTIONS: dict[str, type] = {
    "task": TaskConfig, "sweep": SweepConfig, "train": TrainConfig, "noise": NoiseConfig,
    "executor": ExecutorConfig, "analysis": AnalysisConfig, "logger": LoggerConfig,
    "branch": BranchConfig}
"""The config's sections by name, as `Config` holds them."""


def _section(name: str, schema: type, values: dict[str, Any]) -> Any:
    known = {f.name for f in fields(schema)}
    for key in values:
        if (name, key) in MOVED:
            raise ConfigError(f"{name}.{key} is now {MOVED[name, key]}: write "
                              f"{MOVED[name, key]}=... instead (in a sweep file: a train: node)")
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
