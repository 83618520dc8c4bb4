"""Pure estimators of the gradient noise scale (McCandlish et al. 2018, appendix A). No I/O.

With `B` examples per batch, `E|G_B|^2 = |G|^2 + tr(Sigma)/B` (eq. A.1). Two batch sizes measured
at the same parameters give unbiased estimates of `|G|^2` and `tr(Sigma)` (eq. A.2); the same
formulas with the H-norm `|v|_H^2 = v^T H v` give `G^T H G` and `tr(H Sigma)` (eq. 2.8).

B_simple (eq. 2.9) and B_noise (eq. 2.8) are ratios of two separately smoothed estimates: never
an average of per-step ratios and never clamped per step (single estimates are noisy and can be
negative; the ratio of two noisy unbiased numbers is biased, the ratio of their averages is not).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any, NamedTuple


class Method(StrEnum):
    """How the pair (|G_small|^2, |G_big|^2) of eq. A.2 is measured: the one list of method names
    that the configuration (`noise.method`) and the monitor (`NoiseScaleMonitor(method=)`)
    share (docs/noise.md says when each applies)."""

    AUTO = "auto"
    """The right one of the others for the model and the launch."""
    PER_EXAMPLE = "per_example"
    """Per-example gradient norms from module hooks (b_small = 1)."""
    MICROBATCH = "microbatch"
    """Micro-batches of the batch, accumulated (b_small = B / k)."""
    DDP = "ddp"
    """Each DDP worker's gradient before the all-reduce (b_small = the worker's batch)."""
    FSDP = "fsdp"
    """A model sharded by `fully_shard`: each rank's micro-steps against the global gradient."""
    NORM_LAYERS = "norm_layers"
    """Per-example norms of the LayerNorm / RMSNorm parameters only (Gray et al. 2024)."""
    NONE = "none"
    """Nothing measured: the baseline of what measuring costs."""


METHOD_NAMES = tuple(str(m) for m in Method)
"""Every method's name, as `noise.method` and `NoiseScaleMonitor(method=)` take it."""
PAIR_METHODS = (Method.PER_EXAMPLE, Method.MICROBATCH, Method.DDP, Method.FSDP)
"""The methods that measure the whole gradient's pair (`norm_layers` measures a block of it)."""



def unbiased_g2_and_trace(sq_small: float, sq_big: float, b_small: float, b_big: float
                          ) -> tuple[float, float]:
    """Unbiased `|G|^2` and `tr(Sigma)` from two squared batch-gradient norms (eq. A.2).

    `sq_small` is `|G_small|^2` averaged over the small batches (each of `b_small` examples) and
    `sq_big` is `|G_big|^2` of a batch of `b_big` examples, both at the same parameters. From
    `E|G_B|^2 = |G|^2 + tr(Sigma)/B` (eq. A.1):

        G2 = (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)
        S  = (|G_small|^2 - |G_big|^2) / (1/b_small - 1/b_big)

    With H-norms `|v|_H^2` in place of `|v|^2` the same formulas give `G^T H G` and
    `tr(H Sigma)` (eq. 2.8). Single estimates are noisy and may be negative: never clamp them,
    smooth them (see `NoiseScaleEma`).
    """
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    g2 = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


class NormPair(NamedTuple):
    """One measurement of eq. A.2: squared gradient norms at two batch sizes."""

    sq_small: float
    """|G_small|^2 (mean over the small batches); |G_small|_H^2 for B_noise."""
    sq_big: float
    """|G_big|^2; |G_big|_H^2 for B_noise."""
    b_small: float
    b_big: float


def combine_parts(parts: Iterable[tuple[float, float, float, float]]
                  ) -> tuple[float, float]:
    """Sum of the unbiased (G2, S) of parameter blocks, each measured with its own batch pair.

    `|G|^2` and `tr(Sigma)` are sums over parameter blocks, so blocks measured with different
    `(b_small, b_big)` (per-example norms for most layers, micro-batches for the rest) add up to
    unbiased totals. Each part is `(sq_small, sq_big, b_small, b_big)` (eq. A.2 per block).
    """
    g2 = trace = 0.0
    for sq_small, sq_big, b_small, b_big in parts:
        part_g2, part_trace = unbiased_g2_and_trace(sq_small, sq_big, b_small, b_big)
        g2, trace = g2 + part_g2, trace + part_trace
    return g2, trace


