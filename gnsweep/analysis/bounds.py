"""When a fitted batch-size scale is an answer, a bound, or nothing.

A fit places a scale (B_crit of eq. 2.12, B_noise of eq. 2.7) at the bend of a curve measured at
batch sizes `low..high`. Batch sizes all on one side of the bend only bound it: the fit then runs
off along a flat valley and returns any number (1e-15, 1e23) with an error larger still. So a
value is an answer only inside the grid's support `[low / SUPPORT_FACTOR, high * SUPPORT_FACTOR]`
with a standard error below the value; beyond the support it is a bound at the grid's edge
("above 8192", "below 128"), and a value that is not a positive finite number, or whose error
exceeds it inside the grid, is refused. The verdict's reason never quotes the runaway value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORT_FACTOR = 10.0
"""A scale fitted more than this factor outside the batch sizes it was fitted on is a bound."""
REL_SE_LIMIT = 1.0
"""A standard error larger than this share of the value says nothing about it."""
FIT, LOWER_BOUND, UPPER_BOUND, REFUSED = "fit", "lower_bound", "upper_bound", "refused"
STATUSES = (FIT, LOWER_BOUND, UPPER_BOUND, REFUSED)
"""`*_status` columns: fit (the value stands), lower_bound (it is above `*_bound`), upper_bound
(below `*_bound`), refused (nothing; the reason says why)."""


@dataclass(frozen=True)
class Verdict:
    """What a fitted scale is worth: `status` (STATUSES), `reason` ("" for a fit) and, for a
    bound, the grid edge it is above or below."""

    status: str = FIT
    reason: str = ""
    bound: float = math.nan

    @property
    def fitted(self) -> bool:
        return self.status == FIT


def refused(reason: str) -> Verdict:
    return Verdict(REFUSED, reason)


def judge_scale(name: str, value: float, se: float, low: float, high: float,
                unit: str = "") -> Verdict:
    """The verdict on a scale `value` +- `se` fitted on batch sizes `low..high` (module doc)."""
    if not (math.isfinite(value) and value > 0):
        return refused(f"the fit's {name} is not a positive finite number: non-physical")
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
        return refused(f"no batch sizes to judge {name} against")
    vague = not math.isfinite(se) or se > REL_SE_LIMIT * value
    above = value > high * SUPPORT_FACTOR or (vague and value > high)
    below = value < low / SUPPORT_FACTOR or (vague and value < low)
    if above:
        return Verdict(LOWER_BOUND, f"{name} above {high:g}{unit}: the fit places it beyond "
                       f"the largest batch size, where the sweep cannot see the bend; add larger "
                       "batch sizes", high)
    if below:
        return Verdict(UPPER_BOUND, f"{name} below {low:g}{unit}: the fit places it beyond the "
                       "smallest batch size, where the sweep cannot see the bend; add smaller "
                       "batch sizes", low)
    if vague:
        return refused(f"{name}'s standard error is larger than its value: the points do not "
                       "place it; more batch sizes, seeds or longer runs")
    return Verdict()


def bound_text(status: str, bound: float, unit: str = "") -> str:
    """How a bound reads in a table cell: "> 8192", "< 128" ("" for anything else)."""
    if status == LOWER_BOUND and math.isfinite(bound):
        return f"> {bound:g}{unit}"
    if status == UPPER_BOUND and math.isfinite(bound):
        return f"< {bound:g}{unit}"
    return ""
