"""A recommendation (`analysis.decision`, as its JSON) in words: the lines `gnsweep recommend`
and the first lines of `gnsweep analyze` print, and the sentence of the report's answer box.
Pure: a dict in, text out.
"""

from __future__ import annotations

import math
from typing import Any

from gnsweep.analysis.setting import counted
from gnsweep.report.answers import rounded

LR_WORDS = {"fit": "eq. 2.7 fit", "interpolated": "interpolated", "measured": "measured"}


def _num(value: Any) -> float:
    return float(value) if value is not None else math.nan


def batch_text(rec: dict[str, Any], batch: Any = None, samples: Any = None) -> str:
    """'1,024 tokens (8 sequences a step)' for a task in tokens, '64 examples' otherwise."""
    unit = rec.get("unit") or "examples"
    b = _num(rec.get("batch_size") if batch is None else batch)
    n = int((rec.get("batch_size_samples") or 0) if samples is None else samples)
    text = counted(b, unit)
    if unit != "examples" and _num(rec.get("per_sample")) != 1.0:
        text += f" ({counted(n, 'sequences')} a step)"
    return text


MULTIPLE_WORDS = {4.0: "4 B_crit", 1.0: "B_crit", 0.25: "B_crit/4"}


def clipped_text(rec: dict[str, Any]) -> str:
    """Where the preference's batch lies below the smallest a run can take: what it would have
    been, and that the costs are the smallest batch's ("" otherwise)."""
    if not rec.get("clipped"):
        return ""
    multiple = _num(rec.get("multiple"))
    name = MULTIPLE_WORDS.get(multiple, f"{multiple:g} B_crit")
    unit = rec.get("unit") or "examples"
    preferred = counted(_num(rec.get("batch_size_preferred")), unit)
    return (f" {rec.get('prefer')}'s {name} = {preferred}"
            f" lies below the smallest batch a run can take ({batch_text(rec)}): the batch is "
            "that one, and the costs are eq. 2.11's there, not the preference's.")


def lr_text(rec: dict[str, Any]) -> str:
    """The learning rate with its interval or its bound, and where it comes from."""
    lr, lo, hi = (_num(rec.get(k)) for k in ("learning_rate", "learning_rate_low",
                                              "learning_rate_high"))
    status = rec.get("lr_status") or ""
    reason = rec.get("lr_reason") or ""
    if status in LR_WORDS and math.isfinite(lr):
        interval = (f", 95% {lo:.3g}..{hi:.3g}" if math.isfinite(lo) and math.isfinite(hi)
                    and status == "fit" else "")
        return f"learning rate {lr:.3g} ({LR_WORDS[status]}{interval}; {reason})"
    if status == "not_measured":
        return f"the learning rate you tuned there ({reason})"
    if status == "lower_bound" and math.isfinite(lo):
        return f"learning rate above {lo:.3g} ({reason})"
    if status == "upper_bound" and math.isfinite(hi):
        return f"learning rate below {hi:.3g} ({reason})"
    return f"no learning rate ({reason or 'none measured'})"


def summary(rec: dict[str, Any], what: str = "loss") -> str:
    """One sentence: the setting, its cost, or why there is none."""
    status = rec.get("status")
    target = rec.get("target")
    at = f"{what} {target:g}" if target is not None else what
    unit = rec.get("unit") or "examples"
    if status == "refused":
        return f"No recommendation at {at}: {rec.get('reason') or 'no fit'}."
    steps, examples = _num(rec.get("steps")), _num(rec.get("examples"))
    if rec.get("bcrit_status") == "below_smallest":
        cost = (f"; measured there: {rounded(steps)} steps, {rounded(examples)} {unit}"
                if math.isfinite(steps) else "")
        if status == "fit":
            return (f"Train at {at} with batch size {batch_text(rec)} and {lr_text(rec)}{cost}. "
                    f"Why: {rec.get('reason')}.")
        return (f"At {at}: batch size {batch_text(rec)}, {lr_text(rec)}{cost}. Why: "
                f"{rec.get('reason')}; run the next grid for the learning rate.")
    if status == "fit" or rec.get("bcrit_status") in ("fit", "thin"):
        lo, hi = _num(rec.get("batch_size_low")), _num(rec.get("batch_size_high"))
        interval = (f" (B_crit's 95% interval gives {rounded(lo)}..{rounded(hi)})"
                    if math.isfinite(lo) and math.isfinite(hi) else "")
        cost = (f"about {rounded(steps)} steps and {rounded(examples)} {unit} "
                f"({_num(rec.get('steps_over_min')):.3g} S_min, "
                f"{_num(rec.get('examples_over_min')):.3g} E_min, eq. 2.11)")
        if status == "fit":
            return (f"Train at {at} ({rec.get('prefer')}) with batch size {batch_text(rec)}"
                    f"{interval} and {lr_text(rec)}: {cost}.{clipped_text(rec)}")
        return (f"At {at} ({rec.get('prefer')}) the fit gives batch size {batch_text(rec)}"
                f"{interval} and {lr_text(rec)}: {cost}.{clipped_text(rec)} Not settled: "
                f"{rec.get('reason')}; run the next grid.")
    side = rec.get("batch_size_side")
    size = batch_text(rec)
    if side == "at_least":
        size = f"at least {size}"
    elif side == "at_most":
        size = f"at most {size}"
    cost = (f"; measured there: {rounded(steps)} steps, {rounded(examples)} {unit}"
            if math.isfinite(steps) else "")
    return (f"Only a bound at {at}: batch size {size}, {lr_text(rec)}{cost}. "
            f"Why: {rec.get('reason')}.")


def lines(rec: dict[str, Any], what: str = "loss") -> list[str]:
    """The recommendation, its tradeoff table (eq. 2.11) and the line for the next launch."""
    out = ["recommendation: " + summary(rec, what)]
    unit = rec.get("unit") or "examples"
    tokens = unit != "examples" and _num(rec.get("per_sample")) != 1.0
    table = rec.get("tradeoff") or []
    if table:
        out.append("tradeoff (eq. 2.11: S = S_min (1 + B_crit/B), E = E_min (1 + B/B_crit)):")
        head = f"  {'B/B_crit':>8} {'batch (' + unit + ')':>16}"
        head += f" {'sequences':>10}" if tokens else ""
        out.append(head + f" {'steps':>10} {'x S_min':>8} {unit:>14} {'x E_min':>8}")
        for row in table:
            # The rounded batch's own multiple (a clipped row is not the multiple asked for).
            ratio = _num(row.get("b_over_bcrit", row["multiple"]))
            line = f"  {ratio:>8.3g} {row['batch_size']:>16,.0f}"
            line += f" {row['batch_size_samples']:>10,}" if tokens else ""
            out.append(line + f" {rounded(row['steps']):>10} {row['steps_over_min']:>8.3g} "
                              f"{rounded(row['examples']):>14} {row['examples_over_min']:>8.3g}")
    grid = rec.get("next_grid") or {}
    if grid.get("runs"):
        out.append(f"next grid ({len(grid['runs'])} runs: {grid.get('reason')}): "
                   + ", ".join(f"b={r['batch_size']} lr={r['learning_rate']:g}"
                               for r in grid["runs"]))
    if rec.get("launch"):
        out.append(f"next launch: {rec['launch']}")
    return out
