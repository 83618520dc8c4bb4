"""Pure estimators of the gradient noise scale (McCandlish et al. 2018, appendix A). No I/O.

With `B` examples per batch, `E|G_B|^2 = |G|^2 + tr(Sigma)/B` (eq. A.1). Two batch sizes measured
at the same parameters give unbiased estimates of `|G|^2` and `tr(Sigma)` (eq. A.2); the same
formulas with the H-norm `|v|_H^2 = v^T H v` give `G^T H G` and `tr(H Sigma)` (eq. 2.8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def unbiased_g2_and_trace(sq_small: float, sq_big: float, b_small: float, b_big: float
                          ) -> tuple[float, float]:
    """Unbiased `|G|^2` and `tr(Sigma)` from two squared batch-gradient norms (eq. A.2).

    `sq_small` is `|G_small|^2` averaged over the small batches (each of `b_small` examples) and
    `sq_big` is `|G_big|^2` of their mean (`b_big` examples). Single estimates are noisy and may
    be negative; never clamp them, smooth them (see `NoiseScaleEma`).
    """
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    g2 = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


class Ema:
    """Exponential moving average with bias correction, for decays that may change per update."""

    def __init__(self) -> None:
        self._sum = 0.0
        self._weight = 0.0

    def update(self, value: float, decay: float) -> None:
        self._sum = decay * self._sum + (1.0 - decay) * value
        self._weight = decay * self._weight + (1.0 - decay)

    @property
    def value(self) -> float:
        return self._sum / self._weight if self._weight > 0 else math.nan


def ema_decay(examples: float, *, steps: float = 0.0, examples_scale: float = 0.0) -> float:
    """Per-update decay for a time constant in steps (`steps` > 0) or in examples.

    With a time constant of N examples, an update that saw `examples` examples decays the past by
    `exp(-examples / N)`, so every batch size averages over the same amount of data.
    """
    if steps > 0:
        return math.exp(-1.0 / steps)
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


class NoiseScaleEma:
    """B_simple (and B_noise) as ratios of separately smoothed estimates (appendix A.1).

    Never an average of per-step ratios: the ratio of two noisy, unbiased numbers is biased,
    while the ratio of their averages converges to the right value.
    """

    def __init__(self, *, ema_steps: float = 0.0, ema_examples: float = 2048.0) -> None:
        self.ema_steps, self.ema_examples = ema_steps, ema_examples
        self._g2, self._trace = Ema(), Ema()
        self._ghg, self._htrace = Ema(), Ema()

    def update(self, sq_small: float, sq_big: float, b_small: float, b_big: float,
               *, examples: float | None = None) -> NoiseEstimate:
        """Fold in one measurement; `examples` seen since the last one (default `b_big`)."""
        g2, trace = unbiased_g2_and_trace(sq_small, sq_big, b_small, b_big)
        decay = ema_decay(b_big if examples is None else examples, steps=self.ema_steps,
                          examples_scale=self.ema_examples)
        self._g2.update(g2, decay)
        self._trace.update(trace, decay)
        self._last = (b_small, b_big, sq_small, sq_big, g2, trace)
        self._decay = decay
        return self.estimate()

    def update_hessian(self, hsq_small: float, hsq_big: float, b_small: float, b_big: float
                       ) -> NoiseEstimate:
        """Fold in H-norms `|G_small|_H^2`, `|G_big|_H^2` (eq. 2.8 through eq. A.2)."""
        ghg, htrace = unbiased_g2_and_trace(hsq_small, hsq_big, b_small, b_big)
        decay = getattr(self, "_decay", 0.0)
        self._ghg.update(ghg, decay if self._ghg._weight > 0 else 0.0)
        self._htrace.update(htrace, decay if self._htrace._weight > 0 else 0.0)
        return self.estimate()

    def estimate(self) -> NoiseEstimate:
        b_small, b_big, sq_small, sq_big, g2, trace = self._last
        ghg, htrace = self._ghg.value, self._htrace.value
        return NoiseEstimate(
            b_small=b_small, b_big=b_big, sq_norm_small=sq_small, sq_norm_big=sq_big,
            g2_step=g2, trace_sigma_step=trace, g2=self._g2.value, trace_sigma=self._trace.value,
            b_simple=_ratio(self._trace.value, self._g2.value),
            g_h_g=ghg, trace_h_sigma=htrace, b_noise=_ratio(htrace, ghg),
        )


def _ratio(numerator: float, denominator: float) -> float:
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator
