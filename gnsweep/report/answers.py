"""What a sweep's fits answer, in plain words: one paragraph per target.

The answer per target comes from eq. 2.11: with S = S_min + E_min/B, doubling B saves the
fraction B_crit / (2 (B + B_crit)) of the steps: 1/4 at B = B_crit, half of what perfect
scaling (1/2) would save, and less beyond it. A B_crit the fit can only extrapolate is said as a
bound, an interval too wide to mean much is said to be poorly determined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from gnsweep.targets import Direction

EXTRAPOLATION = 2.0
"""B_crit further than this factor outside the measured batch sizes is reported as a bound."""
POORLY_DETERMINED = 100.0
"""An interval wider than this factor (hi/lo) is called poorly determined in the answer."""
Z95 = 1.959964
"""Two-sided 95% normal quantile; B_crit's interval is taken on log B_crit (delta method)."""


def rounded(value: float) -> str:
    """Two significant figures with thousands separators: 74.13 -> '74', 1126 -> '1,100'."""
    if not math.isfinite(value):
        return "?"
    if value == 0:
        return "0"
    digits = 1 - math.floor(math.log10(abs(value)))
    value = round(value, digits)
    digits = 1 - math.floor(math.log10(abs(value)))  # 9.96 -> 10.0 has one digit fewer
    return f"{value:,.{max(digits, 0)}f}"


def bcrit_interval(b_crit: float, se: float) -> tuple[float, float]:
    """95% interval of B_crit, symmetric on the log scale (B_crit is positive and its error
    comes from log S_min and log E_min by the delta method)."""
    if not (math.isfinite(se) and se > 0 and b_crit > 0):
        return math.nan, math.nan
    log_spread = Z95 * se / b_crit
    if log_spread > 700:  # exp would overflow: the fit does not pin B_crit down at all
        return 0.0, math.inf
    spread = math.exp(log_spread)
    return b_crit / spread, b_crit * spread


def interval_of(row: Any) -> tuple[float, float]:
    """B_crit's 95% interval: the bootstrap percentiles when `gnsweep analyze --bootstrap` made
    them, else the delta-method interval of `bcrit_interval`."""
    lo, hi = (float(getattr(row, k, math.nan)) for k in ("b_crit_lo", "b_crit_hi"))
    if math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi:
        return lo, hi
    return bcrit_interval(float(row.b_crit), float(row.b_crit_se))


ROBUST_SPREAD = 0.2
"""Robust: B_crit moves at most this share when the loss is smoothed over half / double the
window ..."""
ROBUST_REL_ERROR = 0.3
"""... and its standard error is at most this share of it (a 59% error is never robust)."""
TREND_FACTOR = 1.25
"""A caption's trend: a power law fitted across the points changes by more than this factor
from the first to the last (up: grows, down: falls); within it, no clear trend."""
BOUND_STATUSES = {"lower_bound": "above", "upper_bound": "below"}
"""`bcrit_status` of a B_crit the sweep only bounds (fits.parquet), and how it is said."""


@dataclass(frozen=True)
class Verdict:
    """What one fitted B_crit is worth, decided once from its row and the batch sizes that
    reached its target: the answer, its caveats, the robustness label and the warnings all
    say this and nothing else."""

    kind: str
    """fit (a value), bound (only a side: `side` `bound`), refused."""
    value: float = math.nan
    se: float = math.nan
    side: str = ""
    bound: float = math.nan
    reason: str = ""
    low: float = math.nan
    high: float = math.nan
    """The batch sizes that reached the target (the fit's support)."""

    @property
    def relative_error(self) -> float:
        ok = self.value > 0 and math.isfinite(self.se)
        return self.se / self.value if ok else math.nan

    @property
    def extrapolated(self) -> bool:
        """Outside the batch sizes that reached its target: the sweep only bounds it."""
        return self.kind == "fit" and math.isfinite(self.low) and not (
            self.low <= self.value <= self.high)