def equivalent_norms(g2: float, trace: float, b_small: float, b_big: float
                     ) -> tuple[float, float]:
    """The pair `(|G_small|^2, |G_big|^2)` that eq. A.2 maps back to `(g2, trace)` (eq. A.1)."""
    return g2 + trace / b_small, g2 + trace / b_big


DEFAULT_EMA_FRACTION = 0.2
"""The window of B_simple's EMAs, as a fraction of the examples seen so far, that the sweeps,
the monitor and the framework callbacks use unless told otherwise (docs/noise.md, "Windows
that follow training")."""


def ema_window(ema_fraction: float | None, ema_steps: float, ema_examples: float | None
               ) -> dict[str, float]:
    """`NoiseScaleEma`'s window from a caller's choices: `ema_fraction` when given; else a
    fixed window when `ema_steps` > 0 or `ema_examples` is given; else the lag-free default,
    `DEFAULT_EMA_FRACTION` of the examples seen."""
    if ema_fraction is None:
        fixed = ema_steps > 0 or ema_examples is not None
        ema_fraction = 0.0 if fixed else DEFAULT_EMA_FRACTION
    return {"ema_fraction": ema_fraction, "ema_steps": ema_steps,
            "ema_examples": 2048.0 if ema_examples is None else ema_examples}


AUTO_ADDED_SE = 0.04
"""`noise.every=auto`: a step is measured when without it B_simple's relative standard error
would exceed that of a measurement on every step by more than this, in quadrature
(`NoiseScaleEma.due`): the estimate from a subset stays within about 2 x 4% of the one from
every step."""
AUTO_MIN_MEASUREMENTS = 8.0
"""`noise.every=auto`: every step is measured while the window holds fewer measurements' worth
than this (the standard error of fewer is itself too rough to act on)."""
AUTO_MAX_EVERY = 16
"""`noise.every=auto`: at least one step in this many is measured, however precise the window
(the spread the standard error is read from stays current)."""


POOLED_MAX_RELATIVE_SE = 0.5
"""`noise.pooled`: the allowance stops where a run's B_simple would have a relative standard
error above this (a negative value then lies within two standard errors: the run's own reading
would lose its sign); a run already that rough measures as a run alone does."""
POOLED_ERROR = 1.1
"""`noise.pooled`: a run whose B_simple is one of n whose median the sweep reads may measure
fewer steps, as long as the median's measurement error stays within this times that of one
run measured on every step (`pooled_variance_growth`)."""


def pooled_variance_growth(pooled: int) -> float:
    """How many times the variance of B_simple measured on every step a run's may reach under
    `noise.every=auto` when it is one of `pooled` values whose median the sweep reads: the
    median of n values, each of variance v, has about pi v / (2 n) (the median's efficiency
    2/pi), so each may have up to POOLED_ERROR^2 2n/pi times the variance of one run measured
    on every step before the median's error exceeds POOLED_ERROR times that run's; 1 for the
    run alone."""
    return max(1.0, POOLED_ERROR ** 2 * 2 * pooled / math.pi) if pooled >= 2 else 1.0


EVERY_AUTO = "auto"
"""`noise.every`'s adaptive choice: the steps B_simple's precision needs (`MeasureSchedule`)."""


