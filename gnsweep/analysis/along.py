"""The critical batch size along training, from short runs branched off one long run.

A sweep from initialisation measures B_crit over the whole path to a target: an S_min-weighted
mean of the noise scale over every phase before it (DESIGN.md). The local question (how large
may the batch be *at this point* of my run?) is answered by branching (Merrill et al. 2025):
from a checkpoint of the base run after N examples, a batch size x learning rate grid of short
runs starts from that state with its own step and example counters, to targets relative to the
point. Each branch point is then analyzed as a sweep of its own (`pipeline.analyze_steps`: steps
to target, the best learning rate per batch size, the fit of eq. 2.11), so its local S_min,
E_min and B_crit = E_min/S_min (eq. 2.12) come with the same standard errors.

Targets relative to the point: a fraction f of the base run's smoothed loss L there (f = 0.9:
ten per cent below it); for a metric that rises (a return) the mirror, L + (1 - f)|L|. Short
hops (f near 1) keep the local B_crit local; McCandlish et al.'s theory puts it at the local
B_noise (eq. 2.8), so the base run's B_simple (eq. 2.9) and B_noise at the point sit beside it.

Pure: curves and branch points in, tables out (`gnsweep.branching` does the I/O).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from gnsweep.analysis.adaptive import subset
from gnsweep.analysis.bounds import FIT, LOWER_BOUND, UPPER_BOUND
from gnsweep.analysis.groups import combine
from gnsweep.analysis.pipeline import AnalysisError, analyze_steps, ratio_with_error
from gnsweep.analysis.results import Results
from gnsweep.analysis.smoothing import SMOOTHING_FRACTION
from gnsweep.analysis.steps import Curves, loss_curve, noise_rows, steps_to_target
from gnsweep.tables import columns
from gnsweep.targets import FALLING, Direction

GROUP = "at_examples"
"""The runs-table column naming a branch run's point (examples the base run had seen), and the
column the per-point tables are grouped by (`analysis.groups`)."""
ALONG_COLUMNS = columns("along")
"""along.parquet: one row per (branch point, target). `target` is the fraction of `branch.targets`,
`target_value` the loss (or metric) it stands for at that point; `b_simple`, `b_noise` the base
run's noise scales at the point; `ratio` = b_crit / b_simple, `ratio_noise` = b_crit / b_noise;
`b_simple_mean`, `b_noise_mean` the branch runs' own S_min-weighted means up to the target
(median over the best runs, as in fits.parquet); `b_simple_precond`, `ratio_precond`,
`b_simple_precond_mean` the same for B_simple in the optimizer's preconditioner (docs/noise.md).
`target_source` says where the target came
from: "set" (`branch.targets`) or "auto" (`auto_targets`: from the losses the point's runs
reached; `target` is then the fraction of the loss at the point it stands for).