def _text(value: Any) -> str:
    """A text cell as a string: a missing cell (None, or NaN in a column pandas filled) is ""."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def verdict(row: Any, front: pd.DataFrame | None = None) -> Verdict:
    """The verdict on one fits row: refused (no positive finite B_crit, or `refused` says why),
    a bound (`bcrit_status` lower_bound / upper_bound, its edge in `b_crit_bound`), else a fit,
    with the batch sizes that reached its target in `front` (finite steps, not left out of the
    fit) as its support: the same range the analysis's `quality` judges it against."""
    status = _text(getattr(row, "bcrit_status", ""))
    reason = _text(getattr(row, "refused", "")) or _text(getattr(row, "bcrit_reason", ""))
    if status in BOUND_STATUSES:
        return Verdict("bound", side=BOUND_STATUSES[status],
                       bound=float(getattr(row, "b_crit_bound", math.nan)), reason=reason)
    value = float(row.b_crit)
    if reason or not (math.isfinite(value) and value > 0):
        return Verdict("refused", reason=reason or "no fit")
    low = high = math.nan
    if front is not None and len(front):
        rows = front[(front["target"] == row.target)
                     & np.isfinite(front["steps"].astype(float))]
        if "left_out" in rows:
            rows = rows[~rows["left_out"].astype(bool)]
        if len(rows):
            low, high = float(rows["batch_size"].min()), float(rows["batch_size"].max())
    return Verdict("fit", value, float(row.b_crit_se), low=low, high=high)


def robustness(row: Any, judged: Verdict) -> str:
    """The robustness sentence: how much B_crit moves when the loss is smoothed over half and
    double the window, and the label, which is "robust" only when that spread, the standard
    error and the grid all allow it."""
    lo, hi = (float(getattr(row, name, math.nan)) for name in ("b_crit_window_lo",
                                                               "b_crit_window_hi"))
    spread = float(getattr(row, "b_crit_window_spread", math.nan))
    if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(spread)):
        return ""
    why = []
    if spread > ROBUST_SPREAD:
        why.append("it moves with the smoothing")
    error = judged.relative_error
    if not math.isfinite(error) or error > ROBUST_REL_ERROR:
        why.append(f"its standard error is {error:.0%} of it" if math.isfinite(error)
                   else "it has no standard error")
    if judged.extrapolated:
        why.append("it lies outside the batch sizes that reached the target")
    label = "robust" if not why else f"not robust: {'; '.join(why)}"
    return (f" Smoothing the loss over half / double the window gives B_crit {rounded(lo)} / "
            f"{rounded(hi)} (a {spread:.0%} spread; {label}).")


SMALLEST_WORDS = ("every batch from there up takes about the same steps (S = S_min (1 + "
                  "B_crit/B) with B_crit/B < 1), so choose the batch size for throughput")
"""Said where B_crit lies below the smallest batch a run can take: there is nothing smaller to
add."""


