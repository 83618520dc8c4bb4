"""Where a run stops at its hardest target: one rule for gnsweep's own loop
(`training.loop`) and for a script's logged rows (`training.script_runner`).

Past the hardest target (the causal EMA of the loss reached it) a run trains on until the
analysis's centred smoothing window there is whole (`stop_step`), and stops only once the
analysis will read the target as reached from the rows logged so far (`analysis_reached`): near
a loss floor the two readings differ, and the run then trains on and looks again. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from gnsweep.analysis.smoothing import (
    MIN_WINDOW_EXAMPLES,
    SMOOTHING_FRACTION,
    settled_at_or_below,
)


def overrun_steps(step: int, batch_size: int, fraction: float, min_examples: float) -> int:
    """Steps to train past the hardest target so that the analysis's centred smoothing window
    there is whole: half-width max(fraction * step, min_examples / B) (analysis.smoothing: B
    and `min_examples` in samples, the batch's first dimension)."""
    return math.ceil(max(fraction * step, min_examples / batch_size))


def stop_step(step: int, batch_size: int) -> int:
    """The step to stop at, for a run that reached its hardest target at `step`."""
    return step + overrun_steps(step, batch_size, SMOOTHING_FRACTION, MIN_WINDOW_EXAMPLES)


def analysis_reached(steps: Sequence[float], losses: Sequence[float], target: float,
                     batch_size: int) -> bool:
    """Whether `gnsweep analyze` will read the hardest loss target as reached from the rows
    logged so far: the centred smooth of the training loss (at step - 1 updates, as
    analysis.steps reads it) at or below it where its window is already whole (its smallest
    half-width in samples, `batch_size` a step)."""
    x = np.asarray(steps, float) - 1.0
    return settled_at_or_below(x, np.asarray(losses, float), target, SMOOTHING_FRACTION,
                               MIN_WINDOW_EXAMPLES / batch_size)
