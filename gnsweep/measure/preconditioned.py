"""B_simple_P (`b_simple_precond`) beside B_simple: the noise scale in the optimizer's
diagonal preconditioner P (`gnsweep.measure.preconditioner`), a part `NoiseScaleMonitor`
holds (`monitor.preconditioned`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch

from gnsweep.measure.common import say_once
from gnsweep.measure.ddp import DdpHook, RankGrads
from gnsweep.measure.microbatch import Increments
from gnsweep.measure.preconditioner import (
    IDENTITY,
    kind,
    preconditioner,
    preconditioner_parts,
)
from gnsweep.measure.source import InUse, unscale
from gnsweep.noise import (
    Method,
    NoiseEstimate,
    NoiseScaleEma,
    NormPair,
    undetermined,
    with_preconditioned,
)


class PreconditionedEstimate:
    """B_simple_P's part of the monitor: which pairs are read in the P-norm, and their own
    EMAs (`ema`) on B_simple's clock (`since`: the examples and steps since its last
    measurement). It reads what the monitor measures with (`in_use`) and is told the rest."""

    def __init__(self, window: dict[str, float], in_use: InUse, params: list[Any],
                 warn: Callable[[str, str], None], hint: Callable[[], str]) -> None:
        """B_simple_P's EMAs on B_simple's window (`window`: `ema_window`'s), no optimizer yet.
        `params`: the measured parameters; `warn`: says a line once by key; `hint`: how the
        driving loop gives a step in micro-batches (`NoiseScaleMonitor.accumulation_hint`)."""
        # The same estimator as B_simple's, in the optimizer's preconditioner P.
        self.ema = NoiseScaleEma(ema_steps=window["ema_steps"],
                                 ema_fraction=window["ema_fraction"],
                                 ema_examples=window["ema_examples"])
        self.in_use, self.params, self.warn, self.hint = in_use, params, warn, hint
        self.optimizer: torch.optim.Optimizer | None = None
        self.kind: str | None = None
        """`preconditioner.kind` of the optimizer (None: not measured)."""
        self.increments: Increments | None = None
        """The monitor's own micro-batch increments for the P-norm pair, where needed."""
        self.since = (0.0, 0.0)
        """The examples and steps since B_simple_P's last measurement."""

    def precondition(self, optimizer: torch.optim.Optimizer,
                     candidates: dict[str, tuple[Any, Any]]) -> None:
        """Measure B_simple_P (`b_simple_precond`) in `optimizer`'s diagonal preconditioner
        (`gnsweep.measure.preconditioner`) beside B_simple. SGD: P = I, the same pairs as
        B_simple. Adam-like: a source that weighs by P in its own hooks gives the P-norm pair
        (`preconditions`, P read by `preconditioner`): per-example norms where every measured
        parameter's layer has P-norms (`gnsweep.measure.per_example.preconditioned_norms`; b_small =
        1, no split), and under DDP each worker's gradient weighted by P in the communication hook
        (b_small = the worker's batch), or in the parameter hooks under a DDP the monitor
        cannot hook (the Trainers', accelerate). Elsewhere (parameters tied across layers,
        nn.MultiheadAttention measured whole, parameters left to micro-batches) the pair comes
        from micro-batches (eq. A.2 with b_small = B / k): the method's own where it splits,
        else the loop splits measured steps (`wants_microbatches`) and the pair is read from
        the increments of `.grad`. Not measured (NaN, said once) under FSDP, or for an
        optimizer without a known diagonal P. `candidates`: `AutoChoice.candidates`, whose
        per-example sources weigh too (`auto` may keep them)."""
        self.optimizer = optimizer
        self.kind = kind(optimizer)
        method = self.in_use.method
        if self.kind is None:
            self.warn("precond", f"noise scale: {type(optimizer).__name__} has no known "
                      "diagonal preconditioner; b_simple_precond is not measured (NaN)")
        elif self.kind != IDENTITY and method == Method.DDP:
            for source in self.in_use.sources:
                if source.preconditions:
                    cast(DdpHook | RankGrads, source).preconditioner = self.by_parameter
        elif self.kind != IDENTITY and method == Method.FSDP:
            self.warn("precond", "noise scale: b_simple_precond is not measured under "
                      "FSDP yet (NaN); micro-batches or DDP measure it")
            self.kind = None
        elif self.kind != IDENTITY:
            # Per-example sources with P-norms weigh in their own hooks (those `auto` may keep
            # too); the increments measure it wherever the step is split instead.
            for source in [*self.in_use.sources,
                           *(s for pair in candidates.values() for s in pair)]:
                if source is not None and source.preconditions:
                    cast(Any, source).preconditioner = self.by_parameter
            self.increments = Increments(self.params)

    def by_parameter(self) -> dict[int, torch.Tensor] | None:
        """P as the optimizer holds it now, one flat fp32 tensor per measured parameter (by
        id); None before an adaptive optimizer's first update."""
        assert self.optimizer is not None
        parts = preconditioner_parts(self.optimizer, self.params)
        if parts is None:
            return None
        return {id(p): part.reshape(-1) for p, part in zip(self.params, parts, strict=True)}

    @property
    def in_hooks(self) -> bool:
        """A source in use gives the P-norm pair from its own hooks (`preconditions`)."""
        return any(source.preconditions for source in self.in_use.sources)

    @property
    def wants_microbatches(self) -> bool:
        """The preconditioned pair needs this step in micro-batches (`accumulate()` after
        each): an adaptive optimizer, a method that does not split anyway, and no source
        that weighs by P itself."""
        return self.increments is not None and self.in_use.method != Method.MICROBATCH and \
            not self.in_hooks

    def source(self) -> Increments | None:
        """The micro-batch increments the P-norm pair is read from: the method's own when they
        cover every measured parameter (method microbatch), else the monitor's."""
        if self.increments is None or self.in_hooks:
            return None
        own = self.in_use.find(Increments)
        if self.in_use.method == Method.MICROBATCH and own is not None:
            return own
        return self.increments

    def read_preconditioner(self) -> None:
        """On a measured step's first micro-batch: P as the optimizer holds it before this
        step's update, for the whole step; the P-norm source accumulates with the others."""
        source = self.source()
        if source is not None and not source.counts:
            assert self.optimizer is not None
            source.preconditioner = preconditioner(self.optimizer, self.params)

    def advance(self, step_examples: float) -> None:
        """A step of `step_examples` examples went by (measured or not)."""
        self.since = (self.since[0] + step_examples, self.since[1] + 1)

    def reset(self) -> None:
        """Forget this step's increments (after every step)."""
        if self.increments is not None:
            self.increments.reset()

    def pairs(self, parts: list[NormPair], in_hooks: bool,
              preconditioned: list[NormPair] | None, plain: bool, small_scale: float
              ) -> list[NormPair] | None:
        """This step's pairs for B_simple_P: a weighing source's own (DDP), B_simple's for
        P = I, else the P-norm pair of the micro-batch increments (`small_scale`: the squared
        loss scale they carry)."""
        if in_hooks:
            return self.ddp_pairs(parts, preconditioned)
        if self.kind == IDENTITY:
            return parts  # P = I: the very pairs of B_simple
        if not plain:
            return None
        # Whether or not B_simple's own pair was complete this step.
        source = self.source()
        pair = source.preconditioned() if source is not None else None
        if pair is None and source is not None and len(source.counts) < 2:
            self.warn("precond1", "noise scale: b_simple_precond needs >= 2 micro-batches a "
                      f"measured step ({self.hint()}); NaN without")
        return [unscale(pair, small_scale, small_scale)] if pair is not None else None

    def ddp_pairs(self, parts: list[NormPair], preconditioned: list[NormPair] | None
                  ) -> list[NormPair] | None:
        """B_simple_P's pairs of a DDP measurement: B_simple's own for SGD (P = I), the hooks'
        P-norm pairs for an adaptive optimizer, none where it is not measured."""
        if self.kind == IDENTITY:
            return parts
        return preconditioned if self.kind is not None else None

    def fold(self, pairs: list[NormPair] | None, estimate: NoiseEstimate | None,
             step_examples: float) -> NoiseEstimate | None:
        """Fold the P-norm pairs into B_simple_P's EMAs, on the clock of B_simple's (the
        examples and steps since B_simple_P's last measurement), each weighing the steps it
        stands for as B_simple's do (`noise.every`, `step_examples`: this step's examples);
        `estimate` (B_simple's) with B_simple_P put on it, or as it is before B_simple_P's
        first measurement."""
        examples, steps = self.since
        ok = bool(pairs) and all(math.isfinite(x) and (i < 2 or x > 0)
                                 for p in pairs or [] for i, x in enumerate(p))
        if ok and pairs is not None and all(p.b_small < p.b_big for p in pairs):
            step = step_examples
            weight = examples / step if 0 < step < examples else 1.0
            self.ema.update_parts(list(pairs), examples=examples, steps=steps, weight=weight)
            self.since = (0.0, 0.0)
        if self.ema.seen_steps == 0:
            return estimate
        # B_simple_P stands on its own pairs: shown even where B_simple's were not complete.
        base = estimate if estimate is not None else NoiseEstimate(*([math.nan] * 9))
        own = self.ema.estimate()
        why = undetermined(own.g2, own.trace_sigma, own.b_simple_se)
        if why is not None and why[0] == "negative":  # NaN (`with_preconditioned`), said once
            # a process and a launch (a monitor per run would repeat it); a single
            # measurement, NaN at the first measured step only, goes unsaid
            said = why[1].replace("|G|^2", "G^T P G").replace("tr(Sigma)", "tr(P Sigma)")
            say_once("precond negative", f"noise scale: b_simple_precond is NaN {said}",
                     per_launch=True)
        return with_preconditioned(base, own)

    def state_dict(self) -> dict[str, Any]:
        """The monitor's keys of B_simple_P: its EMAs and the clock since its last
        measurement."""
        return {"ema_precond": self.ema.state_dict(), "precond_since": list(self.since)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "ema_precond" in state:  # absent from a monitor saved before B_simple_P
            self.ema.load_state_dict(state["ema_precond"])
            examples, steps = state["precond_since"]
            self.since = (examples, steps)
