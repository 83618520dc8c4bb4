"""The monitor: squared gradient norms from a live model, fed to the pure estimators in
`gnsweep.noise`.

`NoiseScaleMonitor` holds its measurement sources in a list (`sources`, each a
`gnsweep.measure.source.Source`), all at the parameters of the current step and all unbiased
for the same `|G|^2` and `tr(Sigma)` of eq. A.2: per-example norms (`per_example`, b_small = 1;
parameters of layers they do not cover fall back to micro-batches, the two parts summed by
`gnsweep.noise.combine_parts`), micro-batches (`microbatch`, b_small = B / k), DDP's
communication hook or parameter hooks (`ddp`, b_small = the per-worker batch; its numbers are
summed over the workers inside the next step's all-reduce, so the estimate `step()` returns
lags one measured step and `close()` folds the last one in) and FSDP's unsharded gradients
(`fsdp`, b_small = one rank's micro-step). B_noise (eq. 2.8) comes from Hessian-vector products
every `hessian_every` steps (`hessian_norms`); B_simple_P in the optimizer's preconditioner from
`gnsweep.measure.preconditioned`. Which method `auto` keeps is `gnsweep.measure.choice`; one
measurement at fixed parameters is `gnsweep.measure.offline.measure_noise_scale`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from gnsweep.measure.batchstats import (
    batch_statistics_layers,
    per_example_refusal,
    say_ghost_batches,
)
from gnsweep.measure.build import build_sources, norm_layer_params
from gnsweep.measure.choice import AutoChoice
from gnsweep.measure.common import (
    Batch,
    LossFn,
    TaskLoss,
    first_tensor,
    is_ddp,
    log,
    measured_parameters,
    now,
)
from gnsweep.measure.hessian import hessian_or_refusal
from gnsweep.measure.microbatch import Increments
from gnsweep.measure.per_example import PerExample
from gnsweep.measure.preconditioned import PreconditionedEstimate
from gnsweep.measure.source import InUse, Source, StepNorms, read_all
from gnsweep.noise import (
    EVERY_AUTO,
    METHOD_NAMES,
    PAIR_METHODS,
    MeasureSchedule,
    Method,
    NoiseEstimate,
    NoiseScaleEma,
    NormPair,
    ema_window,
    estimate_state,
    load_estimate,
)

PAIR_METHOD_NAMES = tuple(str(m) for m in PAIR_METHODS)
"""The methods that measure the whole gradient's pair of eq. A.2 (`gnsweep.noise.PAIR_METHODS`)."""
NORM_LAYERS = str(Method.NORM_LAYERS)
"""`method="norm_layers"`: per-example norms of the LayerNorm / RMSNorm parameters only (Gray et
al. 2024): B_simple of that block of the gradient, a few reductions per layer; the other
layers carry no hooks. docs/noise.md says where it tracks the whole model's B_simple."""
OFF = str(Method.NONE)
"""`method="none"`: nothing is measured (no hooks; `step()` counts steps and returns None): the
training the cost of a measurement is compared with."""
ACCUMULATION_HINT = ("monitor.accumulate() after each micro-batch's backward; "
                     "gradient_accumulation_steps >= 2 with Hugging Face's Trainer, "
                     "accumulate_grad_batches >= 2 with Lightning")
"""How a loop gives the monitor micro-batches, in every loop's words (`accumulation_hint`)."""


