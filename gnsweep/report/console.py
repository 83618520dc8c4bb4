"""The analysis as printed by `gnsweep analyze` (one line per target with standard errors; a branch
sweep's local B_crit per point; the along and adaptive schedules against the fixed batch sizes)
and the comparison as printed by `gnsweep compare`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from gnsweep.analysis.along import point_name, tolerance_answer
from gnsweep.analysis.bounds import bound_text
from gnsweep.report.answers import robustness, verdict
from gnsweep.report.views import preconditioned


def format_fits(fits: pd.DataFrame, loss_scaling: pd.DataFrame | None = None,
                group_by: str | None = None, front: pd.DataFrame | None = None) -> str:
    """The printed table: one line per target, figures with their standard errors, and under a
    fitted B_crit the report's robustness sentence (`answers.robustness`, judged against the
    batch sizes of `front` that reached the target, as the report judges it); with `group_by`,
    one block per group under its name."""
    if group_by is not None and group_by in fits:
        blocks = []
        for value in pd.unique(fits[group_by].astype(str)):
            rows = fits[fits[group_by].astype(str) == value].drop(columns=[group_by])
            scaling = None
            if loss_scaling is not None and group_by in loss_scaling:
                scaling = loss_scaling[loss_scaling[group_by].astype(str) == value]
            blocks.append(f"{group_by} {value}:\n" + format_fits(rows, scaling))
        return "\n".join(blocks)
    precond = preconditioned(fits)  # an adaptive optimizer's B_simple_P, not SGD's copy
    header = (f"{'target':>8} {'#B':>3} {'S_min':>16} {'E_min':>18} {'B_crit':>16} "
              f"{'B_simple':>16} {'B_crit/B_simple':>15} {'B_noise(lr)':>16}"
              + (f" {'B_crit/B_simple_P':>17}" if precond else ""))
    lines = [header]
    footnote = False
    for row in fits.itertuples(index=False):
        bound = bound_text(str(getattr(row, "bcrit_status", "")),
                           float(getattr(row, "b_crit_bound", np.nan)))
        if bound:  # what the points do fix, and B_crit as the bound it is
            lines.append(
                f"{row.target:>8g} {row.n_batch_sizes:>3} {_pm(row.s_min, row.s_min_se):>16} "
                f"{_pm(row.e_min, row.e_min_se):>18} {bound:>16} "
                f"{_pm(row.b_simple_mean, row.b_simple_mean_se):>16} {'-':>15} "
                f"{_pm(row.b_noise_lr, row.b_noise_lr_se):>16}")
            lines.append(f"{'':>12} {row.refused}")
            continue
        if row.refused:
            lines.append(f"{row.target:>8g} {row.n_batch_sizes:>3} no fit: {row.refused}")
            continue
        b_crit = _pm(row.b_crit, row.b_crit_se)
        b_simple = _pm(row.b_simple_mean, row.b_simple_mean_se)
        ratio = _pm(row.ratio, row.ratio_se, ".2f")
        if not np.isfinite(row.b_simple_mean) and np.isfinite(row.b_simple_at_target):
            # Only B_simple at the target is known (e.g. a steps table): say so.
            b_simple = _pm(row.b_simple_at_target, row.b_simple_at_target_se) + "*"
            ratio = _pm(row.ratio_at_target, row.ratio_at_target_se, ".2f") + "*"
            footnote = True
        lines.append(
            f"{row.target:>8g} {row.n_batch_sizes:>3} {_pm(row.s_min, row.s_min_se):>16} "
            f"{_pm(row.e_min, row.e_min_se):>18} {b_crit:>16} {b_simple:>16} {ratio:>15} "
            f"{_pm(row.b_noise_lr, row.b_noise_lr_se):>16}"
            + (f" {_pm(row.ratio_precond, row.ratio_precond_se, '.2f'):>17}" if precond
               else ""))
        note = robustness(row, verdict(row, front)).strip()
        if note:  # the report's sentence, word for word: the two never disagree
            lines.append(f"{'':>12} {note}")
        if row.n_bootstrap:
            lines.append(f"{'':>12} 95% bootstrap ({row.n_bootstrap}): B_crit "
                         f"[{row.b_crit_lo:.4g}, {row.b_crit_hi:.4g}], S_min "
                         f"[{row.s_min_lo:.4g}, {row.s_min_hi:.4g}], E_min "
                         f"[{row.e_min_lo:.4g}, {row.e_min_hi:.4g}]")
    if footnote:
        lines.append("* B_simple at the target (no S_min-weighted mean was given)")
    if loss_scaling is not None and len(loss_scaling):
        scaling = loss_scaling.iloc[0]
        if scaling["refused"]:
            if len(fits) > 1:  # with one target there is no law to fit: nothing to say
                lines.append(f"B_crit(L): no fit: {scaling['refused']}")
        else:
            b_star = _b_star(float(scaling["b_star"]), float(scaling["b_star_se"]))
            alpha_b = _pm(scaling["alpha_b"], scaling["alpha_b_se"], ".3g")
            lines.append(f"B_crit(L) = B*/L^(1/alpha_B): B* {b_star}, alpha_B {alpha_b} "
                         f"({int(scaling['n_targets'])} targets)")
    return "\n".join(lines)


def _b_star(value: float, error: float) -> str:
    """B*, the line's value at L = 1, lies far outside the targets where they are far from 1:
    its error is a factor (the line's log-scale error), written so once it exceeds the value
    ("7e+07 x/÷ 22"), never as a +- reaching below zero."""
    if np.isfinite(value) and np.isfinite(error) and value > 0 and error > value:
        return f"{value:.2g} x/÷ {math.exp(error / value):.2g} (extrapolated to L = 1)"
    return _pm(value, error)


def _pm(value: float, error: float, spec: str = ".4g") -> str:
    if not np.isfinite(value):
        return "-"
    if not np.isfinite(error):
        return format(value, spec)
    return f"{format(value, spec)} ± {error:.2g}"


def format_compare(table: pd.DataFrame) -> str:
    """The comparison (`gnsweep compare`'s table) as plain text for the console: a B_crit that
    the sweep only bounds as the bound ("> 4096"), and why any other target has no fit."""
    precond = preconditioned(table)
    head = ["task", "sweep", "target", "B_crit", "B_simple (mean)", "ratio",
            *(["ratio (P)"] if precond else []), "unit"]
    rows, notes = [], []
    for row in table.itertuples(index=False):
        bound = bound_text(str(getattr(row, "bcrit_status", "") or ""),
                           float(getattr(row, "b_crit_bound", math.nan)))
        at = float(getattr(row, "at_examples", math.nan))  # a branch sweep's point
        sweep = f"{row.sweep} @{at:,.0f}" if math.isfinite(at) else str(row.sweep)
        cells = [str(row.task), sweep, f"{row.target:.4g}",
                 bound or _pm(row.b_crit, row.b_crit_se),
                 _pm(row.b_simple_mean, row.b_simple_mean_se), _pm(row.ratio, row.ratio_se)]
        if precond:  # B_crit / B_simple_P where an adaptive optimizer's was logged
            cells.append(_pm(row.ratio_precond, row.ratio_precond_se))
        rows.append([*cells, str(row.unit)])
        notes.append("" if bound or not row.refused else f"no fit: {row.refused}")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    right = {2}  # the target, a number

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    out = [line(head)]
    for cells, note in zip(rows, notes, strict=True):
        out.append(line(cells) + (f"  ({note})" if note else ""))
    return "\n".join(out)


def format_along(along: pd.DataFrame, unit: str = "examples") -> str:
    """The local B_crit table as `gnsweep analyze` prints it: per branch point a line naming it
    with the tolerance rule's answer, then one line per target (the fit of eq. 2.11)."""
    lines = [f"critical batch size along training ({unit}):"]

    def num(value: float) -> str:
        return f"{value:.4g}" if np.isfinite(value) else "-"

    for _, rows in along.groupby("at_examples", sort=True):
        first = next(rows.itertuples(index=False))
        window = (f"window {first.window:,.0f} {unit}, tolerance {first.tolerance:g}"
                  if np.isfinite(first.window) else f"tolerance {first.tolerance:g}")
        lines.append(f"at {point_name(first, unit)}, loss there {first.at_loss:.4g}: by "
                     f"tolerance ({window}): {tolerance_answer(first, unit)}")
        lines.append(f"{'target':>10} {'value':>9} {'#B':>3} {'S_min':>14} "
                     f"{'B_crit (2.11)':>16} {'base B_simple':>14} {'base B_noise':>13}  note")
        for row in rows.itertuples(index=False):
            if not np.isfinite(row.target):
                lines.append(f"{'-':>10} {'-':>9}  {row.refused}")
                continue
            b_crit = bound_text(row.bcrit_status, row.b_crit_bound) or _pm(row.b_crit,
                                                                          row.b_crit_se)
            lines.append(f"{row.target:>10.4g} {row.target_value:>9.4g} {row.n_batch_sizes:>3} "
                         f"{_pm(row.s_min, row.s_min_se):>14} "
                         f"{b_crit:>16} "
                         f"{num(row.b_simple):>14} "
                         f"{num(row.b_noise):>13}  {row.refused or row.quality}")
    return "\n".join(lines)


def format_schedule(table: pd.DataFrame) -> str:
    """The console lines of the along runs: steps and examples against the fastest fixed B."""
    return _per_run("batch size following the measured B_crit (sweep.schedule=along) against "
                    "the fastest fixed batch size:", table, lambda row: (
                        f"S {row.steps:.4g}, E {row.examples:.4g} (mean B "
                        f"{row.mean_batch:.3g}); fixed B {row.best_batch:g} at lr "
                        f"{row.best_lr:g}: S {row.best_steps:.4g}, E {row.best_examples:.4g}; "
                        f"steps x{row.steps_ratio:.3g}, examples x{row.examples_ratio:.3g}; "
                        f"fixed-batch front at its examples: S {row.front_steps:.4g} "
                        f"(x{row.front_ratio:.3g})"))


def format_adaptive(table: pd.DataFrame) -> str:
    """The console lines: one per adaptive run and target."""
    if table is None or not len(table):
        return ""
    return _per_run("adaptive batch size (appendix D): gain = E_fixed / E at equal S", table,
                    lambda row: (
                        f"S {row.steps:.4g}, E {row.examples:.4g} (mean B "
                        f"{row.mean_batch:.3g}), gamma {row.gamma:.3f} ({row.noise_source}), "
                        f"gain predicted {_num(row.gain_predicted)}, measured "
                        f"{_num(row.gain_measured)} (front product {_num(row.front_product)} "
                        "vs gamma)"))


def _per_run(title: str, table: pd.DataFrame, reached: Callable[[Any], str]) -> str:
    """A title, then a line per run and target: what `reached` says of it, or why not."""
    lines = [title]
    for row in table.itertuples(index=False):
        head = f"{row.target:>8g} {row.run_id}"
        lines.append(f"{head}: {reached(row)}" if row.reached
                     else f"{head}: not reached ({row.state})")
    return "\n".join(lines)


def _num(value: float) -> str:
    return f"{value:.3g}" if np.isfinite(value) else "-"