The second definition (Merrill et al. 2025, `tolerance_b_crit`), the same on every row of a
point: `window` the examples every batch size trained from the point, `b_crit_tol` the largest
batch size whose loss after that window the best smaller batch size reached within (1 -
`tolerance`) x the window's examples (interpolated in log B between `b_crit_tol_lo`, the last
within tolerance, and
`b_crit_tol_hi`, the first outside); `tol_refused` says why it is NaN or a bound ("all batch
sizes within tolerance: above 512" keeps `b_crit_tol_lo` = 512).

`bcrit_status` (fit, lower_bound, upper_bound, refused), `bcrit_reason` and `b_crit_bound` as in
fits.parquet: a local B_crit of eq. 2.11 outside what the point's batch sizes support is a bound
or refused, with NaN in `b_crit`."""
AUTO_QUANTILES = (0.3, 0.5, 0.7)
"""Automatic targets: these shares of the loss decrease that most batch sizes achieve over the
window (`auto_targets`), from the most local (0.3) to the hardest one half the batch sizes,
and at least 3, still reach."""
AUTO_MIN_BATCH_SIZES = 3
"""An automatic target is one that at least this many batch sizes (or all, when fewer) reach."""
BASE_COLUMNS = columns("along_base")
"""along_base.parquet: the base run's smoothed loss and noise scales per logged row (for the
figure: the noise scale the local B_crit is compared with, over the whole run)."""


@dataclass(frozen=True)
class BranchPoint:
    """Where branch runs start: a kept checkpoint of the base run."""

    at_examples: int
    """Examples the base run had seen at the checkpoint (the point's name)."""
    at_step: int
    """Optimizer steps the base run had taken there."""
    at_loss: float
    """The base run's smoothed loss (or metric) at the point: what the targets are relative to."""
    b_simple: float = math.nan
    """The base run's B_simple at the point (eq. 2.9), NaN where not measured."""
    b_noise: float = math.nan
    """The base run's B_noise at the point (eq. 2.8), NaN where not measured."""
    b_simple_precond: float = math.nan
    """The base run's B_simple in its optimizer's preconditioner, NaN where not measured."""


def base_curve(base: Curves, loss: str = "smoothed") -> pd.DataFrame:
    """The base run's rows for the figure and for its branch points: updates, examples, the
    smoothed loss the analysis reads (`steps.loss_curve`: the lag-free centred smoother) and the
    noise scales (`steps.noise_rows`: probes where run, else the training loop's EMA).

    `step` is the number of updates behind the row's value (`loss_curve`: s - 1 for the
    training loss logged at step s, s for the eval loss), the count a checkpoint after that many
    updates is compared with, and `examples` the examples seen by then."""
    if len(base.runs) != 1:
        raise AnalysisError(f"a base run is one run; got {len(base.runs)}")
    x, values = loss_curve(base, loss)
    step, examples = base.columns["step"], base.columns["examples"]
    per_step = np.divide(examples, step, out=np.full(len(step), np.nan), where=step > 0)
    return pd.DataFrame({"step": x, "examples": per_step * x, "loss": values,
                         "b_simple": noise_rows(base, "simple"),
                         "b_noise": noise_rows(base, "noise"),
                         "b_simple_precond": base.columns["b_simple_precond"]})


def branch_point(base: pd.DataFrame, at_step: int, at_examples: int) -> BranchPoint:
    """The base run at a checkpoint after `at_step` updates (`base_curve`'s rows): its smoothed
    loss interpolated there (NaN where that loss was not logged, e.g. an eval loss), and the
    noise scales of the nearest row at or before it (a noise scale is an average over a window;
    interpolating it adds nothing)."""
    x = base["step"].to_numpy(float)
    loss = base["loss"].to_numpy(float)
    logged = x[np.isfinite(x)]
    if not len(logged) or at_step < logged.min() or at_step > logged.max():
        raise AnalysisError(f"the base run's logged rows do not cover step {at_step} (they span "
                            f"{_span(logged)}): branch from a point it has logged")
    ok = np.isfinite(x) & np.isfinite(loss)
    at_loss = float(np.interp(at_step, x[ok], loss[ok])) if ok.any() else math.nan
    before = np.flatnonzero(x <= at_step)
    row = base.iloc[int(before[-1])] if len(before) else base.iloc[0]
    return BranchPoint(int(at_examples), int(at_step), at_loss, float(row["b_simple"]),
                       float(row["b_noise"]),
                       float(row["b_simple_precond"]) if "b_simple_precond" in row
                       else math.nan)


def _span(x: np.ndarray) -> str:
    return f"{x.min():g}..{x.max():g}" if len(x) else "nothing"


def analyze_along(curves: Curves, points: list[BranchPoint], fractions: list[float] | None, *,
                  loss: str = "smoothed", ema_examples: float | None = None,
                  bootstrap: int = 0, optimizer: str = "sgd", direction: Direction = FALLING,
                  source: str = "branch", window: float = 0.0,
                  tolerance: float = 0.5, unit: str = "examples") -> Results:
    """One analysis per branch point (runs whose `at_examples` column names it) to its relative
    targets, put together grouped by `at_examples` (`analysis.groups`), with `along`: one row
    per (point, target), ALONG_COLUMNS.

    `fractions` empty or None: each point's targets are chosen from the losses its runs reached
    (`auto_targets`). Beside the fit of eq. 2.11 every row carries the point's local B_crit by
    tolerance (`tolerance_b_crit`) over `window` examples (0: the examples every batch size
    covered, `common_window`). `unit`: the task's example unit, in which the warnings name
    each branch point (tokens for a language model).

    A target that no run of its point reached, or a point without runs, keeps its row with
    `refused` saying why and NaN estimates: marked, never dropped, and never fitted on a subset
    that would read as a local B_crit.
    """
    if GROUP not in curves.runs:
        raise AnalysisError(f"{source}: the runs name no branch point (no {GROUP} column); "
                            "a branch sweep is written by `gnsweep branch`")
    automatic = not fractions
    fractions = sorted((float(f) for f in fractions or []), reverse=True)
    at = curves.runs[GROUP].to_numpy(np.int64)
    parts: dict[str, Results] = {}
    rows: list[dict] = []
    warnings: list[str] = []
    for point in sorted(points, key=lambda p: p.at_examples):
        sub = subset(curves, at == point.at_examples)
        why = f"no branch runs from {point.at_examples} {unit}" if not len(sub.runs) else ""
        tol = _tolerance_columns(sub, point, loss, ema_examples, direction, window,
                                 tolerance) if not why else _no_tolerance(why, tolerance)
        if automatic:
            values = [] if why else auto_targets(sub, point.at_loss, loss, ema_examples,
                                                 direction)
            if not values and not why:
                why = (f"no batch size moved the {loss} loss past the point's "
                       f"{point.at_loss:.4g} on {AUTO_MIN_BATCH_SIZES} or more of its runs' "
                       "batch sizes: train longer (branch.window_steps) or check the "
                       "learning rates")
            point_fractions = [fraction_of(point.at_loss, v, direction) for v in values]
        else:
            values = [direction.relative_target(point.at_loss, f) for f in fractions]
            point_fractions = fractions
        fits = front = pd.DataFrame()
        if why and not values:
            row = _row(point, math.nan, math.nan, fits, len(sub.runs), why)
            row.update(tol, target_source="auto" if automatic else "set")
            warnings.append(f"branch point {point.at_examples} {unit}: {why}")
            rows.append(row)
            continue
        if not why:
            steps = steps_to_target(sub, None, values, loss=loss, ema_examples=ema_examples,
                                    direction=direction)
            started = _reached_at_start(steps, sub, loss)
            if started.any():
                warnings.append(
                    f"branch point {point.at_examples} {unit}: {int(started.sum())} (run, "
                    "target) pairs read as reached at their first logged row, left out: the "
                    "smoother's window at a run's start reaches into later rows, so that reading "
                    "is not a measurement")
            reached = [v for v in values if steps.loc[steps["target"] == v, "reached"].any()]
            if reached:
                part = analyze_steps(
                    steps[steps["target"].isin(reached)].reset_index(drop=True), reached,
                    bootstrap=bootstrap, optimizer=optimizer,
                    meta={"source": source, "loss": loss, "ema_examples": ema_examples,
                          **direction.to_meta(),
                          "smoothing": SMOOTHING_FRACTION if loss == "smoothed"
                          and not ema_examples else None})
                parts[str(point.at_examples)] = part
                fits, front = part.fits, part.front
        for fraction, value in zip(point_fractions, values, strict=True):
            row = _row(point, fraction, value, fits, len(sub.runs), why, front)
            row.update(tol, target_source="auto" if automatic else "set")
            fitted = len(fits) and (fits["target"] == value).any()
            if row["refused"] and not fitted:  # a refused fit has warned in its part already
                warnings.append(f"branch point {point.at_examples} {unit}, target "
                                f"{fraction:g} ({value:.4g}): {row['refused']}")
            rows.append(row)
    if parts:
        result = combine(parts, GROUP)
    else:
        raise AnalysisError(f"{source}: no branch point has a run that reached a target "
                            f"({len(points)} point(s), targets "
                            f"{fractions or 'automatic'}); train longer or "
                            "choose fractions closer to 1 (branch.targets)")
    result.warnings = warnings + result.warnings
    result.meta.update(source=source, branch_targets=fractions or "auto",
                       branch_tolerance=tolerance)
    result.along = pd.DataFrame(rows, columns=ALONG_COLUMNS)
    return result


def fraction_of(at_loss: float, value: float, direction: Direction = FALLING) -> float:
    """The fraction of `branch.targets` a target value stands for at a point of loss `at_loss`
    (the inverse of `Direction.relative_target`)."""
    if direction.rises:
        return 1.0 - (value - at_loss) / abs(at_loss) if at_loss else math.nan
    return value / at_loss if at_loss else math.nan


def run_windows(curves: Curves, loss: str, ema_examples: float | None = None
                ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per run, (examples, loss) of its logged rows read as the analysis reads them
    (`steps.loss_curve`): the examples at the number of updates behind each value, and the
    value, finite rows only."""
    x, values = loss_curve(curves, loss, ema_examples)
    step, examples = curves.columns["step"], curves.columns["examples"]
    out = []
    for i in range(len(curves.runs)):
        lo, hi = curves.offsets[i], curves.offsets[i + 1]
        seen = np.interp(x[lo:hi], np.concatenate([[0.0], step[lo:hi]]),
                         np.concatenate([[0.0], examples[lo:hi]]))
        ok = np.isfinite(seen) & np.isfinite(values[lo:hi])
        out.append((seen[ok], values[lo:hi][ok]))
    return out


def auto_targets(curves: Curves, at_loss: float, loss: str, ema_examples: float | None = None,
                 direction: Direction = FALLING) -> list[float]:
    """Targets chosen from what a point's branch runs reached, easiest first: AUTO_QUANTILES
    of the loss decrease below the point that the k-th best batch size achieves (each batch
    size at its best learning rate, k = max(3, half the batch sizes), or all when fewer), so
    that at least k batch sizes reach every target. Fixed fractions of a loss are reached in
    under a step by some batch sizes and never by others; these are reached by several.
    [] when fewer than k batch sizes got below the point."""
    sign = direction.sign
    best: dict[float, float] = {}
    for (_seen, values), batch in zip(run_windows(curves, loss, ema_examples),
                                     curves.runs["batch_size"].to_numpy(float), strict=True):
        # Past the first row: the first reading is the smoother's, not a step's (as the
        # reached-at-start rule, `_reached_at_start`).
        if len(values) > 1:
            lowest = float(np.min(sign * values[1:]))
            best[batch] = min(best.get(batch, math.inf), lowest)
    drops = sorted((sign * at_loss - v for v in best.values()), reverse=True)
    k = min(len(drops), max(AUTO_MIN_BATCH_SIZES, math.ceil(len(drops) / 2)))
    if k < min(AUTO_MIN_BATCH_SIZES, len(drops)) or not drops or drops[k - 1] <= 0:
        return []
    drop = drops[k - 1]
    return [at_loss - sign * q * drop for q in AUTO_QUANTILES]


def common_window(curves: Curves, loss: str, ema_examples: float | None = None) -> float:
    """The examples every batch size covered from the point: over batch sizes, the least of
    the most examples any of its runs that did not diverge logged (a run stopped at its target
    covers less than one trained to its budget). 0 when no run logged a row."""
    covered: dict[float, float] = {}
    states = curves.runs["state"].astype(str).to_numpy()
    for (seen, _), batch, state in zip(run_windows(curves, loss, ema_examples),
                                       curves.runs["batch_size"].to_numpy(float), states,
                                       strict=True):
        if state != "diverged" and len(seen):
            covered[batch] = max(covered.get(batch, 0.0), float(seen[-1]))
    return min(covered.values()) if covered else 0.0


def tolerance_b_crit(batch_sizes: np.ndarray, efficiencies: np.ndarray, tolerance: float
                     ) -> tuple[float, float, float, str]:
    """The local critical batch size by tolerance (Merrill et al. 2025): scanning up from the
    smallest batch size, the largest whose efficiency stays at least 1 - tolerance; (value,
    last within, first outside, reason). `efficiencies[i]`: the share of the window's examples
    the best smaller batch size needed to reach batch size i's loss after the window
    (`window_efficiencies`; 1 for the smallest, and for a batch that beat every smaller one).
    The value is the crossing interpolated in log B between the last within and the first
    outside; NaN with a reason where there is none (every batch size within tolerance: a bound
    above the largest).

    Why this reading of "within a tolerance of the best smaller batch's loss": a loss gap means
    little by itself (it depends on the loss's scale and on how fast it falls there); the
    examples the smaller batch needed to close it are the token efficiency the definition is
    about. With eq. 2.11 a batch B needs E_min (1 + B/B_crit) examples for what E_min buys at a
    batch far below B_crit, so its efficiency is 1 / (1 + B/B_crit) and tolerance 0.5 puts the
    crossing at B_crit itself, however the loss falls over the window."""
    order = np.argsort(batch_sizes)
    b = np.asarray(batch_sizes, float)[order]
    r = np.asarray(efficiencies, float)[order]
    ok = np.isfinite(r)
    b, r = b[ok], r[ok]
    if len(b) < 2:
        return math.nan, math.nan, math.nan, (
            f"{len(b)} batch size(s) with a loss at the window's end; the tolerance rule "
            "compares at least 2")
    floor = 1.0 - tolerance
    for i in range(1, len(b)):
        if r[i] < floor:
            lo, hi = min(r[i - 1], 1.0), r[i]
            share = (lo - floor) / (lo - hi) if lo > hi else 0.0
            share = min(max(share, 0.0), 1.0)
            value = float(np.exp(np.log(b[i - 1]) + share * (np.log(b[i]) - np.log(b[i - 1]))))
            return value, float(b[i - 1]), float(b[i]), ""
    return math.nan, float(b[-1]), math.inf, (
        f"all batch sizes within tolerance: above {b[-1]:g}")


def window_efficiencies(batch_sizes: np.ndarray, curves: list[tuple[np.ndarray, np.ndarray]],
                        window: float) -> np.ndarray:
    """Per batch size (sorted ascending, one curve each: its best learning rate's (examples,
    loss), lower is better), the share of `window` examples the best smaller batch size (the
    lowest loss at the window among the smaller ones) needed to first reach this batch size's
    loss at the window: 1 for the smallest and wherever it did not get that low (this batch
    beat it), NaN where this batch size has no loss at the window."""
    at_window = np.array([_value_at(seen, values, window) for seen, values in curves])
    out = np.full(len(curves), np.nan)
    for i in range(len(curves)):
        if not np.isfinite(at_window[i]):
            continue
        smaller = [j for j in range(i) if np.isfinite(at_window[j])]
        if not smaller:
            out[i] = 1.0
            continue
        seen, values = curves[min(smaller, key=lambda j: at_window[j])]
        below = np.flatnonzero(values <= at_window[i])
        if not len(below):
            out[i] = 1.0
            continue
        k = int(below[0])
        if k == 0:
            out[i] = seen[0] / window
            continue
        # Interpolated between the rows on either side of the first crossing.
        v0, v1 = values[k - 1], values[k]
        share = (v0 - at_window[i]) / (v0 - v1) if v0 > v1 else 1.0
        out[i] = min((seen[k - 1] + share * (seen[k] - seen[k - 1])) / window, 1.0)
    _ = batch_sizes
    return out


def _value_at(seen: np.ndarray, values: np.ndarray, window: float) -> float:
    """A run's value at `window` examples; NaN when its rows stop short of it by more than
    1/16 (diverged, failed, or stopped at a target before it)."""
    if not len(seen) or seen[-1] < window * (1 - 1 / 16):
        return math.nan
    return float(np.interp(min(window, seen[-1]), seen, values))


def _tolerance_columns(curves: Curves, point: BranchPoint, loss: str,
                       ema_examples: float | None, direction: Direction, window: float,
                       tolerance: float) -> dict:
    """The tolerance rule's columns of one point: per batch size its best learning rate's run
    at `window` examples (0: `common_window`), through `window_efficiencies` and
    `tolerance_b_crit`."""
    window = float(window) or common_window(curves, loss, ema_examples)
    out = _no_tolerance("", tolerance)
    out["window"] = window
    if not window > 0:
        out["tol_refused"] = "no run logged a loss after its point"
        return out
    sign = direction.sign
    best: dict[float, tuple[float, tuple[np.ndarray, np.ndarray]]] = {}
    for (seen, values), batch in zip(run_windows(curves, loss, ema_examples),
                                     curves.runs["batch_size"].to_numpy(float), strict=True):
        at = _value_at(seen, sign * values, window)
        if np.isfinite(at) and (batch not in best or at < best[batch][0]):
            best[batch] = (at, (seen, sign * values))
    if not best:
        out["tol_refused"] = f"no run covered the window of {window:,.4g} examples"
        return out
    sizes = np.array(sorted(best))
    if best[sizes[0]][0] >= sign * point.at_loss and all(
            v[0] >= sign * point.at_loss for v in best.values()):
        out["tol_refused"] = "no batch size lowered the loss over the window"
        return out
    efficiencies = window_efficiencies(sizes, [best[b][1] for b in sizes], window)
    value, lo, hi, why = tolerance_b_crit(sizes, efficiencies, tolerance)
    out.update(b_crit_tol=value, b_crit_tol_lo=lo, b_crit_tol_hi=hi, tol_refused=why)
    return out


def _no_tolerance(why: str, tolerance: float) -> dict:
    return {"window": math.nan, "b_crit_tol": math.nan, "b_crit_tol_lo": math.nan,
            "b_crit_tol_hi": math.nan, "tolerance": tolerance, "tol_refused": why}


def _reached_at_start(steps: pd.DataFrame, curves: Curves, loss: str) -> np.ndarray:
    """Mark (in place) the steps rows that reach their target at the run's first logged row as
    not reached (outcome `at_start`); returns which rows were marked.

    A branch run starts where its target is typically a few per cent away, and the centred
    smoother's window at the first row is cut to the rows after it: on a falling curve its
    value there lies below the loss at the point, so a target can read as reached before any
    step (S = 0 or 1 update, which the fit of eq. 2.11 would take as the truth). A run from
    initialisation never meets this: its targets lie far below where it starts."""
    first = curves.columns["step"][curves.offsets[:-1][curves.lengths > 0]]
    first_x = pd.Series(first - (0.0 if loss == "eval" else 1.0),
                        index=curves.runs["run_id"][curves.lengths > 0].astype(str))
    x0 = steps["run_id"].astype(str).map(first_x).to_numpy(float)
    at_start = steps["reached"].to_numpy(bool) & (steps["steps"].to_numpy(float) <= x0 + 1e-9)
    steps.loc[at_start, ["reached", "steps", "examples"]] = [False, np.nan, np.nan]
    steps.loc[at_start, "outcome"] = "at_start"
    return at_start


def _row(point: BranchPoint, fraction: float, value: float, fits: pd.DataFrame, n_runs: int,
         why: str, front: pd.DataFrame | None = None) -> dict:
    """One along.parquet row: the point, the target, and its fit of eq. 2.11. A fitted B_crit
    outside the batch sizes fitted at that target (`front`'s `in_fit` rows) is said as the
    bound it is (`extrapolated_bound`): the table says what the console and the report say."""
    row: dict = dict.fromkeys(ALONG_COLUMNS, math.nan)
    row.update(at_examples=point.at_examples, at_step=point.at_step, at_loss=point.at_loss,
               target=fraction, target_value=value, n_runs=n_runs, n_batch_sizes=0,
               b_simple=point.b_simple, b_noise=point.b_noise, quality="", refused=why,
               b_simple_precond=point.b_simple_precond, bcrit_status="refused",
               bcrit_reason=why)
    match = fits[fits["target"] == value] if len(fits) else fits
    if not len(match):
        row["refused"] = row["bcrit_reason"] = (
            why or "no run reached it (below the loss floor, or too few steps?)")
        return row
    fit = match.iloc[0]
    for name in ("n_batch_sizes", "s_min", "s_min_se", "e_min", "e_min_se", "b_crit",
                 "b_crit_se", "rmse_log", "b_simple_mean", "b_noise_mean", "quality", "refused",
                 "bcrit_status", "bcrit_reason", "b_crit_bound"):
        row[name] = fit[name]
    row["n_batch_sizes"] = int(row["n_batch_sizes"])
    row["ratio"], row["ratio_se"] = ratio_with_error(fit["b_crit"], fit["b_crit_se"],
                                                     point.b_simple, 0.0)
    row["ratio_noise"], row["ratio_noise_se"] = ratio_with_error(
        fit["b_crit"], fit["b_crit_se"], point.b_noise, 0.0)
    row["ratio_precond"], row["ratio_precond_se"] = ratio_with_error(
        fit["b_crit"], fit["b_crit_se"], point.b_simple_precond, 0.0)
    row["b_simple_precond_mean"] = fit.get("b_simple_precond_mean", math.nan)
    unresolved(row)
    if front is not None and len(front):
        extrapolated_bound(row, front[front["target"] == value])
    return row


MIN_LOCAL_S_MIN = 1.5
"""A local fit of eq. 2.11 whose S_min is below this many updates is refused: the large batch
sizes reach the target within an update or so, where the steps' resolution (a whole update,
and the smoother's window) is as large as S_min itself. Measured against the exact local
dynamics of linreg (`linreg_exact.local_truth`) from three base runs (B 8, 16, 32) at 2-3
points each (36 point-targets): targets 5-10% below a point's loss gave S_min 0.4-1.4 updates
and fits 2.4-5x below the exact local B_crit, or bounds the exact value contradicts ("< 8"
where it is 30, "< 16" where it is 127); every fit with S_min above 1.5 was within 30% of it.
Below 1.5 some fits were close too, but nothing in the data tells them from the others."""


def unresolved(row: dict) -> None:
    """In place: a fit or bound of eq. 2.11 whose S_min is below MIN_LOCAL_S_MIN updates is
    refused, with the reason (module doc of MIN_LOCAL_S_MIN); its B_crit, bound and ratios
    NaN."""
    s_min = float(row.get("s_min", math.nan))
    if row.get("bcrit_status") not in (FIT, LOWER_BOUND, UPPER_BOUND) \
            or not math.isfinite(s_min) or s_min >= MIN_LOCAL_S_MIN:
        return
    why = (f"S_min {s_min:.2g} updates: the largest batch sizes reach the target within "
           f"{MIN_LOCAL_S_MIN:g} updates, finer than the steps resolve; choose targets further "
           "below the point (smaller branch.targets fractions)")
    row.update(bcrit_status="refused", bcrit_reason=why, refused=why, b_crit_bound=math.nan)
    for name in ("b_crit", "b_crit_se", "ratio", "ratio_se", "ratio_noise", "ratio_noise_se",
                 "ratio_precond", "ratio_precond_se"):
        row[name] = math.nan


def extrapolated_bound(row: dict, front: pd.DataFrame) -> None:
    """A fit whose B_crit lies outside the batch sizes it was fitted on (`in_fit`) only bounds
    it: in place, `bcrit_status` lower_bound (above the largest) or upper_bound (below the
    smallest) at that edge, the reason, and B_crit, its error and its ratios NaN (as a bound of
    `analysis.bounds` is written), so that no table shows the extrapolated value as an answer."""
    if row.get("bcrit_status") != FIT or not len(front):
        return
    used = front[front["in_fit"].astype(bool)] if "in_fit" in front else front
    b_crit = float(row["b_crit"])
    if not len(used) or not math.isfinite(b_crit):
        return
    low, high = float(used["batch_size"].min()), float(used["batch_size"].max())
    if low <= b_crit <= high:
        return
    above = b_crit > high
    side = "above the largest" if above else "below the smallest"
    why = (f"the fit puts B_crit {side} batch size fitted ({low:g}..{high:g}): only a bound; "
           f"add {'larger' if above else 'smaller'} batch sizes")
    row.update(bcrit_status=LOWER_BOUND if above else UPPER_BOUND,
               b_crit_bound=high if above else low, bcrit_reason=why, refused=why)
    for name in ("b_crit", "b_crit_se", "ratio", "ratio_se", "ratio_noise", "ratio_noise_se",
                 "ratio_precond", "ratio_precond_se"):
        row[name] = math.nan


def tolerance_answer(row: Any, unit: str = "examples") -> str:
    """The tolerance rule's answer at one point, in words: the value with its bracket, the
    bound, or the refusal."""
    def g(value: float) -> str:
        return f"{value:,.4g}"

    if np.isfinite(row.b_crit_tol):
        return (f"{g(row.b_crit_tol)}{' ' + unit if unit else ''} (between "
                f"{g(row.b_crit_tol_lo)} and "
                f"{g(row.b_crit_tol_hi)})")
    return f"none: {row.tol_refused}" if row.tol_refused else "none"


def point_name(row: Any, unit: str = "examples") -> str:
    """A branch point as the answers name it: examples (in the task's unit) and the base
    run's step there."""
    return f"{int(row.at_examples):,} {unit} (step {int(row.at_step):,})"


SCHEDULE_COLUMNS = columns("along_schedule")
"""along_schedule.parquet: one row per (along run, target): its steps and examples to the target
against the fixed batch size that reached it in the fewest steps at its best learning rate
(front.parquet); `steps_ratio` = steps / best_steps (below 1: fewer steps, the 2025 paper's
claim for a batch-size warm-up), `examples_ratio` likewise; `front_steps` the steps a fixed
batch size needs with the same examples on the fitted front, S_min E / (E - E_min) (eq. 2.11),
and `front_ratio` = steps / front_steps (below 1: the schedule beats every fixed batch size at
its examples)."""


def split_along(curves: Curves) -> tuple[Curves, Curves | None]:
    """(the other runs, the along-schedule runs or None): the fit of eq. 2.11 sees fixed runs
    only; along runs are measured against it."""
    flag = curves.runs.get("along")
    if flag is None or not flag.astype(bool).any():
        return curves, None
    along = flag.astype(bool).to_numpy()
    return subset(curves, ~along), subset(curves, along)


def compare_schedule(curves: Curves, front: pd.DataFrame, targets: list[float], *,
                     fits: pd.DataFrame | None = None, loss: str = "smoothed",
                     ema_examples: float | None = None,
                     direction: Direction = FALLING) -> pd.DataFrame:
    """SCHEDULE_COLUMNS for the along runs in `curves` (`split_along`) against the fixed-batch
    front: for each target, steps and examples (interpolated at the fractional step, as the
    examples column counts them) beside the fastest fixed batch size's."""
    steps = steps_to_target(curves, None, targets, loss=loss, ema_examples=ema_examples,
                            direction=direction)
    step, examples = curves.columns["step"], curves.columns["examples"]
    position = {run_id: i for i, run_id in enumerate(curves.runs["run_id"])}
    rows = []
    for row in steps.itertuples(index=False):
        i = position[row.run_id]
        lo, hi = curves.offsets[i], curves.offsets[i + 1]
        out: dict = dict.fromkeys(SCHEDULE_COLUMNS, math.nan)
        out.update(run_id=row.run_id, seed=int(row.seed), target=float(row.target),
                   state=str(row.state), reached=bool(row.reached))
        if row.reached and hi > lo:
            s = float(row.steps)
            e = float(np.interp(s, np.concatenate([[0.0], step[lo:hi]]),
                                np.concatenate([[0.0], examples[lo:hi]])))
            out.update(steps=s, examples=e, mean_batch=e / s if s > 0 else math.nan)
        best = front[(front["target"] == row.target) & np.isfinite(front["steps"])] \
            if len(front) else front
        if len(best):
            fastest = best.loc[best["steps"].astype(float).idxmin()]
            out.update(best_batch=float(fastest["batch_size"]),
                       best_lr=float(fastest["learning_rate"]),
                       best_steps=float(fastest["steps"]),
                       best_examples=float(fastest["examples"]))
            out["steps_ratio"] = out["steps"] / out["best_steps"]
            out["examples_ratio"] = out["examples"] / out["best_examples"]
        fit = fits[(fits["target"] == row.target) & (fits["refused"].astype(str) == "")] \
            if fits is not None and len(fits) else None
        if fit is not None and len(fit) and out["examples"] > float(fit["e_min"].iloc[0]):
            s_min, e_min = float(fit["s_min"].iloc[0]), float(fit["e_min"].iloc[0])
            out["front_steps"] = s_min * out["examples"] / (out["examples"] - e_min)
            out["front_ratio"] = out["steps"] / out["front_steps"]
        rows.append(out)
    frame = pd.DataFrame(rows, columns=SCHEDULE_COLUMNS)
    frame["reached"] = frame["reached"].astype(bool)
    return frame
