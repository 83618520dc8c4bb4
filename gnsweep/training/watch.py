"""The smoothed training loss (paper appendix A) and divergence, one run's watch over its loss."""

from __future__ import annotations

import math
from typing import Any

from gnsweep.noise import Ema, ema_decay


class Diverged(RuntimeError):
    """The loss became NaN/inf or grew far above where it started."""


class LossWatch:
    """The smoothed training loss (paper appendix A), and divergence: a NaN/inf loss, or a
    smoothed loss above `factor` x the first (None: only a NaN/inf loss, for a loss that may be
    negative or grow, like A2C's)."""

    def __init__(self, ema_examples: float, factor: float | None) -> None:
        self.ema_examples, self.factor = ema_examples, factor
        self.ema, self.first = Ema(), math.nan

    def update(self, loss: float, examples: int, step: int) -> float:
        """Fold in step `step`'s loss over `examples` examples; the smoothed loss, or Diverged.

        The time constant is in examples (decay exp(-examples / ema_examples) per step), so
        every batch size averages over the same amount of data."""
        if not math.isfinite(loss):
            raise Diverged(f"loss is {loss} at step {step}")
        if step == 1:
            self.first = loss
        self.ema.update(loss, ema_decay(examples, examples_scale=self.ema_examples))
        smooth = self.ema.value
        if self.factor is not None and smooth > self.factor * self.first:
            raise Diverged(f"smoothed loss {smooth:.3g} > {self.factor:g} x first loss "
                           f"{self.first:.3g} at step {step}")
        return smooth

    def state_dict(self) -> dict[str, Any]:
        """The smoothed loss's EMA and the first loss (the divergence reference)."""
        return {"ema": self.ema.state_dict(), "first": self.first}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema.load_state_dict(state["ema"])
        self.first = float(state["first"])
