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

import numpy as np
import pandas as pd

from gnsweep.analysis.adaptive import subset
from gnsweep.analysis.bounds import bound_text
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
`b_simple_precond_mean` the same for B_simple in the optimizer's preconditioner (docs/noise.md);
`bcrit_status` (fit, lower_bound, upper_bound, refused), `bcrit_reason` and `b_crit_bound` as in
fits.parquet: a local B_crit outside what the point's batch sizes support is a bound or refused,
with NaN in `b_crit`."""
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


def analyze_along(curves: Curves, points: list[BranchPoint], fractions: list[float], *,
                  loss: str = "smoothed", ema_examples: float | None = None,
                  bootstrap: int = 0, optimizer: str = "sgd", direction: Direction = FALLING,
                  source: str = "branch") -> Results:
    """One analysis per branch point (runs whose `at_examples` column names it) to its relative
    targets, put together grouped by `at_examples` (`analysis.groups`), with `along`: one row
    per (point, fraction), ALONG_COLUMNS.

    A target that no run of its point reached, or a point without runs, keeps its row with
    `refused` saying why and NaN estimates: marked, never dropped, and never fitted on a subset
    that would read as a local B_crit.
    """
    if GROUP not in curves.runs:
        raise AnalysisError(f"{source}: the runs name no branch point (no {GROUP} column); "
                            "a branch sweep is written by `gnsweep branch`")
    fractions = sorted((float(f) for f in fractions), reverse=True)
    at = curves.runs[GROUP].to_numpy(np.int64)
    parts: dict[str, Results] = {}
    rows: list[dict] = []
    warnings: list[str] = []
    for point in sorted(points, key=lambda p: p.at_examples):
        sub = subset(curves, at == point.at_examples)
        values = [direction.relative_target(point.at_loss, f) for f in fractions]
        fits = pd.DataFrame()
        why = f"no branch runs from {point.at_examples} examples" if not len(sub.runs) else ""
        if not why:
            steps = steps_to_target(sub, None, values, loss=loss, ema_examples=ema_examples,
                                    direction=direction)
            started = _reached_at_start(steps, sub, loss)
            if started.any():
                warnings.append(
                    f"branch point {point.at_examples} examples: {int(started.sum())} (run, "
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
                fits = part.fits
        for fraction, value in zip(fractions, values, strict=True):
            row = _row(point, fraction, value, fits, len(sub.runs), why)
            fitted = len(fits) and (fits["target"] == value).any()
            if row["refused"] and not fitted:  # a refused fit has warned in its part already
                warnings.append(f"branch point {point.at_examples} examples, target "
                                f"{fraction:g} ({value:.4g}): {row['refused']}")
            rows.append(row)
    if parts:
        result = combine(parts, GROUP)
    else:
        raise AnalysisError(f"{source}: no branch point has a run that reached a target "
                            f"({len(points)} point(s), targets {fractions}); train longer or "
                            "choose fractions closer to 1 (branch.targets)")
    result.warnings = warnings + result.warnings
    result.meta.update(source=source, branch_targets=fractions)
    result.along = pd.DataFrame(rows, columns=ALONG_COLUMNS)
    return result


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
         why: str) -> dict:
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
    return row


def format_along(along: pd.DataFrame, unit: str = "examples") -> str:
    """The local B_crit table as `gnsweep analyze` prints it: one line per (point, target)."""
    lines = [f"critical batch size along training ({unit}):",
             f"{'at':>12} {'loss there':>11} {'target':>7} {'#B':>3} {'S_min':>14} "
             f"{'local B_crit':>16} {'base B_simple':>14} {'base B_noise':>13}  note"]
    for row in along.itertuples(index=False):
        def pm(value: float, se: float) -> str:
            if not np.isfinite(value):
                return "-"
            return f"{value:.4g} ± {se:.2g}" if np.isfinite(se) else f"{value:.4g}"

        def num(value: float) -> str:
            return f"{value:.4g}" if np.isfinite(value) else "-"

        b_crit = bound_text(row.bcrit_status, row.b_crit_bound) or pm(row.b_crit, row.b_crit_se)
        lines.append(f"{row.at_examples:>12,} {row.at_loss:>11.4g} {row.target:>7g} "
                     f"{row.n_batch_sizes:>3} {pm(row.s_min, row.s_min_se):>14} "
                     f"{b_crit:>16} {num(row.b_simple):>14} "
                     f"{num(row.b_noise):>13}  {row.refused or row.quality}")
    return "\n".join(lines)


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


def format_schedule(table: pd.DataFrame) -> str:
    """The console lines of the along runs: steps and examples against the fastest fixed B."""
    lines = ["batch size following the measured B_crit (sweep.schedule=along) against the "
             "fastest fixed batch size:"]
    for row in table.itertuples(index=False):
        head = f"{row.target:>8g} {row.run_id}"
        if not row.reached:
            lines.append(f"{head}: not reached ({row.state})")
            continue
        lines.append(f"{head}: S {row.steps:.4g}, E {row.examples:.4g} (mean B "
                     f"{row.mean_batch:.3g}); fixed B {row.best_batch:g} at lr {row.best_lr:g}: "
                     f"S {row.best_steps:.4g}, E {row.best_examples:.4g}; steps x"
                     f"{row.steps_ratio:.3g}, examples x{row.examples_ratio:.3g}; fixed-batch "
                     f"front at its examples: S {row.front_steps:.4g} (x{row.front_ratio:.3g})")
    return "\n".join(lines)
