"""B_simple_P (`b_simple_precond`) beside B_simple: the noise scale in the optimizer's
diagonal preconditioner P (`gnsweep.measure.preconditioner`), a part of `NoiseScaleMonitor`."""

from __future__ import annotations

import math
from typing import Any, cast

import torch

from gnsweep.measure.common import say_once
from gnsweep.measure.ddp import DdpHook, RankGrads
from gnsweep.measure.microbatch import Increments
from gnsweep.measure.preconditioner import IDENTITY, kind, preconditioner, preconditioner_parts
from gnsweep.measure.source import Sources, unscale
from gnsweep.noise import (
    Method,
    NoiseEstimate,
    NoiseScaleEma,
    NormPair,
    undetermined,
    with_precond,
)


class Preconditioned(Sources):
    """B_simple_P's part of `NoiseScaleMonitor` (these are its attributes and methods): which
    pairs are read in the P-norm, and their own EMAs (`ema_precond`) on B_simple's clock."""

    method: str
    params: list[Any]
    accumulation_hint: str
    estimate: NoiseEstimate | None
    ema_precond: NoiseScaleEma
    optimizer: torch.optim.Optimizer | None
    _precond_kind: str | None
    _precond_increments: Increments | None
    _precond_since: tuple[float, float]
    _step_examples: int

    def _init_precond(self, window: dict[str, float]) -> None:
        """B_simple_P's EMAs on B_simple's window (`window`: `ema_window`'s), no optimizer yet."""
        # The same estimator as B_simple's, in the optimizer's preconditioner P.
        self.ema_precond = NoiseScaleEma(ema_steps=window["ema_steps"],
                                         ema_fraction=window["ema_fraction"],
                                         ema_examples=window["ema_examples"])
        self.optimizer = None
        self._precond_kind = None
        self._precond_increments = None
        self._precond_since = (0.0, 0.0)  # examples and steps since its last measurement

    def precondition(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure B_simple_P (`b_simple_precond`) in `optimizer`'s diagonal preconditioner
        (`gnsweep.measure.preconditioner`) beside B_simple. SGD: P = I, the same pairs as B_simple.
        Adam-like: a source that weighs by P in its own hooks gives the P-norm pair (`weighs`,
        P read by `weigh`): per-example norms where every measured parameter's layer has
        P-norms (`gnsweep.measure.per_example.preconditioned_norms`; b_small = 1, no split), and
        under DDP each worker's gradient weighted by P in the communication hook (b_small = the
        worker's batch), or in the parameter hooks under a DDP the monitor cannot hook (the
        Trainers', accelerate). Elsewhere (parameters tied across layers, nn.MultiheadAttention
        measured whole, parameters left to micro-batches) the pair comes from micro-batches (eq. A.2
        with b_small = B / k): the method's own where it splits, else the loop splits
        measured steps (`wants_microbatches`) and the pair is read from the increments of
        `.grad`. Not measured (NaN, said once) under FSDP, or for an optimizer without a
        known diagonal P."""
        self.optimizer = optimizer
        self._precond_kind = kind(optimizer)
        if self._precond_kind is None:
            self.warn_once("precond", f"noise scale: {type(optimizer).__name__} has no known "
                           "diagonal preconditioner; b_simple_precond is not measured (NaN)")
        elif self._precond_kind != IDENTITY and self.method == Method.DDP:
            for source in self.sources:
                if source.weighs:
                    cast(DdpHook | RankGrads, source).weigh = self._weights_by_parameter
        elif self._precond_kind != IDENTITY and self.method == Method.FSDP:
            self.warn_once("precond", "noise scale: b_simple_precond is not measured under "
                           "FSDP yet (NaN); micro-batches or DDP measure it")
            self._precond_kind = None
        elif self._precond_kind != IDENTITY:
            # Per-example sources with P-norms weigh in their own hooks (those `auto` may keep
            # too); the increments measure it wherever the step is split instead.
            candidates = getattr(self, "_candidates", {})
            for source in [*self.sources, *(s for pair in candidates.values() for s in pair)]:
                if source is not None and source.weighs:
                    cast(Any, source).weigh = self._weights_by_parameter
            self._precond_increments = Increments(self.params)

    def _weights_by_parameter(self) -> dict[int, torch.Tensor] | None:
        """P as the optimizer holds it now, one flat fp32 tensor per measured parameter (by
        id); None before an adaptive optimizer's first update."""
        assert self.optimizer is not None
        parts = preconditioner_parts(self.optimizer, self.params)
        if parts is None:
            return None
        return {id(p): part.reshape(-1) for p, part in zip(self.params, parts, strict=True)}

    @property
    def _weighs_itself(self) -> bool:
        """A source in use gives the P-norm pair from its own hooks (`weighs`)."""
        return any(source.weighs for source in self.sources)

    @property
    def wants_microbatches(self) -> bool:
        """The preconditioned pair needs this step in micro-batches (`accumulate()` after
        each): an adaptive optimizer, a method that does not split anyway, and no source
        that weighs by P itself."""
        return self._precond_increments is not None and self.method != Method.MICROBATCH and \
            not self._weighs_itself

    def _precond_source(self) -> Increments | None:
        """The micro-batch increments the P-norm pair is read from: the method's own when they
        cover every measured parameter (method microbatch), else the monitor's."""
        if self._precond_increments is None or self._weighs_itself:
            return None
        own = self._source(Increments)
        if self.method == Method.MICROBATCH and own is not None:
            return own
        return self._precond_increments

    def _weigh_step(self) -> None:
        """On a measured step's first micro-batch: P as the optimizer holds it before this
        step's update, for the whole step; the P-norm source accumulates with the others."""
        source = self._precond_source()
        if source is not None and not source.counts:
            assert self.optimizer is not None
            source.weight = preconditioner(self.optimizer, self.params)

    def _precond_pairs(self, parts: list[NormPair], weighs: bool,
                       weighted: list[NormPair] | None, plain: bool, small_scale: float
                       ) -> list[NormPair] | None:
        """This step's pairs for B_simple_P: a weighing source's own (DDP), B_simple's for
        P = I, else the P-norm pair of the micro-batch increments (`small_scale`: the squared
        loss scale they carry)."""
        if weighs:
            return self._ddp_precond(parts, weighted)
        if self._precond_kind == IDENTITY:
            return parts  # P = I: the very pairs of B_simple
        if not plain:
            return None
        # Whether or not B_simple's own pair was complete this step.
        source = self._precond_source()
        pair = source.weighted() if source is not None else None
        if pair is None and source is not None and len(source.counts) < 2:
            self.warn_once("precond1", "noise scale: b_simple_precond needs >= 2 micro-batches a "
                           f"measured step ({self.accumulation_hint}); NaN without")
        return [unscale(pair, small_scale, small_scale)] if pair is not None else None

    def _ddp_precond(self, parts: list[NormPair], weighted: list[NormPair] | None
                     ) -> list[NormPair] | None:
        """B_simple_P's pairs of a DDP measurement: B_simple's own for SGD (P = I), the hooks'
        P-norm pairs for an adaptive optimizer, none where it is not measured."""
        if self._precond_kind == IDENTITY:
            return parts
        return weighted if self._precond_kind is not None else None

    def _fold_precond(self, precond: list[NormPair] | None) -> None:
        """Fold the P-norm pairs into B_simple_P's EMAs, on the clock of B_simple's (the
        examples and steps since B_simple_P's last measurement), each weighing the steps it
        stands for as B_simple's do (`noise.every`), and put them on the estimate."""
        examples, steps = self._precond_since
        ok = bool(precond) and all(math.isfinite(x) and (i < 2 or x > 0)
                                   for p in precond or [] for i, x in enumerate(p))
        if ok and precond is not None and all(p.b_small < p.b_big for p in precond):
            step = self._step_examples
            weight = examples / step if 0 < step < examples else 1.0
            self.ema_precond.update_parts(list(precond), examples=examples, steps=steps,
                                          weight=weight)
            self._precond_since = (0.0, 0.0)
        if self.ema_precond.seen_steps > 0:
            # B_simple_P stands on its own pairs: shown even where B_simple's were not complete.
            base = self.estimate if self.estimate is not None else NoiseEstimate(
                *([math.nan] * 9))
            estimate = self.ema_precond.estimate()
            self.estimate = with_precond(base, estimate)
            why = undetermined(estimate.g2, estimate.trace_sigma, estimate.b_simple_se)
            if why is not None and why[0] == "negative":  # NaN (`with_precond`), said once a
                # process and a launch (a monitor per run would repeat it); a single
                # measurement, NaN at the first measured step only, goes unsaid
                said = why[1].replace("|G|^2", "G^T P G").replace("tr(Sigma)", "tr(P Sigma)")
                say_once("precond negative", f"noise scale: b_simple_precond is NaN {said}",
                         per_launch=True)