def answers(fits: pd.DataFrame, front: pd.DataFrame, what: str = "loss",
            unit: str = "examples", direction: Direction | bool | None = None,
            smallest: float = math.nan) -> list[str]:
    """One plain paragraph per target, earliest in training first; `what` names the targets'
    quantity (loss, or a task's own metric such as return); `direction` which way it is reached
    (default: a loss falls, any other metric rises).

    Each from its `verdict`: a refusal says why; a bound says its side; a B_crit outside the
    batch sizes that reached its target (the range the analysis's warning names) is always
    called an extrapolation, and more than a factor EXTRAPOLATION outside it is said as a
    bound, not as a number. `smallest`: the smallest batch a run can take (task unit, one
    sample per process); a B_crit below it is said as such, never with "add smaller batch
    sizes".
    """
    out = []
    rises = what != "loss" if direction is None else Direction.of(direction).rises
    suffix = "" if unit == "examples" else f" {unit}"
    for row in fits.sort_values("target", ascending=rises).itertuples(index=False):
        b_crit = float(row.b_crit)
        status = str(getattr(row, "bcrit_status", ""))
        if status in ("lower_bound", "upper_bound"):
            edge = f"{float(row.b_crit_bound):g}" + ("" if unit == "examples" else f" {unit}")
            side = ("above the largest batch size measured" if status == "lower_bound"
                    else "below the smallest batch size measured")
            more = "larger" if status == "lower_bound" else "smaller"
            if status == "upper_bound" and float(row.b_crit_bound) <= smallest * (1 + 1e-9):
                out.append(f"At {what} {row.target:g} the largest useful batch size is below "
                           f"the smallest batch a run can take ({edge}): {SMALLEST_WORDS}.")
                continue
            out.append(f"At {what} {row.target:g} the sweep only bounds the largest useful "
                       f"batch size: it is {side} ({edge}), and the fit cannot place it. Add "
                       f"{more} batch sizes to measure it.")
            continue
        judged = verdict(row, front)
        if judged.kind == "refused":
            out.append(f"At {what} {row.target:g}: no answer yet; {judged.reason}.")
            continue
        if judged.kind == "bound":
            out.append(f"At {what} {row.target:g} the sweep only bounds the largest useful "
                       f"batch size: {judged.side} {judged.bound:,.0f}{suffix} "
                       f"({judged.reason}).")
            continue
        b_crit = judged.value
        lo, hi = interval_of(row)
        if math.isfinite(lo) and math.isfinite(hi) and lo > 0 and hi / lo <= POORLY_DETERMINED:
            interval = f"{rounded(lo)} to {rounded(hi)}"
            poor = False
        else:
            interval = f"{rounded(lo)} to {rounded(hi) if math.isfinite(hi) else 'infinity'}"
            poor = True
        b_simple = float(row.b_simple_mean)
        measured = (f" The noise scale measured during training, B_simple, was about "
                    f"{rounded(b_simple)}." if math.isfinite(b_simple) and b_simple > 0 else "")
        low, high = judged.low, judged.high
        if judged.extrapolated and b_crit > EXTRAPOLATION * high:
            out.append(f"At {what} {row.target:g} the largest useful batch size is beyond the "
                       f"largest one that reached it ({high:g}): the fit puts it near "
                       f"{rounded(b_crit)} (95% interval {interval}), an extrapolation. Add "
                       f"larger batch sizes to pin it down.{measured}")
            continue
        if judged.extrapolated and b_crit < low and low <= smallest * (1 + 1e-9):
            out.append(f"At {what} {row.target:g} the largest useful batch size is below the "
                       f"smallest batch a run can take ({low:g}): the fit puts it near "
                       f"{rounded(b_crit)}, an extrapolation; {SMALLEST_WORDS}.{measured}")
            continue
        if judged.extrapolated and b_crit < low / EXTRAPOLATION:
            out.append(f"At {what} {row.target:g} the largest useful batch size is below the "
                       f"smallest one that reached it ({low:g}): the fit puts it near "
                       f"{rounded(b_crit)} (95% interval {interval}), an extrapolation. Add "
                       f"smaller batch sizes to pin it down.{measured}")
            continue
        detail = (f"poorly determined: the 95% interval spans {interval}; add batch sizes or "
                  "seeds" if poor else interval)
        text = (f"At {what} {row.target:g} the largest useful batch size is about "
                f"{rounded(b_crit)}{suffix} ({detail}); beyond it, doubling the batch saves "
                f"less than half the steps that perfect scaling would save (under a quarter "
                f"of them).")
        text += (f" Near it a run needs about {rounded(2 * row.s_min)} steps and "
                 f"{rounded(2 * row.e_min)} {unit}.")
        if judged.extrapolated:
            text += (f" B_crit lies outside the batch sizes that reached this target "
                     f"({low:g} to {high:g}): it is extrapolated, the sweep only bounds it.")
        out.append(text + measured + robustness(row, judged))
    return out


