"""The next grid when a sweep's answer is only a bound: the fewest runs that can turn it into a
fit. Pure: `Results` in, a `NextGrid` out.

A B_crit above the grid (`lower_bound`, or a fit extrapolated above the batch sizes fitted) is
placed only once batch sizes on both sides of the bend of S = S_min + E_min/B (eq. 2.11) are
measured, and `analysis.bounds` calls it a fit only within SUPPORT_FACTOR of the largest batch
size. So: NEW_BATCH_SIZES batch sizes above the largest, doubling from it, up to at least twice
the fit's own estimate (the extrapolated B_crit, or the smallest B_crit the measured points
allow: with E_min known, S(B_max) >= S_min + E_min/B_max bounds S_min from above, hence
B_crit = E_min/S_min from below), at most MAX_REACH x the largest. A B_crit below the grid
mirrors it (halving, down to the data-parallel size).

Each new batch size gets LR_BRACKET learning rates around eq. 2.7's prediction there (the lr
fit where it stands; else the best rate at the grid's edge batch size carried with
eps_opt(B) = eps_max / (1 + B_noise/B), B_noise from the lr fit, else B_simple, else the bound),
spaced like the grid's rates, so the best rate there is bracketed. A best rate on the grid's
edge gets one run one grid step beyond it, at that batch size.

The grid's step is the grid's factor (`grid_factor`): the median ratio of neighbouring rates *at
one batch size*, not over the union of every rate run. Next grids add rates predicted per batch
size, and the union of those is dense (rates 15% apart), so a step read from it would move an
edge rate 15% a round and never bracket it; at one batch size the rates stay a factor apart, so
an edge rate moves at least that factor each round until it is bracketed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from gnsweep import lr_law
from gnsweep.analysis.bounds import FIT
from gnsweep.analysis.setting import Setting

if TYPE_CHECKING:
    from gnsweep.analysis.results import Results

NEW_BATCH_SIZES = 3
"""Batch sizes added beyond a bound: with the grid's edge, enough to show the bend."""
MAX_REACH = 16.0
"""New batch sizes reach at most this factor beyond the grid's edge."""
LR_BRACKET = 3
"""Learning rates at each new batch size: eq. 2.7's prediction and one grid step either side."""
DEFAULT_LR_RATIO = 2.0
"""The learning-rate step when the grid has a single rate."""


@dataclass(frozen=True)
class NextRun:
    batch_size: int
    """Samples per step (what `sweep.batch_sizes` takes)."""
    learning_rate: float
    why: str


@dataclass
class NextGrid:
    """The runs to add, and why."""

    runs: list[NextRun] = field(default_factory=list)
    reason: str = ""

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({r.batch_size for r in self.runs})

    @property
    def learning_rates(self) -> list[float]:
        return sorted({r.learning_rate for r in self.runs})

    def overrides(self) -> str:
        """`sweep.batch_sizes=[..] sweep.learning_rates=[..]`: a launch into the same folder
        runs their product (a superset of `runs`; `gnsweep plan DIR` runs exactly `runs`)."""
        return (f"sweep.batch_sizes=[{','.join(str(b) for b in self.batch_sizes)}] "
                f"sweep.learning_rates=[{','.join(f'{x:g}' for x in self.learning_rates)}]")

    def to_json(self) -> dict[str, Any]:
        return {"batch_sizes": self.batch_sizes, "learning_rates": self.learning_rates,
                "runs": [{"batch_size": r.batch_size, "learning_rate": r.learning_rate,
                          "why": r.why} for r in self.runs],
                "reason": self.reason, "overrides": self.overrides() if self.runs else ""}


def lr_ratio(learning_rates: list[float] | tuple[float, ...]) -> float:
    """The grid's learning-rate step: the median ratio of neighbouring rates."""
    rates = sorted({float(x) for x in learning_rates if x > 0})
    if len(rates) < 2:
        return DEFAULT_LR_RATIO
    return float(np.median(np.array(rates[1:]) / np.array(rates[:-1])))


def grid_factor(steps: pd.DataFrame, batch_size: float | None = None) -> float:
    """The grid's learning-rate factor (module doc): the median ratio of neighbouring rates run
    at `batch_size`, or the median of that over every batch size with two rates or more; 1.0
    where no batch size has two."""
    if not len(steps) or not {"batch_size", "learning_rate"} <= set(steps):
        return 1.0
    frame = steps[["batch_size", "learning_rate"]].astype(float)
    if batch_size is not None:
        frame = frame[np.isclose(frame["batch_size"], batch_size, rtol=1e-9, atol=0)]
    ratios = [lr_ratio(group["learning_rate"].tolist())
              for _, group in frame.groupby("batch_size")
              if group["learning_rate"].nunique() > 1]
    return float(np.median(ratios)) if ratios else 1.0


def _round_lr(value: float) -> float:
    return float(f"{value:.3g}")