class NoiseScaleMonitor:
    """Measures B_simple (eq. 2.9) and optionally B_noise (eq. 2.8) inside a training loop.

    Per step: forward, `loss.backward()` on the batch-mean loss, `monitor.step()`, then
    `optimizer.step()`. With gradient accumulation (and for `method="microbatch"`), scale each
    micro-batch's loss so that `.grad` ends up holding the batch mean and call
    `monitor.accumulate()` after each micro-batch's backward. `.grad` must start each step at
    zero (`optimizer.zero_grad()`); call `step()` before clipping or rescaling gradients.

    The time window of the estimate: `b_simple` is EMA(tr Sigma) / EMA(|G|^2), a |G|^2-weighted
    mean of B_simple over the EMA's window, which is
    - `ema_fraction` > 0: the last `ema_fraction` of the examples seen so far (time constant
      `ema_fraction * seen`; 0.2 in gnsweep's runs), so it covers the same span of log examples
      all run long and follows training as |G|^2 falls;
    - else `ema_steps` > 0: a time constant in steps;
    - else `ema_examples`: a time constant in examples (`math.inf`: the plain mean of every
      measurement, for estimates at fixed parameters).
    B_noise's EMAs run on the same clock (examples since the last Hessian measurement), so both
    ratios cover the same span however rarely B_noise is measured. Where |G|^2 changed more than
    2x inside the window the estimate leans to the window's start: `estimate.drift` says so.

    `every`: measure every n steps (hooks idle between), or `"auto"`: the steps needed to
    keep B_simple's standard error within 4% of a measurement on every step
    (`gnsweep.noise.MeasureSchedule`), at least one in 16; each measurement weighs the steps
    it stands for, so the window averages over training progress however many steps were
    measured; `pooled` (n >= 2: this run's B_simple is one of n whose median a sweep reads)
    lets `"auto"` measure fewer, keeping the median's error within 10% of one run's on every
    step. `method="none"`: no
    measurement at all (the baseline; `step()` returns None). `hessian_every` > 0 measures
    B_noise every n steps when `step(batch=...)` is given the step's batch, with
    `hessian_microbatches` gradients per measurement (see `hessian_norms`). The loss for those
    passes is either `loss_fn(outputs, targets)` with `batch=(inputs, targets)`, or
    `task_loss(model, batch)` with whatever batch the training loop drew (a task's `loss`:
    tensor, tuple, list or dict of tensors, split along dim 0).

    `parameters`: the parameters whose gradient is measured (default: every trainable one of
    the model). G, Sigma and H are then those of that block of the gradient, and B_simple is
    eq. 2.9 on it; e.g. an actor-critic's actor alone (`docs/tasks.md`, `noise_parameters`).
    The other parameters still train; their gradients are just not looked at.

    `timed_auto`: the cheaper of per-example norms and micro-batches is kept after the
    first measured step (`gnsweep.measure.choice.AutoChoice`, held as `auto`).

    The monitor holds its parts as objects, each told what it needs: `auto` (the choice of
    method), `preconditioned` (B_simple_P, `gnsweep.measure.preconditioned`), and `in_use`
    (the method, sources and hooks in use, the one record `auto` may switch).

    A layer whose gradient per-example norms cannot attribute to examples (examples along
    dim 1, a sequence-first layout; positions `wpe(torch.arange(T))` where the check of
    `gnsweep.measure.per_example.positions` gives no verdict; `unattributed`) leaves the first
    measured step unmeasured; `method="auto"` then measures with micro-batches (said once, `choice`
    says why), an explicit `"per_example"` raises a ValueError.
    """

    def __init__(self, model: nn.Module, method: str = "auto", *, every: int | str = 1,
                 ema_steps: float = 0.0, ema_examples: float | None = None,
                 loss_fn: LossFn | None = None, hessian_every: int = 0,
                 hessian_microbatches: int = 2, task_loss: TaskLoss | None = None,
                 ema_fraction: float | None = None,
                 parameters: Iterable[nn.Parameter] | None = None,
                 all_reduced_grads: bool = False, timed_auto: bool = False,
                 optimizer: torch.optim.Optimizer | None = None, pooled: int = 1) -> None:
        if method not in METHOD_NAMES:
            raise ValueError(f"method={method!r}: choose one of {', '.join(METHOD_NAMES)}")
        if (every != EVERY_AUTO and not (isinstance(every, int) and every >= 1)) or \
                hessian_every < 0 or hessian_microbatches < 2:
            raise ValueError("need every >= 1 (or 'auto'), hessian_every >= 0 and "
                             "hessian_microbatches >= 2")
        if hessian_every and loss_fn is None and task_loss is None:
            raise ValueError("hessian_every > 0 needs loss_fn(outputs, targets) or "
                             "task_loss(model, batch) for B_noise")
        self.model = model
        self.params = measured_parameters(model, parameters)
        self.every, self.hessian_every = every, hessian_every
        self.hessian_microbatches = hessian_microbatches
        self.loss_fn, self.task_loss = loss_fn, task_loss
        window = ema_window(ema_fraction, ema_steps, ema_examples)
        self.ema = NoiseScaleEma(ema_steps=window["ema_steps"], ema_fraction=window["ema_fraction"],
                                 ema_examples=window["ema_examples"])
        self.steps = 0
        self.schedule = MeasureSchedule(every, pooled)
        """Which steps are measured, and how many were."""
        self._step_examples = 0
        self.estimate: NoiseEstimate | None = None
        self._busy = False
        self._warned: set[str] = set()
        self._loss_scale = 1.0
        self._grads_unscaled = False
        self._examples = 0
        self._since_examples, self._since_steps = 0, 0
        self.closed = False
        """`close()` was called: the hooks are gone, and `step()` refuses to go on."""
        # The module the Hessian passes run on: never through DDP's reducer.
        self.module: nn.Module = cast(nn.Module, model.module) if is_ddp(model) else model
        self._whole_batches = False  # measure_noise_scale: each micro-batch a whole batch
        self._batch_stats = [m for _, m in batch_statistics_layers(self.module,
                                                                   training_only=False)]
        self._started: float | None = None
        self._hessian_seconds = 0.0
        self._asked = self.requested = method
        self.accumulation_hint = ACCUMULATION_HINT
        """How to give a step in micro-batches, in the words of the loop that drives this
        monitor (the framework callbacks set their own setting's name)."""
        if method == NORM_LAYERS:
            self.params, method = norm_layer_params(self.module, self.params), "per_example"
        self.in_use = InUse(method)
        """What measures B_simple's pairs now (`gnsweep.measure.source`): the method, one
        source of it (and micro-batches for parameters per-example norms do not cover), and
        every hook handle the monitor holds."""
        self.auto = AutoChoice(self.in_use, requested=self.requested, gate=self,
                               module=self.module, params=self.params,
                               batch_stats=self._batch_stats, warn=self.warn_once,
                               hint=lambda: self.accumulation_hint)
        """The choice of method (`gnsweep.measure.choice`)."""
        self.preconditioned = PreconditionedEstimate(window, self.in_use, self.params,
                                                     self.warn_once,
                                                     lambda: self.accumulation_hint)
        """B_simple_P in the optimizer's preconditioner (`gnsweep.measure.preconditioned`)."""
        if method == OFF:  # nothing measured, nothing hooked
            self.hessian_every = 0
            return
        # auto: the method right for this model and launch; a method wrong for it is refused.
        # Counted before the sources' own pre-hooks run (a broadcast parameter's reads the
        # batch); removed again where the method is refused.
        self.in_use.handles.append(
            model.register_forward_pre_hook(self._count_examples, with_kwargs=True))
        try:
            built = build_sources(self, model, self.module, self.params, method,
                                  parameters=parameters, all_reduced=all_reduced_grads,
                                  hessian_every=self.hessian_every, timed_auto=timed_auto)
        except BaseException:
            self.in_use.handles.pop().remove()
            raise
        self.in_use.method, self.in_use.sources = built.method, built.sources
        self.auto.candidates = built.candidates
        for source in self.sources:
            self.in_use.handles += source.handles
        if optimizer is not None:
            self.precondition(optimizer)

    # -- the training-loop API ------------------------------------------------------------

    @property
    def measuring(self) -> bool:
        """Whether the current step (the one before the next `step()`) is measured."""
        return self.schedule.next and self.method != OFF

    @property
    def measures(self) -> str:
        """What is measured: `norm_layers` or `none` where asked for, else the method."""
        return self._asked if self._asked in (NORM_LAYERS, OFF) else self.method

    @property
    def method(self) -> str:
        """The method measuring now (`auto` resolved; it may move to micro-batches)."""
        return self.in_use.method

    @property
    def sources(self) -> list[Source]:
        """What measures B_simple's pairs (`gnsweep.measure.source`): one source of the
        method, and micro-batches for parameters per-example norms do not cover."""
        return self.in_use.sources

    @property
    def choice(self) -> dict[str, Any] | None:
        """With `timed_auto`: {"method", "reason", "batch", "step_seconds": the fastest
        measured step after the choice}; None before it has chosen (`AutoChoice.choice`)."""
        return self.auto.choice

    @property
    def needs_microbatches(self) -> bool:
        """True when the batch must be back-propagated in micro-batches with `accumulate()`
        after each: method microbatch, or per_example with layers it cannot handle, or fsdp on
        one process."""
        return self.auto.needs_microbatches

    @property
    def why_microbatches(self) -> str:
        """Why this monitor needs each measured step in micro-batches, or "" when it does
        not (`AutoChoice.why_microbatches`)."""
        return self.auto.why_microbatches

    @property
    def wants_microbatches(self) -> bool:
        """B_simple_P needs this step in micro-batches
        (`PreconditionedEstimate.wants_microbatches`)."""
        return self.preconditioned.wants_microbatches

    @property
    def timed(self) -> bool:
        """Built with `timed_auto` where both per-example norms and micro-batches are right."""
        return self.auto.timed

    def keep(self, method: str, reason: str = "the batch cannot be split") -> None:
        """`timed_auto`: measure with `method` from the next step on (`AutoChoice.keep`)."""
        self.auto.keep(method, reason)

    def rides_pieces(self, reason: str) -> None:
        """The loop cuts every step into micro-batches anyway (`AutoChoice.rides_pieces`)."""
        self.auto.rides_pieces(reason)

    def unsplittable(self) -> str | None:
        """The run's first batch cannot be cut along dim 0: the method to rebuild this monitor
        with, or None (`AutoChoice.unsplittable`)."""
        return self.auto.unsplittable()

    def resumed_method(self, saved: dict[str, Any]) -> str | None:
        """The method to rebuild this monitor with before `load_state_dict(saved)`, or None:
        as built (`AutoChoice.resumed_method`)."""
        return self.auto.resumed_method(saved)

    def precondition(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure B_simple_P (`b_simple_precond`) in `optimizer`'s diagonal preconditioner
        beside B_simple (`PreconditionedEstimate.precondition`)."""
        self.preconditioned.precondition(optimizer, self.auto.candidates)

    def warn_once(self, key: str, message: str) -> None:
        """Log `message` the first time `key` is seen (the keys are checkpointed). In a sweep,
        once per launch by `key` (`gnsweep.notices`): every run's monitor would say it, with its
        own numbers."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, extra={"once": f"noise monitor: {key}"})

    def microbatches(self, wanted: int, samples: int) -> int:
        """The micro-batches this step's backward must come in for the measurement: `wanted`
        (noise.microbatches, at most one per sample) on a measured step that needs them, else
        one (the batch whole)."""
        split = self.needs_microbatches or self.wants_microbatches
        return min(wanted, samples) if self.measuring and split else 1

    @property
    def _per_example(self) -> PerExample | None:
        """The per-example source in use, or None."""
        return self.in_use.find(PerExample)

    @property
    def unattributed(self) -> dict[str, str]:
        """Layers whose gradient per-example norms cannot attribute to examples, met so far on
        measured steps (name -> what was seen; `PerExample.unattributed`): an input without
        the batch dimension. Empty when none, or when per-example norms are not in use."""
        per_example = self.in_use.find(PerExample)
        return dict(per_example.unattributed) if per_example is not None else {}

    @property
    def b_simple(self) -> float:
        return self.estimate.b_simple if self.estimate is not None else math.nan

    @property
    def b_noise(self) -> float:
        return self.estimate.b_noise if self.estimate is not None else math.nan

    def accumulate(self) -> None:
        """Record the micro-batch just back-propagated (call after each micro-batch's backward)."""
        if not self.capturing:
            return
        self.preconditioned.read_preconditioner()
        source = self.preconditioned.source()
        for own in self.sources:
            own.accumulate(self._examples)
        if source is not None and source not in self.sources:
            source.accumulate(self._examples)

    @torch.no_grad()
    def step(self, batch: Batch | None = None, *, examples: int | None = None,
             loss_scale: float = 1.0, grads_unscaled: bool = False) -> NoiseEstimate | None:
        """Fold this step's measurement in; call after backward, before `optimizer.step()`.

        `batch` (the step's batch: `(inputs, targets)` for `loss_fn`, anything the task samples
        for `task_loss`) lets a due Hessian measurement run. Returns
        the current estimate (None before the first measurement). `examples`: the examples
        this step trained on, in the caller's unit (tokens for a language model), for the EMA's
        time constant in examples; default the batch dimension of the model's forward calls.
        `loss_scale`: the factor the loss was multiplied by before backward (fp16's
        `GradScaler.get_scale()`, before `unscale_`); every squared norm is divided by its
        square, so the statistics are those of the unscaled gradients. A step whose scaled
        gradients overflowed (non-finite norms, skipped by the scaler too) is skipped.
        `grads_unscaled`: `.grad` itself was already divided by `loss_scale`
        (`GradScaler.unscale_`, as Lightning's `on_before_optimizer_step` sees it), while what
        the hooks and `accumulate()` captured during backward is still scaled.
        """
        if self.closed:  # its hooks are gone: it would hand back the last estimate, stale
            raise ValueError("step() on a closed NoiseScaleMonitor; build a new monitor (its "
                             "state_dict() carries the EMAs over)")
        if not (loss_scale > 0 and math.isfinite(loss_scale)):
            raise ValueError(f"loss_scale={loss_scale}: need a finite number > 0")
        self._loss_scale = float(loss_scale)
        self._grads_unscaled = grads_unscaled
        measuring = self.measuring
        steps_examples = self._examples
        self.steps += 1
        self._step_examples = self._examples if examples is None else examples
        self._since_examples += self._step_examples
        self._since_steps += 1
        self.preconditioned.advance(self._step_examples)
        if self.method == OFF:
            self._examples = 0
            self.schedule.advance(False, self.ema, self._since_examples, self._step_examples)
            return None
        hessian = bool(self.hessian_every and (self.steps - 1) % self.hessian_every == 0)
        uncovered: dict[int, str] = {}
        checked = self._per_example
        sources = list(self.sources)  # those of this step, whatever it switches to
        try:
            if measuring and checked is not None:
                uncovered = checked.verify(self._own_pass(), self._loss_scale,
                                           self._grads_unscaled)
            if measuring or hessian:
                self._measure(batch, plain=measuring, hessian=hessian)
        finally:
            self._examples = 0
            for source in sources:
                source.reset()
            if checked is not None:
                checked.coverage.after_step(measuring)
            self.preconditioned.reset()
        if self.auto.timing is not None and measuring and self._started is not None:
            seconds = now(self.params[0].device) - self._started - self._hessian_seconds
            self.auto.timed_step(seconds)
        self._started, self._hessian_seconds = None, 0.0
        self.schedule.advance(measuring, self.ema, self._since_examples, self._step_examples)
        if uncovered:
            self.auto.uncover(uncovered)
        per_example = self._per_example
        if measuring and per_example is not None and per_example.unattributed:
            self.auto.unattributable(steps_examples)
        elif self.timed and self.choice is None and measuring and per_example is not None:
            self.auto.choose(steps_examples, self.wants_microbatches)
        return self.estimate

    def close(self) -> None:
        """Remove the hooks (DDP's communication hook stays, all-reducing without measuring);
        `step()` is refused from then on."""
        self.closed = True
        for handle in self.in_use.handles:
            handle.remove()
        self.in_use.handles = []
        for per_example, _ in self.auto.candidates.values():
            if per_example is not None:
                per_example.coverage.disarm()
        for source in self.sources:
            last = source.close(self)  # DDP: the last measurement's all-reduce
            if last is not None:
                self._fold(last.parts, last.hess,
                           self.preconditioned.ddp_pairs(last.parts, last.preconditioned))

    def state_dict(self) -> dict[str, Any]:
        """The measurement's state between steps: the method in use, steps counted, the EMAs
        (`NoiseScaleEma.state_dict`), the examples and steps since the last measurement, whether
        B_noise is still measured, and the warnings already given. Under DDP also the last
        measured step's norms (`ddp_pending`: its all-reduce, overlapped with the next step, is
        waited for here), which the next measurement folds in. With `timed_auto`, the steps
        timed so far (`timing`) and the method chosen (`choice`)."""
        return {"method": self.method, "steps": self.steps, **self.auto.state_dict(),
                "estimate": estimate_state(self.estimate), "hessian_every": self.hessian_every,
                "ema": self.ema.state_dict(), "schedule": self.schedule.state_dict(),
                **self.preconditioned.state_dict(),
                "since_examples": self._since_examples, "since_steps": self._since_steps,
                "warned": sorted(self._warned), "ddp_pending": None,
                **{k: v for source in self.sources for k, v in source.state_dict().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` into a monitor built alike (same model, method, settings)."""
        self.auto.load_state_dict(state)
        if state["method"] != self.method:
            raise ValueError(f"monitor state of method {state['method']}, this monitor "
                             f"measures with {self.method}")
        self.steps, self.estimate = int(state["steps"]), load_estimate(state["estimate"])
        self.hessian_every = int(state["hessian_every"])
        self.ema.load_state_dict(state["ema"])
        self.preconditioned.load_state_dict(state)
        if "schedule" in state:
            self.schedule.load_state_dict(state["schedule"])
        elif isinstance(self.schedule.every, int):  # a state saved before schedules were kept
            self.schedule.steps = self.steps
            self.schedule.next = self.steps % self.schedule.every == 0
        self._since_examples, self._since_steps = state["since_examples"], state["since_steps"]
        self._warned = set(state["warned"])
        for source in self.sources:
            source.load_state_dict(state)

    def __enter__(self) -> NoiseScaleMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    @contextmanager
    def _own_pass(self) -> Iterator[None]:
        """Inside: a pass of the monitor's own, which no hook captures and no count sees."""
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    @property
    def capturing(self) -> bool:
        """This step is measured and no pass of the monitor's own (Hessian) is running: what
        the sources' hooks ask before they capture (`gnsweep.measure.common.Gate`)."""
        return self.measuring and not self._busy

    def _count_examples(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._busy or not torch.is_grad_enabled():
            return
        if self.auto.timing is not None and self._started is None and self.measuring:
            self._started = now(self.params[0].device)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else \
            first_tensor(args) if args else None
        if first is None:
            first = first_tensor(tuple(kwargs.values()))
        batch = int(first.shape[0]) if first is not None and first.dim() > 0 else 0
        self._examples += batch
        per_example = self._per_example
        if per_example is not None:
            per_example.saw_forward(args, kwargs, batch)

    def _measure(self, batch: Batch | None, *, plain: bool, hessian: bool) -> None:
        """Fold in this step's norms, unscaled (`step(loss_scale=...)`). The Hessian passes
        run the loss unscaled, in fp32."""
        hess = self._hessian(batch) if hessian else None
        if plain and self.method == Method.PER_EXAMPLE and self._examples == 1:
            # One sample has no spread: tr(Sigma) is undefined at this batch size (eq. A.2
            # needs two batch sizes). Skipped, so the estimate stays None (NaN), never wrong.
            # (method microbatch says so as an error: its caller cut the batch.)
            self.warn_once("one", "noise scale: a batch of one sample has no spread to measure; "
                           "B_simple is not measured at this batch size")
            plain = False
        if plain and self.method == Method.PER_EXAMPLE and \
                any(m.training for m in self._batch_stats):
            # A layer with batch statistics switched to train mode after the monitor was built.
            reason = per_example_refusal(self.module)
            assert reason is not None
            raise ValueError(reason)
        increments = self.in_use.find(Increments)
        if plain and increments is not None and self.method == Method.MICROBATCH \
                and not self._whole_batches:
            say_ghost_batches(self._batch_stats, len(increments.counts))
        # Squared norms of scaled gradients (fp16): captured during backward they carry
        # loss_scale^2; |G_big|^2 read from .grad now carries it unless .grad was unscaled.
        small_scale = self._loss_scale ** 2
        norms = StepNorms(self._examples, plain, small_scale,
                          1.0 if self._grads_unscaled else small_scale,
                          required=self.requested == Method.MICROBATCH, hess=hess,
                          grads_unscaled=self._grads_unscaled, why=lambda: self.why_microbatches,
                          hint=self.accumulation_hint)
        read, preconditions = read_all(self.sources, norms, self.warn_once)
        self._fold(read.parts, read.hess,
                   self.preconditioned.pairs(read.parts, preconditions, read.preconditioned, plain,
                                             small_scale))

    def _hessian(self, batch: Batch | None) -> NormPair | None:
        """H-norms for B_noise; a model whose loss has no double backward (an op without
        one), or whose Hessian pass does not fit in device memory, is said once and B_noise is
        no longer measured: the run trains on."""
        if batch is None:
            self.warn_once("hbatch", "noise scale: B_noise needs the step's batch: call "
                           "monitor.step(batch=(inputs, targets))")
            return None
        started = now(self.params[0].device) if self.auto.timing is not None else 0.0
        try:
            with self._own_pass():
                pair, refused = hessian_or_refusal(self.module, self.loss_fn, batch,
                                                   self.hessian_microbatches,
                                                   task_loss=self.task_loss, params=self.params)
        finally:
            if self.auto.timing is not None:  # not part of either method's cost
                self._hessian_seconds += now(self.params[0].device) - started
        if refused is not None:
            self.warn_once(*refused)
            self.hessian_every = 0
        elif pair is None:
            self.warn_once("hsmall", "noise scale: batch too small to split for B_noise "
                           f"(needs >= {2 * self.hessian_microbatches} examples)")
        return pair

    def _fold(self, parts: list[NormPair], hess: NormPair | None,
              preconditioned: list[NormPair] | None = None) -> None:
        finite = all(map(math.isfinite, (x for p in parts for x in p)))
        valid = [p for p in parts if 0 < p.b_small < p.b_big] if finite else []
        if not finite:
            # A NaN or inf loss makes every norm non-finite: say that, not a batch-size cause.
            self.warn_once("nonfinite", "noise scale: non-finite gradient norms (a NaN or inf "
                           "loss or gradient, or an fp16 overflow); that measurement is skipped")
        elif len(valid) < len(parts):
            self.warn_once("skip", "noise scale: a measurement had one batch size only; "
                           "skipped (a batch of one example?)")
        elif parts:
            blocks: list[tuple[float, float, float, float]] = list(parts)
            # The share of training this measurement stands for, in this step's worth (1
            # when every step is measured): the window averages over training progress.
            step = self._step_examples
            weight = self._since_examples / step if 0 < step < self._since_examples else 1.0
            self.estimate = self.ema.update_parts(blocks, examples=self._since_examples,
                                                  steps=self._since_steps, weight=weight)
            self._since_examples, self._since_steps = 0, 0
        if hess is not None and all(map(math.isfinite, hess)):
            estimate = self.ema.update_hessian(*hess)
            if estimate is not None:
                self.estimate = estimate
        self._fold_preconditioned(preconditioned)

    def _fold_preconditioned(self, pairs: list[NormPair] | None) -> None:
        """B_simple_P's pairs of this measurement into its EMAs, and onto the estimate."""
        self.estimate = self.preconditioned.fold(pairs, self.estimate, self._step_examples)