class MeasureSchedule:
    """Which steps are measured: every `every`-th (an int >= 1), or `"auto"`: the steps needed
    to keep B_simple's relative standard error within `AUTO_ADDED_SE` of a measurement on every
    step (in quadrature; `NoiseScaleEma.due`),
    at least one in `AUTO_MAX_EVERY`; where the run's B_simple is one of `pooled` whose median
    a sweep reads, within `pooled_variance_growth(pooled)` times the variance of a measurement
    on every step instead, when that allows more. The rule reads only measured numbers, never
    a clock, so a run trained twice, or resumed from its state, measures the same steps."""

    def __init__(self, every: int | str = 1, pooled: int = 1) -> None:
        if every != EVERY_AUTO and not (isinstance(every, int) and every >= 1):
            raise ValueError(f"every={every!r}: need an integer >= 1 or 'auto'")
        if pooled < 1:
            raise ValueError(f"pooled={pooled!r}: need an integer >= 1")
        self.every = every
        self.growth = pooled_variance_growth(pooled)
        self.next = True
        """Whether the next step is measured."""
        self.steps = self.measured = 0
        """Steps seen and steps measured."""
        self._since = 0

    @property
    def share(self) -> float:
        """Measured steps over steps (NaN before the first)."""
        return self.measured / self.steps if self.steps else math.nan

    def advance(self, measured: bool, ema: NoiseScaleEma, examples_since: float,
                step_examples: float) -> None:
        """After a step (`measured`: it was): decide the next. `examples_since`: the examples
        since the last measurement, this step's included; `step_examples`: this step's."""
        self.steps += 1
        self.measured += int(measured)
        self._since = 0 if measured else self._since + 1
        if isinstance(self.every, int):
            self.next = self.steps % self.every == 0
            return
        gap = self._since + 1  # the next measurement would stand for this many steps
        self.next = gap >= AUTO_MAX_EVERY or ema.due(
            examples_since + step_examples, float(gap), step_examples, self.growth)

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next, "steps": self.steps, "measured": self.measured,
                "since": self._since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next, self.steps = bool(state["next"]), int(state["steps"])
        self.measured, self._since = int(state["measured"]), int(state["since"])


DRIFT_MAX_RELATIVE_ERROR = 0.25
"""The drift flag needs both ends of the window known to 25% (a 2x change is then > 2.8 sigma)."""
_PRUNE_FROM = 256
"""`NoiseScaleEma` drops the drift history before the window's start once that many entries
(and at least half the history) lie there: amortised O(1) a measurement."""


class Ema:
    """Bias-corrected exponential moving average; the decay may change per update.

    Kept as a weighted sum and a sum of weights, so decay 1 is the plain mean (pooling estimates
    taken at fixed parameters) and any decay < 1 is the usual bias-corrected EMA.
    """

    def __init__(self) -> None:
        self._sum = 0.0
        self._weight = 0.0

    def update(self, value: float, decay: float, weight: float = 1.0) -> None:
        """Decay the past by `decay`, then add `value` with `weight` (the share of training it
        stands for: a measurement that stands for k steps weighs k)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay {decay} must be in [0, 1]")
        self._sum = decay * self._sum + (value if weight == 1.0 else weight * value)
        self._weight = decay * self._weight + weight

    @property
    def count(self) -> float:
        """Effective number of values averaged (0 before the first update)."""
        return self._weight

    @property
    def value(self) -> float:
        return self._sum / self._weight if self._weight > 0 else math.nan

    def state_dict(self) -> dict[str, float]:
        """The weighted sum and the sum of weights (exact floats: a reload continues alike)."""
        return {"sum": self._sum, "weight": self._weight}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._sum, self._weight = float(state["sum"]), float(state["weight"])


def ema_decay(examples: float, *, steps: float = 0.0, examples_scale: float = 0.0,
              steps_elapsed: float = 1.0) -> float:
    """Per-update decay for a time constant in steps (`steps` > 0) or in examples.

    With a time constant of N examples, an update that saw `examples` examples decays the past by
    `exp(-examples / N)`, so every batch size averages over the same amount of data; with a time
    constant of N steps an update `steps_elapsed` steps after the last decays it by
    `exp(-steps_elapsed / N)`. An infinite time constant gives decay 1: the plain mean.
    """
    if steps > 0:
        return math.exp(-steps_elapsed / steps)
    if examples_scale > 0:
        return math.exp(-examples / examples_scale)
    raise ValueError("give a time constant in steps or in examples")


@dataclass(frozen=True)
class NoiseEstimate:
    """One smoothed estimate. `g2`, `trace_sigma` are EMAs; `b_simple` is their ratio."""

    b_small: float
    b_big: float
    sq_norm_small: float
    """|G_small|^2 this update (mean over the small batches)."""
    sq_norm_big: float
    """|G_big|^2 this update."""
    g2_step: float
    """This update's unbiased |G|^2 (eq. A.2), unsmoothed."""
    trace_sigma_step: float
    """This update's unbiased tr(Sigma) (eq. A.2), unsmoothed."""
    g2: float
    """EMA of |G|^2."""
    trace_sigma: float
    """EMA of tr(Sigma)."""
    b_simple: float
    """EMA(tr Sigma) / EMA(|G|^2): the simple noise scale (eq. 2.9)."""
    g_h_g: float = math.nan
    """EMA of G^T H G (eq. 2.8), when measured."""
    trace_h_sigma: float = math.nan
    """EMA of tr(H Sigma) (eq. 2.8), when measured."""
    b_noise: float = math.nan
    """EMA(tr(H Sigma)) / EMA(G^T H G): the true noise scale (eq. 2.8), when measured."""
    drift: float = math.nan
    """|G|^2 now over |G|^2 one window ago (`NoiseScaleEma.drift`); NaN until resolvable."""
    b_simple_se: float = math.nan
    """Standard error of `b_simple` from the spread of the single estimates of tr(Sigma) and
    |G|^2 in the window (`NoiseScaleEma.b_simple_se`); NaN until the window holds more than
    one measurement."""
    g2_precond: float = math.nan
    """EMA of G^T P G, P the optimizer's diagonal preconditioner (eq. A.2 in the P-norm)."""
    trace_sigma_precond: float = math.nan
    """EMA of tr(P Sigma)."""
    b_simple_precond: float = math.nan
    """EMA(tr(P Sigma)) / EMA(G^T P G): B_simple of the preconditioned step `P g` (eq. 2.9 in
    the coordinates where that step is a plain gradient step); B_simple itself under SGD."""


