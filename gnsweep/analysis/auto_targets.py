"""Targets chosen from the runs (`sweep.targets=auto`, `gnsweep analyze --targets auto`): a
user does not know the loss scale before the first sweep, and a target no run reached, or one
every batch size passes in its first steps, tells nothing about the tradeoff of eq. 2.11.

From the loss the analysis reads (`steps.loss_curve`), each batch size at its best learning
rate:
- the hardest level is the one the MIN_FRONT-th best batch size still reaches before the late
  stretch of its run (its best loss over TIMELY_SHARE of its updates, eased by MARGIN of the
  loss range so that it is crossed, not grazed): at least MIN_FRONT batch sizes on the front
  (all of them when the sweep has fewer);
- the easiest is the level every batch size passes only after its first FIRST_UPDATES updates:
  just below the best loss any run had within them (a target met in a step or two measures
  the start, not the tradeoff);
- N_TARGETS levels spread evenly between them in log loss (linearly where a level is not
  positive: a task's own metric such as a return), rounded to 3 significant figures.
Pure: curves in, levels and the sentence saying how they were chosen out.
"""

from __future__ import annotations

import math

import numpy as np

from gnsweep.analysis.steps import Curves, loss_curve
from gnsweep.targets import FALLING, Direction

N_TARGETS = 3
"""Levels chosen."""
MIN_FRONT = 4
"""Batch sizes that must reach the hardest level (or every batch size of a smaller sweep)."""
FIRST_UPDATES = 10
"""No batch size may reach the easiest level within this many updates."""
TIMELY_SHARE = 0.8
"""A run's best loss is read over this share of its updates, before the late stretch that the
fit leaves out (`analysis.front.LATE_BUDGET_SHARE`, 0.85)."""
MARGIN = 0.02
"""The hardest level sits this share of the loss range above the MIN_FRONT-th best loss."""


class NoAutoTargets(ValueError):
    """The runs do not support any level (too few batch sizes with a finite loss); says why."""


def auto_targets(curves: Curves, loss: str = "smoothed", ema_examples: float | None = None,
                 direction: Direction = FALLING, n: int = N_TARGETS) -> tuple[list[float], str]:
    """Levels from the runs (module doc), easiest first, and how they were chosen."""
    updates, values = loss_curve(curves, loss, ema_examples)
    sign = direction.sign  # as a loss: lower is better
    best: dict[float, float] = {}
    early: dict[float, float] = {}
    batch = curves.runs["batch_size"].to_numpy(float)
    for i in range(len(curves.runs)):
        lo, hi = curves.offsets[i], curves.offsets[i + 1]
        x, y = updates[lo:hi], sign * values[lo:hi]
        ok = np.isfinite(x) & np.isfinite(y)
        x, y = x[ok], y[ok]
        if len(y) < 2:
            continue
        b = float(batch[i])
        # The best before the run's late stretch: a level met only at the end of a budget is
        # left out of the fit as late (`front.LATE_BUDGET_SHARE`).
        timely = y[1:][x[1:] <= TIMELY_SHARE * x[-1]]
        best[b] = min(best.get(b, math.inf), float(timely.min() if len(timely) else y[1:].min()))
        # The best this run had within its first updates: the level must lie below it.
        first = y[x <= FIRST_UPDATES]
        early[b] = min(early.get(b, math.inf), float(first.min() if len(first) else y[0]))
    if len(best) < 3:
        raise NoAutoTargets(f"{len(best)} batch size(s) logged a finite {loss} loss; automatic "
                            "targets need at least 3")
    k = min(MIN_FRONT, len(best))
    ordered = sorted(best.values())
    start = min(early.values())
    spread = max(start - ordered[0], 0.0)
    hardest = ordered[k - 1] + MARGIN * spread
    easiest = start - MARGIN * spread
    if not easiest > hardest:
        raise NoAutoTargets(
            f"the {k} best batch sizes got no lower than {sign * ordered[k - 1]:.4g}, which a "
            f"batch size already had within {FIRST_UPDATES} updates: train longer")
    if easiest > 0 and hardest > 0:
        levels = np.geomspace(easiest, hardest, n)
    else:
        levels = np.linspace(easiest, hardest, n)
    chosen = sorted({float(f"{sign * v:.3g}") for v in levels}, key=lambda v: sign * -v)
    how = (f"automatic: {len(chosen)} levels of the {loss} loss from {chosen[0]:g} (no batch "
           f"size reaches it within {FIRST_UPDATES} updates) to {chosen[-1]:g} (reached by "
           f"the {k} best of {len(best)} batch sizes at their best learning rate)")
    return chosen, how