def trend(x: np.ndarray, y: np.ndarray) -> str:
    """grows, falls or flat: the sign of a power law fitted to positive (x, y), said only when
    it changes y by more than TREND_FACTOR across the points; "" with fewer than 2 points."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    x, y = np.log(x[ok]), np.log(y[ok])
    if len(x) < 2 or np.ptp(x) == 0:
        return ""
    slope = float(np.polyfit(x, y, 1)[0])
    change = math.exp(slope * float(np.ptp(x)))
    if change > TREND_FACTOR:
        return "grows"
    if change < 1 / TREND_FACTOR:
        return "falls"
    return "flat"


TREND_WORDS = {"grows": "grows", "falls": "falls", "flat": "stays within a factor "
               f"{TREND_FACTOR:g} (no clear trend)", "": "has too few fitted points for a trend"}


def bcrit_trend_caption(fits: pd.DataFrame, front: pd.DataFrame | None = None,
                        direction: Direction | bool | None = None) -> str:
    """How B_crit moves as training goes on (from target to target, in training order), from
    the fitted values that are answers (not refused, bounded or extrapolated)."""
    rows = [(float(r.target), verdict(r, front)) for r in fits.itertuples(index=False)]
    kept = [(t, v.value) for t, v in rows if v.kind == "fit" and not v.extrapolated]
    rises = Direction.of(direction).rises if direction is not None else False
    # Training order: a falling loss goes from high targets to low ones.
    kept.sort(key=lambda p: p[0], reverse=not rises)
    order = np.arange(1, len(kept) + 1, dtype=float)
    return TREND_WORDS[trend(order, np.array([v for _, v in kept]))]


def along_trend_caption(along: pd.DataFrame, column: str = "b_crit") -> str:
    """How the local B_crit moves from branch point to branch point (its value per point: the
    tolerance rule's, or the fit's median over the point's targets that are answers)."""
    if not len(along) or column not in along:
        return TREND_WORDS[""]
    per_point = along.groupby("at_examples")[column].median()
    return TREND_WORDS[trend(per_point.index.to_numpy(float), per_point.to_numpy(float))]


def along_answers(along: pd.DataFrame, unit: str = "examples", what: str = "loss") -> list[str]:
    """One paragraph per branch point, naming it (examples in the task's unit, the base run's
    step, the loss there): the local B_crit by tolerance (its bracket, its bound or why
    not), the fit of eq. 2.11 at its targets (answers only; bounds and refusals said as such),
    and the base run's B_simple there."""
    out: list[str] = []
    if not len(along):
        return out
    suffix = "" if unit == "examples" else f" {unit}"
    for at, rows in along.groupby("at_examples", sort=True):
        first = rows.iloc[0]
        head = (f"At {int(at):,} {unit} (step {int(first['at_step']):,}) of the base run, "
                f"{what} {float(first['at_loss']):.4g}:")
        tol = float(first.get("b_crit_tol", math.nan))
        why = str(first.get("tol_refused", "") or "")
        if math.isfinite(tol):
            parts = [f"by tolerance the local B_crit is about {rounded(tol)}{suffix} (between "
                     f"{float(first['b_crit_tol_lo']):g} and {float(first['b_crit_tol_hi']):g}, "
                     f"over a window of {rounded(float(first['window']))} {unit})"]
        elif math.isfinite(lo := float(first.get("b_crit_tol_lo", math.nan))) \
                and not math.isfinite(float(first.get("b_crit_tol_hi", math.nan))):
            parts = [f"by tolerance the local B_crit is above {lo:,.0f}{suffix} (every "
                     "batch size stayed within tolerance; add larger ones)"]
        elif "window" in first and why:
            parts = [f"by tolerance: {why}"]
        else:
            parts = []
        fitted = []
        for row in rows.itertuples(index=False):
            if not math.isfinite(float(row.target)):
                continue
            judged = verdict(row)
            label = f"{what} {float(row.target_value):.4g}"
            if judged.kind == "fit":
                quality = str(row.quality or "")
                caveat = " (the sweep only bounds it)" if "only bounds" in quality else ""
                fitted.append(f"{rounded(judged.value)}{suffix} at {label}{caveat}")
            elif judged.kind == "bound":
                fitted.append(f"{judged.side} {judged.bound:,.0f}{suffix} at {label}")
        if fitted:
            parts.append("eq. 2.11 gives " + ", ".join(fitted))
        else:
            refused = str(rows.iloc[0]["refused"] or "no target reached")
            parts.append(f"eq. 2.11 gives no answer ({refused})")
        b_simple = float(first["b_simple"])
        if math.isfinite(b_simple) and b_simple > 0:
            parts.append(f"the base run's B_simple there was about {rounded(b_simple)}{suffix}")
        out.append(f"{head} " + "; ".join(parts) + ".")
    return out