def estimate_state(estimate: NoiseEstimate | None) -> dict[str, float] | None:
    """An estimate as plain floats by field name (what `torch.load(weights_only=True)` reads)."""
    return None if estimate is None else asdict(estimate)


def load_estimate(state: dict[str, float] | None) -> NoiseEstimate | None:
    return None if state is None else NoiseEstimate(**state)


class NoiseScaleEma:
    """B_simple (and B_noise) as ratios of separately smoothed estimates (appendix A.1).

    The time window, one of:
    - `ema_fraction` > 0: a window that follows training, `ema_fraction` times the examples
      seen so far (per-update decay `exp(-examples / (ema_fraction * seen))`). A ratio of two
      EMAs is a |G|^2-weighted mean of B_simple over the window; |G|^2 falls 100-1000x over a
      run, so a window of fixed length that spans the run reports early training. A window
      that is a fixed fraction of the run so far averages the same share of training (the same
      span in log examples) at every point, whatever the run's length. Proposed default 0.2
      (docs/noise.md, "Windows that follow training").
    - else `ema_steps` > 0: a time constant in optimizer steps;
    - else `ema_examples`: a time constant in examples (`math.inf` pools all updates with equal
      weights: estimates at fixed parameters).

    `hessian_clock`: "examples" (default) decays the H-norm EMAs by the examples (or steps) seen
    since the last Hessian measurement, so B_noise averages over the same span of training as
    B_simple however rarely it is measured; "measurements" is the former rule (per Hessian
    measurement, the decay of one plain measurement: with B_noise every k steps its window is k
    times longer than B_simple's).

    `drift` is |G|^2 now over |G|^2 one window ago (each from an EMA a quarter of the window
    long): outside [1/2, 2], |G|^2 changed more than 2x inside the averaging window and the
    ratio leans to the window's large-|G|^2 end (`drifting`). Single-step |G|^2 estimates are
    noisy (relative spread about B_simple / B), so a quarter-window EMA of them can move 2x on
    noise alone: `drift` is NaN unless both ends are resolved, their standard errors (from the
    EMA's own spread and effective count) under `DRIFT_MAX_RELATIVE_ERROR` of their values.
    """

    def __init__(self, *, ema_steps: float = 0.0, ema_examples: float = 2048.0,
                 ema_fraction: float = 0.0, hessian_clock: str = "examples") -> None:
        if ema_steps < 0 or ema_examples <= 0 or ema_fraction < 0:
            raise ValueError("need ema_steps >= 0, ema_examples > 0 and ema_fraction >= 0")
        if hessian_clock not in ("examples", "measurements"):
            raise ValueError(f"hessian_clock={hessian_clock!r}: choose examples or measurements")
        self.ema_steps, self.ema_examples = ema_steps, ema_examples
        self.ema_fraction, self.hessian_clock = ema_fraction, hessian_clock
        self._g2, self._trace = Ema(), Ema()
        self._ghg, self._htrace = Ema(), Ema()
        self._last: tuple[float, ...] | None = None
        self._decay = 0.0
        self.seen_examples = 0.0
        self.seen_steps = 0.0
        # Examples and steps since the last Hessian measurement (its clock).
        self._h_examples = self._h_steps = 0.0
        # |G|^2 over a quarter window, the spread of single estimates relative to it (scale
        # free, so early large values do not leak into it), and the history (seen, value,
        # relative standard error) for the drift flag.
        self._g2_short, self._g2_spread = Ema(), Ema()
        # Second moments of the single estimates on the window's weights, and the sum of the
        # squared weights (the effective count of measurements): b_simple's standard error.
        self._g2_sq, self._trace_sq, self._cross = Ema(), Ema(), Ema()
        self._weight_sq = 0.0
        self._history: list[tuple[float, float, float]] = []
        self._past = 0  # where `drift` last found the window's start in `_history`

    @property
    def window(self) -> float:
        """The current time constant: in steps when `ema_steps` > 0, else in examples."""
        if self.ema_fraction > 0:
            return self.ema_fraction * max(self.seen_examples, 1.0)
        return self.ema_steps if self.ema_steps > 0 else self.ema_examples

    @property
    def drift(self) -> float:
        """|G|^2 (quarter-window EMA) now over its value one window ago; NaN until a window
        has passed, or when either is not positive (|G|^2 lost in the noise)."""
        history = self._history
        if not history:
            return math.nan
        window = self.window
        if not math.isfinite(window):
            return math.nan
        then = self._clock() - window
        if then < history[0][0]:
            return math.nan
        # The last entry at or before `then`. `then` never runs back (the window is fixed, or
        # a fraction < 1 of a clock that only grows), so the search steps on from the last
        # answer: O(1) a measurement.
        lo, n = self._past, len(history)
        if lo >= n or history[lo][0] > then:
            lo = 0
        while lo + 1 < n and history[lo + 1][0] <= then:
            lo += 1
        self._past = lo
        (_, past, past_err), (_, now, now_err) = history[lo], history[-1]
        if max(past_err, now_err) > DRIFT_MAX_RELATIVE_ERROR:
            return math.nan  # a 2x change would not stand out of the noise
        return now / past if past > 0 and now > 0 else math.nan

    def _clock(self) -> float:
        """The drift history's clock: steps with a window in steps, else examples."""
        return self.seen_steps if (self.ema_steps > 0 and self.ema_fraction <= 0) \
            else self.seen_examples

    @property
    def drifting(self) -> bool:
        """|G|^2 changed more than 2x inside the averaging window."""
        d = self.drift
        return math.isfinite(d) and not 0.5 <= d <= 2.0

    @property
    def measurements(self) -> float:
        """The effective number of measurements in the window, `(sum w)^2 / sum w^2` over the
        EMA's weights (equal weights: their count)."""
        weight = self._g2.count
        return weight * weight / self._weight_sq if self._weight_sq > 0 else 0.0

    @property
    def b_simple_se(self) -> float:
        """Standard error of B_simple = EMA(S) / EMA(G2) by the delta method for a ratio:
        `(se/B)^2 = [var(S)/S^2 + var(G2)/G2^2 - 2 cov(S, G2)/(S G2)] / (n - 1)`, the
        (co)variances those of the single estimates about the window's means on the EMA's
        weights and `n` their effective count (`measurements`). It assumes the measurements of
        a window independent and the quantity steady over it (a drift inflates the spread: the
        error is then on the large side). NaN with fewer than two measurements' worth."""
        n = self.measurements
        s, g = self._trace.value, self._g2.value
        if not n > 1.0 or not g > 0 or not math.isfinite(s):
            return math.nan
        var_s = max(self._trace_sq.value - s * s, 0.0)
        var_g = max(self._g2_sq.value - g * g, 0.0)
        cov = self._cross.value - s * g
        if s == 0:
            return math.sqrt(var_s / (n - 1)) / g
        relative = (var_s / (s * s) + var_g / (g * g) - 2.0 * cov / (s * g)) / (n - 1)
        return abs(s / g) * math.sqrt(max(relative, 0.0))

    def due(self, examples: float, weight: float, step_examples: float,
            growth: float = 1.0) -> bool:
        """Whether a measurement `examples` on from the last one, standing for `weight`
        measured steps' worth, is needed (`noise.every=auto`, `MeasureSchedule`): while the
        window holds fewer than `AUTO_MIN_MEASUREMENTS` measurements' worth, or when without
        it B_simple's standard error would exceed that of a measurement on every step by more
        than `AUTO_ADDED_SE` (relative, in quadrature), or, where more is allowed, its
        variance would exceed `growth` times that one's or its relative standard error
        `POOLED_MAX_RELATIVE_SE`: the window moved on by `examples`, the
        old weights decayed, this one's added, the spread of the single estimates as it is;
        every step measured, the window would hold `(1 + d) / (1 - d)` of them, `d` the decay
        over one step of `step_examples`."""
        weight_sum, weight_sq = self._g2.count, self._weight_sq
        if weight_sum <= 0 or weight_sq <= 0:
            return True
        decay = self._decay_for(examples, weight)
        # After the update: old weights times decay, this one's weight added.
        total = decay * weight_sum + weight
        count = total * total / (decay * decay * weight_sq + weight * weight)
        if count < AUTO_MIN_MEASUREMENTS:
            return True
        se, b = self.b_simple_se, self._ratio_now()
        n = self.measurements
        if not (math.isfinite(se) and math.isfinite(b) and b != 0 and n > 1):
            return True
        spread = (se / b) ** 2 * (n - 1)  # relative variance of one measurement
        step_decay = self._decay_for(step_examples, 1.0)
        every_step = (1 + step_decay) / (1 - step_decay) if step_decay < 1 else math.inf
        full = spread / (every_step - 1) if every_step > 1 else 0.0
        added = spread / (count - 1) - full
        pooled = min((growth - 1.0) * full, POOLED_MAX_RELATIVE_SE ** 2 - full)
        return added > max(AUTO_ADDED_SE ** 2, pooled)

    def _ratio_now(self) -> float:
        return _ratio(self._trace.value, self._g2.value)

    _EMAS = ("_g2", "_trace", "_ghg", "_htrace", "_g2_short", "_g2_spread")
    _MOMENTS = ("_g2_sq", "_trace_sq", "_cross")

    def state_dict(self) -> dict[str, Any]:
        """What changes as measurements are folded in (the window's settings are the
        constructor's): every EMA, the last measurement, the clocks and the drift history."""
        return {**{name: getattr(self, name).state_dict()
                   for name in (*self._EMAS, *self._MOMENTS)},
                "weight_sq": self._weight_sq, "last": self._last, "decay": self._decay,
                "seen_examples": self.seen_examples,
                "seen_steps": self.seen_steps, "h_examples": self._h_examples,
                "h_steps": self._h_steps, "history": list(self._history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self._EMAS:
            getattr(self, name).load_state_dict(state[name])
        for name in self._MOMENTS:  # absent from a state saved before they were kept
            getattr(self, name).load_state_dict(state.get(name, {"sum": 0.0, "weight": 0.0}))
        self._weight_sq = float(state.get("weight_sq", 0.0))
        self._last = None if state["last"] is None else tuple(state["last"])
        self._decay = state["decay"]
        self.seen_examples, self.seen_steps = state["seen_examples"], state["seen_steps"]
        self._h_examples, self._h_steps = state["h_examples"], state["h_steps"]
        self._history = [(clock, value, error) for clock, value, error in state["history"]]
        self._past = 0
        _ = self.drift  # where the window starts, as the saved run had it (for the pruning)

    def _decay_for(self, examples: float, steps: float) -> float:
        if self.ema_fraction > 0:
            return math.exp(-examples / (self.ema_fraction * max(self.seen_examples, 1.0)))
        return ema_decay(examples, steps=self.ema_steps, examples_scale=self.ema_examples,
                         steps_elapsed=steps)

    def update(self, sq_small: float, sq_big: float, b_small: float, b_big: float,
               *, examples: float | None = None, steps: float = 1.0,
               weight: float = 1.0) -> NoiseEstimate:
        """Fold in one measurement (eq. A.2); `examples` and `steps` seen since the last one
        (default `b_big` and 1). `weight`: the share of training the measurement stands for,
        in measured steps' worth (with one step in k measured, k): the window then averages
        over training progress, not over measurements."""
        g2, trace = unbiased_g2_and_trace(sq_small, sq_big, b_small, b_big)
        return self._fold(g2, trace, b_small, b_big, sq_small, sq_big, examples, steps, weight)

    def update_parts(self, parts: list[tuple[float, float, float, float]], *,
                     examples: float | None = None, steps: float = 1.0,
                     weight: float = 1.0) -> NoiseEstimate:
        """Fold in parameter blocks measured with different batch pairs (`combine_parts`).

        The estimate reports the first part's `(b_small, b_big)` with the equivalent squared
        norms of the whole model (`equivalent_norms`).
        """
        g2, trace = combine_parts(parts)
        b_small, b_big = parts[0][2], parts[0][3]
        sq_small, sq_big = equivalent_norms(g2, trace, b_small, b_big)
        return self._fold(g2, trace, b_small, b_big, sq_small, sq_big, examples, steps, weight)

    def _fold(self, g2: float, trace: float, b_small: float, b_big: float, sq_small: float,
              sq_big: float, examples: float | None, steps: float,
              weight: float = 1.0) -> NoiseEstimate:
        examples = b_big if examples is None else examples
        self.seen_examples += examples
        self.seen_steps += steps
        self._h_examples += examples
        self._h_steps += steps
        decay = self._decay_for(examples, steps)
        self._g2.update(g2, decay, weight)
        self._trace.update(trace, decay, weight)
        self._g2_sq.update(g2 * g2, decay, weight)
        self._trace_sq.update(trace * trace, decay, weight)
        self._cross.update(g2 * trace, decay, weight)
        self._weight_sq = decay * decay * self._weight_sq + weight * weight
        self._last = (b_small, b_big, sq_small, sq_big, g2, trace)
        self._decay = decay
        if math.isfinite(self.window):
            # The quarter-window EMA: decay^4 has a time constant a quarter as long.
            before, quarter = self._g2_short.value, decay ** 4
            if before > 0:
                self._g2_spread.update((g2 / before - 1.0) ** 2, quarter)
            self._g2_short.update(g2, quarter)
            mean, count = self._g2_short.value, self._g2_short.count
            error = (math.sqrt(self._g2_spread.value / count)
                     if mean > 0 and count > 1 and self._g2_spread.count > 0 else math.inf)
            if self._past >= _PRUNE_FROM and 2 * self._past >= len(self._history):
                # Entries before the window's start are never read again (it only moves on):
                # the history, and a checkpoint of it, stay about a window long.
                del self._history[:self._past]
                self._past = 0
            self._history.append((self._clock(), mean, error))
        return self.estimate()

    def update_hessian(self, hsq_small: float, hsq_big: float, b_small: float, b_big: float
                       ) -> NoiseEstimate | None:
        """Fold in H-norms `|G_small|_H^2`, `|G_big|_H^2` (eq. 2.8 through eq. A.2)."""
        ghg, htrace = unbiased_g2_and_trace(hsq_small, hsq_big, b_small, b_big)
        if self._ghg.count == 0:
            decay = 0.0
        elif self.hessian_clock == "measurements":
            decay = self._decay
        else:
            decay = self._decay_for(self._h_examples, self._h_steps)
        self._h_examples = self._h_steps = 0.0
        self._ghg.update(ghg, decay)
        self._htrace.update(htrace, decay)
        return self.estimate() if self._last is not None else None

    def estimate(self) -> NoiseEstimate:
        if self._last is None:
            raise ValueError("no measurement yet")
        b_small, b_big, sq_small, sq_big, g2, trace = self._last
        g2_ema, trace_ema = self._g2.value, self._trace.value
        ghg, htrace = self._ghg.value, self._htrace.value
        return NoiseEstimate(
            b_small=b_small, b_big=b_big, sq_norm_small=sq_small, sq_norm_big=sq_big,
            g2_step=g2, trace_sigma_step=trace, g2=g2_ema, trace_sigma=trace_ema,
            b_simple=_ratio(trace_ema, g2_ema),
            g_h_g=ghg, trace_h_sigma=htrace, b_noise=_ratio(htrace, ghg), drift=self.drift,
            b_simple_se=self.b_simple_se,
        )


def with_preconditioned(estimate: NoiseEstimate, preconditioned: NoiseEstimate | None
                        ) -> NoiseEstimate:
    """`estimate` with the EMAs of `preconditioned` (a `NoiseScaleEma` fed P-norms);
    B_simple_P NaN while it is not determined (`undetermined`: a window's G^T P G or
    tr(P Sigma) not positive, or a single measurement), never a negative batch size."""
    if preconditioned is None:
        return estimate
    p = preconditioned
    b_simple = p.b_simple if undetermined(p.g2, p.trace_sigma, p.b_simple_se) is None else math.nan
    return replace(estimate, g2_precond=p.g2, trace_sigma_precond=p.trace_sigma,
                   b_simple_precond=b_simple)


def undetermined(g2: float, trace_sigma: float, se: float) -> tuple[str, str] | None:
    """(key, why and until when) a noise scale `trace_sigma / g2` (the ratio of two EMAs, eq.
    2.9; `se` its standard error) is not determined yet, or None when it is: the EMA of |G|^2
    or of tr(Sigma) not positive (single estimates are unbiased and noisy, and their window's
    mean is not yet resolved above zero: a ratio of them would be a negative or infinite batch
    size), or a single measurement in the window (no standard error)."""
    if not g2 > 0 or not trace_sigma > 0:
        which, value = ("|G|^2", g2) if not g2 > 0 else ("tr(Sigma)", trace_sigma)
        return ("negative", f"while the window's estimate of {which} is {value:.3g}, not yet "
                "resolved above zero at this batch size: it will be once more measured steps "
                "average it positive (sooner with a larger batch or a longer window)")
    if not math.isfinite(se):
        return ("one", "until the window holds two measurements (one so far gives no standard "
                "error): from the next measured step")
    return None


def _ratio(numerator: float, denominator: float) -> float:
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator


class ProbeSchedule:
    """Log-spaced points in examples for frozen-parameter probes of the noise scale.

    A probe measures B_simple / B_noise from fresh examples at fixed parameters (no window, so no
    lag and no |G|^2 weighting over training). `due(seen)` is True at the first call and then
    each time the examples seen reach the next point, `per_octave` points per doubling: a run of
    S steps gets about `per_octave * log2(S)` probes, so their cost shrinks relative to long runs.
    """

    def __init__(self, per_octave: float = 2.0) -> None:
        if per_octave <= 0:
            raise ValueError(f"per_octave={per_octave}: need > 0")
        self.factor = 2.0 ** (1.0 / per_octave)
        self.next = 0.0

    def state_dict(self) -> dict[str, float]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.next = float(state["next"])

    def due(self, seen: float) -> bool:
        if seen < self.next:
            return False
        self.next = max(seen, 1.0) * self.factor
        return True