def next_grid(results: Results, target: float, setting: Setting, side: str | None = None
              ) -> NextGrid:
    """The runs that can turn `target`'s bound into a fit (module doc): batch sizes `side`
    ("above" or "below") the grid where B_crit is not settled, and a rate beyond each best
    learning rate on the grid's edge; empty with a reason where none can."""
    fits = results.fits
    rows = fits[np.isclose(fits["target"].astype(float), target, rtol=1e-9, atol=0)]
    front = results.front
    points = front[np.isclose(front["target"].astype(float), target, rtol=1e-9, atol=0)]
    if not len(rows) or not len(points):
        return NextGrid(reason=f"no batch size reached target {target:g}")
    row = rows.iloc[0]
    per, dp = setting.per_sample, setting.data_parallel
    # The rates the sweep ran (a table analysed without its config: every rate in its steps).
    grid_lrs = setting.learning_rates or tuple(
        pd.unique(results.steps["learning_rate"].astype(float)) if "learning_rate" in
        results.steps else points["learning_rate"].astype(float))
    ratio = max(lr_ratio(grid_lrs), grid_factor(results.steps))
    samples = sorted(setting.batch_sizes) or sorted(
        {max(1, round(float(b) / per)) for b in points["batch_size"]})
    runs: list[NextRun] = []
    reasons = []
    above, below = side == "above", side == "below"
    if above or below:
        new = _new_batch_sizes(row, points, samples, setting, above)
        edge = points.loc[points["batch_size"].idxmax() if above else points["batch_size"].idxmin()]
        for b in new:
            centre = _lr_at(row, edge, b * per)
            for k in range(LR_BRACKET):
                lr = _round_lr(centre * ratio ** (k - (LR_BRACKET - 1) / 2))
                runs.append(NextRun(b, lr, f"B_crit not settled, batch sizes {side} the grid: "
                                           f"eq. 2.7 predicts lr {centre:.3g} at {b}"))
        reasons.append(f"B_crit is not settled: {len(new)} batch size(s) {side} the grid, "
                       f"{LR_BRACKET} learning rates each around eq. 2.7's")
        if not new:
            reasons[-1] = (f"B_crit is below the smallest batch size and no smaller multiple of "
                           f"the data-parallel size ({dp}) exists")
    for point in points.itertuples(index=False):
        if not bool(point.lr_on_edge):
            continue
        lr = float(point.learning_rate)
        step = max(ratio, grid_factor(results.steps, float(point.batch_size)))
        beyond = _round_lr(lr * step if point.lr_edge == "high" else lr / step)
        b = setting.samples(float(point.batch_size))
        runs.append(NextRun(b, beyond, f"best rate {lr:g} at {b} is on the grid's "
                                       f"{point.lr_edge} edge"))
    if any(p.lr_on_edge for p in points.itertuples(index=False)):
        reasons.append("best learning rates on the grid's edge: one rate beyond each")
    seen: set[tuple[int, float]] = set()
    unique = []
    for r in runs:
        if (r.batch_size, r.learning_rate) not in seen and r.batch_size > 0:
            seen.add((r.batch_size, r.learning_rate))
            unique.append(r)
    return NextGrid(unique, "; ".join(reasons))


def _new_batch_sizes(row: Any, points: Any, samples: list[int], setting: Setting,
                     above: bool) -> list[int]:
    """NEW_BATCH_SIZES batch sizes (samples a step, multiples of the data-parallel size) beyond
    the grid's edge on B_crit's side (module doc)."""
    per, dp = setting.per_sample, setting.data_parallel
    if above:
        edge = max(samples)
        estimate = float(row.get("b_crit", math.nan))
        if not (math.isfinite(estimate) and estimate > 0):
            estimate = _smallest_bcrit(row, points)
        reach = 8.0
        if math.isfinite(estimate) and estimate > 0:
            reach = min(max(reach, 2 * estimate / per / edge), MAX_REACH)
        factors = np.geomspace(2.0, reach, NEW_BATCH_SIZES)
        new = [dp * max(1, round(edge * 2 ** round(math.log2(f)) / dp)) for f in factors]
    else:
        edge = min(samples)
        new = [dp * round(edge / 2 ** k / dp) for k in range(1, NEW_BATCH_SIZES + 1)]
    return sorted({b for b in new if b >= dp and b not in samples and b > 0})


def _smallest_bcrit(row: Any, points: Any) -> float:
    """With E_min known (a B_crit above the grid keeps it), S_min <= S(B_max) - E_min / B_max,
    so B_crit = E_min / S_min is at least E_min / that (NaN where it is not positive)."""
    e_min = float(row.get("e_min", math.nan))
    edge = points.loc[points["batch_size"].idxmax()]
    room = float(edge["steps"]) - e_min / float(edge["batch_size"])
    return e_min / room if math.isfinite(e_min) and room > 0 else math.nan


def _lr_at(row: Any, edge: Any, b: float) -> float:
    """Eq. 2.7's learning rate at batch size `b` (task unit) for the next grid (module doc)."""
    alpha = float(row.get("lr_alpha", math.nan))
    alpha = alpha if math.isfinite(alpha) and alpha > 0 else 1.0
    eps_max, b_noise = float(row.get("eps_max", math.nan)), float(row.get("b_noise_lr", math.nan))
    if str(row.get("lr_status", "")) == FIT and all(math.isfinite(x) and x > 0
                                                    for x in (eps_max, b_noise)):
        return float(lr_law.eps_opt(b, eps_max, b_noise, alpha))
    lr = float(edge.get("lr_opt", edge["learning_rate"]))
    guess = math.nan
    for name in ("b_noise_lr", "b_simple_mean", "b_crit", "b_crit_bound"):
        value = float(row.get(name, math.nan))
        if math.isfinite(value) and value > 0:
            guess = value
            break
    if not math.isfinite(guess):
        return lr
    b_edge = float(edge["batch_size"])
    return float(lr_law.eps_opt(b, lr_law.eps_max_from(lr, b_edge, guess), guess))
