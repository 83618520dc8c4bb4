"""What a sweep's fits answer, in plain words: one paragraph per target.

The answer per target comes from eq. 2.11: with S = S_min + E_min/B, doubling B saves the
fraction B_crit / (2 (B + B_crit)) of the steps: 1/4 at B = B_crit, half of what perfect
scaling (1/2) would save, and less beyond it. A B_crit the fit can only extrapolate is said as a
bound, an interval too wide to mean much is said to be poorly determined.
"""

from __future__ import annotations

import math
from typing import Any

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


def answers(fits: pd.DataFrame, front: pd.DataFrame, what: str = "loss",
            unit: str = "examples", direction: Direction | bool | None = None) -> list[str]:
    """One plain paragraph per target, earliest in training first; `what` names the targets'
    quantity (loss, or a task's own metric such as return); `direction` which way it is reached
    (default: a loss falls, any other metric rises).

    B_crit more than a factor EXTRAPOLATION outside the measured batch sizes is reported as a
    bound (beyond the largest / below the smallest), not as a number: the fit cannot place it.
    """
    out = []
    batches = sorted(int(b) for b in front["batch_size"].unique()) if len(front) else []
    rises = what != "loss" if direction is None else Direction.of(direction).rises
    for row in fits.sort_values("target", ascending=rises).itertuples(index=False):
        b_crit = float(row.b_crit)
        status = str(getattr(row, "bcrit_status", ""))
        if status in ("lower_bound", "upper_bound"):
            edge = f"{float(row.b_crit_bound):g}" + ("" if unit == "examples" else f" {unit}")
            side = ("above the largest batch size measured" if status == "lower_bound"
                    else "below the smallest batch size measured")
            more = "larger" if status == "lower_bound" else "smaller"
            out.append(f"At {what} {row.target:g} the sweep only bounds the largest useful "
                       f"batch size: it is {side} ({edge}), and the fit cannot place it. Add "
                       f"{more} batch sizes to measure it.")
            continue
        if not (math.isfinite(b_crit) and b_crit > 0):
            reason = str(row.refused) or "no fit"
            out.append(f"At {what} {row.target:g}: no answer yet; {reason}.")
            continue
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
        if batches and b_crit > EXTRAPOLATION * batches[-1]:
            out.append(f"At {what} {row.target:g} the largest useful batch size is beyond the "
                       f"largest one measured ({batches[-1]}): the fit puts it near "
                       f"{rounded(b_crit)} (95% interval {interval}), an extrapolation. Add "
                       f"larger batch sizes to pin it down.{measured}")
            continue
        if batches and b_crit < batches[0] / EXTRAPOLATION:
            out.append(f"At {what} {row.target:g} the largest useful batch size is below the "
                       f"smallest one measured ({batches[0]}): the fit puts it near "
                       f"{rounded(b_crit)} (95% interval {interval}), an extrapolation. Add "
                       f"smaller batch sizes to pin it down.{measured}")
            continue
        detail = (f"poorly determined: the 95% interval spans {interval}; add batch sizes or "
                  "seeds" if poor else interval)
        size = f"{rounded(b_crit)}" + ("" if unit == "examples" else f" {unit}")
        text = (f"At {what} {row.target:g} the largest useful batch size is about "
                f"{size} ({detail}); beyond it, doubling the batch saves less than "
                f"half the steps that perfect scaling would save (under a quarter of them).")
        text += (f" Near it a run needs about {rounded(2 * row.s_min)} steps and "
                 f"{rounded(2 * row.e_min)} {unit}.")
        if batches and not batches[0] <= b_crit <= batches[-1]:
            text += (f" B_crit lies outside the measured batch sizes ({batches[0]} to "
                     f"{batches[-1]}): it is extrapolated.")
        out.append(text + measured + _robustness(row))
    return out


def _robustness(row: Any) -> str:
    """How much B_crit moves when the loss is smoothed over half and double the window."""
    lo, hi = (float(getattr(row, name, math.nan)) for name in ("b_crit_window_lo",
                                                               "b_crit_window_hi"))
    spread = float(getattr(row, "b_crit_window_spread", math.nan))
    if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(spread)):
        return ""
    verdict = "robust" if spread <= 0.2 else "not robust: more seeds or longer runs"
    return (f" Smoothing the loss over half / double the window gives B_crit {rounded(lo)} / "
            f"{rounded(hi)} (a {spread:.0%} spread: {verdict}).")
