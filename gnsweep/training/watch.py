"""The smoothed training loss (paper appendix A) and divergence, one run's watch over its loss."""

from __future__ import annotations

import math
from typing import Any

from gnsweep.noise import Ema, ema_decay
from gnsweep.targets import LOSS_EMA_SAMPLES

REFERENCE_SAMPLES = 16.0
"""Samples the divergence reference averages at the default loss window (LOSS_EMA_SAMPLES):
the initial loss is the mean over the first steps until they hold this share of the window."""


class Diverged(RuntimeError):
    """The loss became NaN/inf or grew far above where it started."""


class LossWatch:
    """The smoothed training loss (paper appendix A), and divergence: a NaN/inf loss, or a
    smoothed loss above `factor` x the run's initial loss (None: only a NaN/inf loss, for a
    loss that may be negative or grow, like A2C's).

    The initial loss, the divergence reference, is the mean batch loss of the run's first steps
    until they hold REFERENCE_SAMPLES samples' worth of examples (`reference_examples`; at the
    default loss window 16 samples, so the first step alone from B = 16 up), each loss weighted
    by its examples. One small batch's loss is no reference: at B = 2 on linear regression a
    batch loss below a third of its mean has probability 1 - exp(-1/3) = 0.28 (a chi-square
    with 2 degrees of freedom), and a smoothed loss 3x above it marked healthy runs diverged at
    their second step; a mean of 16 examples falls that low with probability about 0.006. The
    pool is short in steps on purpose: a learning rate far too high blows the loss up within
    2-3 updates (digits at B = 8: 2.3, 2.6, then 19), and a reference that took those losses
    in would hide the blow-up. While the pool fills the reference is its mean so far (the
    smoothed loss averages the same losses then, nearly alike), so a run that blows up inside
    it is caught at its end, at most 16 samples' steps later than against the first batch; a
    NaN/inf loss is caught at once."""

    def __init__(self, ema_examples: float, factor: float | None) -> None:
        self.ema_examples, self.factor = ema_examples, factor
        # In the window's unit (the task's: tokens for a language model), as ema_examples.
        self.reference_window = ema_examples * REFERENCE_SAMPLES / LOSS_EMA_SAMPLES
        self.ema = Ema()
        self.reference_sum, self.reference_examples = 0.0, 0.0

    @property
    def first(self) -> float:
        """The divergence reference: the mean loss of the first steps so far, up to
        `reference_window` examples (NaN before the first loss)."""
        if self.reference_examples <= 0:
            return math.nan
        return self.reference_sum / self.reference_examples

    def update(self, loss: float, examples: int, step: int) -> float:
        """Fold in step `step`'s loss over `examples` examples; the smoothed loss, or Diverged.

        The time constant is in examples (decay exp(-examples / ema_examples) per step), so
        every batch size averages over the same amount of data."""
        if not math.isfinite(loss):
            raise Diverged(f"loss is {loss} at step {step}")
        if self.reference_examples < self.reference_window:  # the reference is still filling
            weight = max(float(examples), 1.0)
            self.reference_sum += weight * loss
            self.reference_examples += weight
        self.ema.update(loss, ema_decay(examples, examples_scale=self.ema_examples))
        smooth = self.ema.value
        if self.factor is not None and smooth > self.factor * self.first:
            raise Diverged(f"smoothed loss {smooth:.3g} > {self.factor:g} x initial loss "
                           f"{self.first:.3g} (mean of the first "
                           f"{self.reference_examples:g} examples) at step {step}")
        return smooth

    def state_dict(self) -> dict[str, Any]:
        """The smoothed loss's EMA and the divergence reference's sum and examples."""
        return {"ema": self.ema.state_dict(), "reference_sum": self.reference_sum,
                "reference_examples": self.reference_examples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema.load_state_dict(state["ema"])
        if "reference_examples" in state:
            self.reference_sum = float(state["reference_sum"])
            self.reference_examples = float(state["reference_examples"])
        else:  # a checkpoint written before the window reference: its first loss, whole
            first = float(state["first"])
            self.reference_examples = max(self.reference_window, 1.0)
            self.reference_sum = first * self.reference_examples
