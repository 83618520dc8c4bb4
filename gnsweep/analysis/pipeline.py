"""The pure analysis pipeline: steps-to-target, best learning rates, fronts, the fits of eq. 2.11,
eps_opt(B) and B_crit(L), from tables to one `Results`. No files, no printing.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from gnsweep.analysis.auto_targets import NoAutoTargets, auto_targets
from gnsweep.analysis.bounds import FIT, REFUSED
from gnsweep.analysis.fit import FitRefused, fit_hyperbola, predict_steps
from gnsweep.analysis.front import (
    LATE_BUDGET_SHARE,
    best_per_batch,
    best_steps_per_batch,
    censored_points,
    pareto_front,
)
from gnsweep.analysis.loss_scaling import fit_loss_scaling
from gnsweep.analysis.lr import fit_lr_table
from gnsweep.analysis.results import Results
from gnsweep.analysis.smoothing import MIN_WINDOW_EXAMPLES, SMOOTHING_FRACTION
from gnsweep.analysis.steps import EARLY, Curves, curves_from_frames, steps_to_target
from gnsweep.analysis.temperature import fit_temperature
from gnsweep.errors import StoreError
from gnsweep.tables import BEST_VALUE, columns
from gnsweep.targets import FALLING, Direction

ALL_FIT_COLUMNS = columns("fits")
FIT_COLUMNS = ALL_FIT_COLUMNS[:ALL_FIT_COLUMNS.index("dof")]
"""The fit's own columns; FIT_EXTRA_COLUMNS its errors, bounds and the quantities beside it."""
FIT_EXTRA_COLUMNS = ALL_FIT_COLUMNS[len(FIT_COLUMNS):]
WINDOW_SPREAD_WARNING = 0.2
"""Warn when B_crit moves more than this (relative) between half and double smoothing windows."""
DRIFT_SHARE_WARNING = 0.25
"""Warn when the drift flag is up on more than this share of the best runs' steps to a target."""


class AnalysisError(StoreError):
    """The data cannot support an analysis (no run reached a target, bad table); names why."""


def analyze_tables(runs: pd.DataFrame | None, metrics: pd.DataFrame | Curves,
                   targets: list[float] | str, loss: str = "smoothed", *,
                   ema_examples: float | None = None, bootstrap: int = 0, optimizer: str = "sgd",
                   source: str = "sweep", direction: Direction | bool = FALLING) -> Results:
    """Steps-to-target from curves, then everything `analyze_steps` does; with the centred
    smoother, B_crit again at half and double its window (`window_robustness`).

    `targets` "auto": levels chosen from the curves (`analysis.auto_targets`), recorded with how
    in meta's `targets_auto`. `direction`: which way the targets are reached (`RISING` for a
    metric such as a return).
    """
    curves = metrics if isinstance(metrics, Curves) else curves_from_frames(runs, metrics)
    how = ""
    if isinstance(targets, str):
        try:
            targets, how = auto_targets(curves, loss, ema_examples, Direction.of(direction))
        except NoAutoTargets as err:
            raise AnalysisError(f"{source}: automatic targets: {err}") from None
    steps = steps_to_target(curves, None, targets, loss=loss, ema_examples=ema_examples,
                            direction=direction)
    meta = {"source": source, "loss": loss, "ema_examples": ema_examples,
            **Direction.of(direction).to_meta(),
            "smoothing": SMOOTHING_FRACTION if loss == "smoothed" and not ema_examples else None}
    if how:
        meta["targets_auto"] = how
    result = analyze_steps(steps, targets, bootstrap=bootstrap, optimizer=optimizer, meta=meta)
    if meta["smoothing"] is not None and np.isfinite(curves.columns["loss"]).any():
        window_robustness(curves, list(result.fits["target"]), result)
    return result


def window_robustness(curves: Curves, targets: list[float], result: Results) -> None:
    """B_crit refitted with the loss smoothed over half and double the default window:
    `b_crit_window_lo`/`_hi` (at half / double) and `b_crit_window_spread` (max - min of the
    three over the default), with a warning where the spread exceeds 20%."""
    fits = result.fits
    found: dict[str, dict[float, float]] = {}
    for name, fraction in (("b_crit_window_lo", SMOOTHING_FRACTION / 2),
                           ("b_crit_window_hi", SMOOTHING_FRACTION * 2)):
        best = best_steps_per_batch(steps_to_target(curves, None, targets,
                                                    smoothing=fraction))
        found[name] = {}
        for target in targets:
            # The batch sizes of the default window's fit: the same points, another window.
            used = result.front.loc[(result.front["target"] == target)
                                    & result.front["in_fit"].astype(bool), "batch_size"]
            rows = best[(best["target"] == target) & best["batch_size"].isin(used)]
            try:
                fit = fit_hyperbola(rows["batch_size"].to_numpy(), rows["steps"].to_numpy())
                found[name][target] = fit.b_crit if fit.status == FIT else math.nan
            except FitRefused:
                found[name][target] = math.nan
        fits[name] = fits["target"].map(found[name]).astype(float)
    trio = fits[["b_crit", "b_crit_window_lo", "b_crit_window_hi"]].to_numpy(float)
    with np.errstate(invalid="ignore"):
        fits["b_crit_window_spread"] = (trio.max(axis=1) - trio.min(axis=1)) / trio[:, 0]
    for row in fits.itertuples(index=False):
        if row.b_crit_window_spread > WINDOW_SPREAD_WARNING:
            result.warnings.append(
                f"target {row.target:g}: B_crit moves {row.b_crit_window_spread:.0%} between "
                f"smoothing windows ({row.b_crit_window_lo:.4g} at half, "
                f"{row.b_crit_window_hi:.4g} at double): not robust; more seeds or longer runs")


def analyze_steps(steps: pd.DataFrame, targets: list[float], *, bootstrap: int = 0,
                  optimizer: str = "sgd", meta: dict[str, Any] | None = None) -> Results:
    """Best learning rates, fronts, the fits of eq. 2.11, eps_opt(B) and B_crit(L)."""
    meta = {"source": "table", **(meta or {}), "bootstrap": bootstrap, "optimizer": optimizer,
            "n_runs": int(steps["run_id"].nunique()) if "run_id" in steps else len(steps)}
    where = meta["source"]
    if steps.empty:
        raise AnalysisError(f"{where}: nothing to analyze (no runs or no targets)")
    # A target no run reached is left out, named with the best value reached; the others are
    # analysed. Only when none was reached is there nothing to analyse.
    early = _early_warning(steps)
    unreached = [t for t in targets if not steps.loc[steps["target"] == t, "reached"].any()]
    closest = _closest(steps, Direction.from_meta(meta)) if unreached else ""
    if unreached and len(unreached) == len(targets):
        raise AnalysisError(f"{where}: target {unreached[0]:g}: no run reached it{closest}; "
                            "train longer or choose reachable targets (--targets, or "
                            "--targets auto: levels chosen from the runs)")
    left_out = [f"target {t:g}: no run reached it{closest}; left out, the other targets are "
                "analysed (train longer, or --targets auto)" for t in unreached]
    if unreached:
        targets = [t for t in targets if t not in unreached]
        steps = steps[steps["target"].isin(targets)].reset_index(drop=True)
        meta["targets_left_out"] = unreached
    best = best_per_batch(steps)
    front = pareto_front(best)
    warnings = early + left_out + _grid_warnings(best)
    lr_fits = fit_lr_table(front, targets)
    # Adam-like optimizers saturate (power law); SGD, with or without momentum, is linear in B.
    lr_model = "power" if optimizer in ("adam", "adamw") else "sgd"
    censored = censored_points(steps)
    fits = pd.DataFrame([fit_target(t, front[front["target"] == t], warnings, bootstrap,
                                    lr_fits[(lr_fits["target"] == t)
                                            & (lr_fits["model"] == lr_model)],
                                    censored[censored["target"] == t])
                         for t in Direction.from_meta(meta).in_training_order(targets)],
                        columns=ALL_FIT_COLUMNS)
    for name in ("n_batch_sizes", "dof", "n_bootstrap", "n_left_out"):
        fits[name] = fits[name].astype(int)
    _add_residuals(front, fits)
    result = Results(steps, front, fits, warnings, lr_fits, fit_loss_scaling(fits), meta)
    result.temperature = fit_temperature(steps)
    return result


def _closest(steps: pd.DataFrame, direction: Direction = FALLING) -> str:
    # The steps' BEST_VALUE column holds each run's best value in the target's direction.
    if BEST_VALUE not in steps or not np.isfinite(steps[BEST_VALUE]).any():
        return ""
    values = steps[BEST_VALUE].astype(float)
    row = steps.loc[(direction.as_loss(values)).idxmin()]
    return f" ({direction.best_label()} {row[BEST_VALUE]:.4g}, run {row['run_id']})"


def _early_warning(steps: pd.DataFrame) -> list[str]:
    """One line for the targets met before a run trained on MIN_WINDOW_EXAMPLES samples
    (outcome `early`, `steps_to_target`): how many, where, and that they are not counted."""
    if "outcome" not in steps:
        return []
    rows = steps[steps["outcome"].astype(str) == EARLY]
    if not len(rows):
        return []
    named = ", ".join(f"{row.run_id} at {row.target:g}"
                      for row in rows.head(3).itertuples(index=False))
    more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
    return [f"{len(rows)} run(s) met a target before training on {MIN_WINDOW_EXAMPLES:g} samples "
            f"({named}{more}), where the smoothed loss is mostly their first rows': not "
            "counted (outcome early in steps.parquet; a run that blew up reads low there)"]


def _grid_warnings(best: pd.DataFrame) -> list[str]:
    warnings = []
    for row in best.itertuples(index=False):
        where = f"target {row.target:g}, batch {row.batch_size}"
        if row.lr_on_edge:
            side = "below" if row.lr_edge == "low" else "above"
            warnings.append(f"{where}: best learning rate {row.learning_rate:g} is on the "
                            f"{row.lr_edge} edge of the grid; widen it {side}")
        if row.n_lr_reached < 2 and np.isfinite(row.learning_rate):
            warnings.append(f"{where}: only {row.n_lr_reached} learning rate reached the target; "
                            "its best learning rate is a guess")
    return warnings


def fit_target(target: float, best: pd.DataFrame, warnings: list[str], bootstrap: int = 0,
               lr_fit: pd.DataFrame | None = None, censored: pd.DataFrame | None = None) -> dict:
    """The fit of eq. 2.11 at one target, with the noise scales of the best-tuned runs beside.

    `best`: the target's best point per batch size (front.parquet rows); those with `in_fit`
    enter the fit (all of them without that column). `censored`: batch sizes that did not reach
    the target within `budget` steps (`front.censored_points`); they enter the fit as bounds
    (the curve must need at least the early part of that budget there: `LATE_BUDGET_SHARE`,
    as for late points), are listed in `censored`, and a fit that still says they should have
    got there is flagged in `quality`. A B_crit outside the grid's support, or one the
    points do not place, is a bound or refused (`bcrit_status`, `bcrit_reason`, and `refused`
    holds the reason too): B_crit and its error are then NaN, never the runaway value.
    """
    row: dict = dict.fromkeys(ALL_FIT_COLUMNS, math.nan)
    used = best[best["in_fit"].astype(bool)] if "in_fit" in best else best
    row.update(target=target, n_batch_sizes=len(used), refused="", dof=0, n_bootstrap=0,
               lr_model="", lr_refused="", quality="", bcrit_status=REFUSED, bcrit_reason="",
               n_left_out=len(best) - len(used), censored="", lr_status="")
    # Noise scales of the best-tuned runs: the median over batch sizes, robust to one bad run.
    for name in ("b_simple_at_target", "b_simple_mean", "b_noise_at_target", "b_noise_mean"):
        row[name], row[f"{name}_se"] = median_with_error(best[name])
    for name in ("b_simple_precond_at_target", "b_simple_precond_mean"):
        if name in best:  # B_simple in the optimizer's preconditioner, where logged
            row[name], row[f"{name}_se"] = median_with_error(best[name])
    for name in ("b_simple_true_mean", "b_noise_true_mean", "drift_share"):
        if name in best:
            row[name] = median_with_error(best[name])[0]
    borrowed = _borrowed_noise(best)
    if borrowed:
        warnings.append(f"target {target:g}: B_simple at {borrowed} is that of the measured "
                        "learning rate nearest the best (noise.runs=auto measured other rates "
                        "there: front.parquet's b_simple_lr) and B_simple moves with the rate: "
                        "a relaunch that adds a seed (sweep.seeds) measures the best rates "
                        "known, noise.runs=all every run")
    if row["drift_share"] > DRIFT_SHARE_WARNING:
        warnings.append(f"target {target:g}: |G|^2 changed more than 2x inside the noise-scale "
                        f"window on {row['drift_share']:.0%} of the best runs' steps: their "
                        "B_simple/B_noise lean to earlier training (noise.ema_fraction smaller, "
                        "or probes: noise.probe_per_octave)")
    if lr_fit is not None and len(lr_fit):
        lr = lr_fit.iloc[0]
        row.update(lr_model=lr["model"], eps_max=lr["eps_max"], eps_max_se=lr["eps_max_se"],
                   b_noise_lr=lr["b_noise"], b_noise_lr_se=lr["b_noise_se"],
                   lr_alpha=lr["alpha"], lr_alpha_se=lr["alpha_se"], lr_refused=lr["refused"],
                   lr_status=lr.get("status", ""))
    try:
        at_least = None if censored is None or not len(censored) else (
            censored["batch_size"].to_numpy(float),
            LATE_BUDGET_SHARE * censored["budget"].to_numpy(float))
        fit = fit_hyperbola(used["batch_size"].to_numpy(), used["steps"].to_numpy(),
                            bootstrap=bootstrap, at_least=at_least)
    except FitRefused as err:
        why = str(err)
        if row["n_left_out"]:
            why += (f" ({row['n_left_out']} more left out of the fit: off the front or reached "
                    "late, see front.parquet's left_out)")
        row.update(refused=why, bcrit_reason=why)
        warnings.append(f"target {target:g}: no fit: {why}")
        return row
    notes = _fit_notes(fit.s_min, fit.e_min, used, censored, row)
    if fit.status != FIT:
        row.update(refused=fit.reason, bcrit_status=fit.status, bcrit_reason=fit.reason,
                   b_crit_bound=fit.b_crit_bound, n_batch_sizes=fit.n_points, dof=fit.dof,
                   rmse_log=fit.rmse_log, max_abs_resid_log=fit.max_abs_resid_log,
                   quality="; ".join(notes))
        # A bound keeps the asymptote the points do determine: E_min when every batch size is
        # below the bend (E = B S is flat there), S_min when every one is above it.
        keep = {"lower_bound": ("e_min", "e_min_se"), "upper_bound": ("s_min", "s_min_se")}
        for name in keep.get(fit.status, ()):
            row[name] = getattr(fit, name)
        warnings.append(f"target {target:g}: {fit.reason}")
        return row
    row.update({k: v for k, v in fit.as_dict().items() if k in row})
    row.update(n_batch_sizes=fit.n_points, bcrit_status=FIT, bcrit_reason="")
    quality = fit_quality(fit.b_crit, fit.b_crit_se, used["batch_size"])
    row["quality"] = "; ".join(([quality] if quality else []) + notes)
    if row["quality"]:
        warnings.append(f"target {target:g}: B_crit {fit.b_crit:.4g}: {row['quality']}")
    for out, denominator in (("ratio", "b_simple_mean"), ("ratio_at_target", "b_simple_at_target"),
                             ("ratio_noise", "b_noise_mean"),
                             ("ratio_precond", "b_simple_precond_mean")):
        row[out], row[f"{out}_se"] = ratio_with_error(
            fit.b_crit, fit.b_crit_se, row[denominator], row[f"{denominator}_se"])
    return row


def _fit_notes(s_min: float, e_min: float, used: pd.DataFrame, censored: pd.DataFrame | None,
               row: dict) -> list[str]:
    """What a fit should be read with: late points it had to keep, and batch sizes that did not
    reach the target in a budget the fitted hyperbola says was enough (fills `row["censored"]`).
    """
    notes = []
    n_late = int(used["late"].astype(bool).sum()) if "late" in used else 0
    if n_late:
        notes.append(f"uses {n_late} point(s) reached late (too few others to leave them out)")
    if censored is None or not len(censored):
        return notes
    listed, short = [], []
    for point in censored.itertuples(index=False):
        listed.append(f"{point.batch_size:g} (> {point.budget:g} steps)")
        predicted = float(predict_steps(np.array([point.batch_size]), s_min, e_min)[0])
        # Reached before the late stretch of that budget by the fit's own law, yet not at all.
        if math.isfinite(predicted) and predicted < LATE_BUDGET_SHARE * point.budget:
            short.append(f"{point.batch_size:g} did not reach it in {point.budget:g} steps, where "
                         f"the fit predicts {predicted:.3g}")
    row["censored"] = "not reached: " + ", ".join(listed)
    if short:
        notes.append("; ".join(short) + " (the fit overstates how fast those batch sizes get "
                     "there)")
    return notes


def fit_quality(b_crit: float, b_crit_se: float, batch_sizes: pd.Series) -> str:
    """Why a fit's B_crit is not determined by the sweep ("" when it is).

    The hyperbola's bend sits at B_crit: batch sizes all below it (or all above) only bound it.
    """
    issues = []
    low, high = float(batch_sizes.min()), float(batch_sizes.max())
    if not low <= b_crit <= high:
        side = "above the largest" if b_crit > high else "below the smallest"
        issues.append(f"{side} batch size ({low:g}..{high:g}); the sweep only bounds it, add "
                      f"batch sizes {'above' if b_crit > high else 'below'}")
    if np.isfinite(b_crit_se) and b_crit_se > 0.5 * b_crit:
        issues.append(f"relative error {b_crit_se / b_crit:.0%} > 50%")
    return "; ".join(issues)


def _borrowed_noise(best: pd.DataFrame) -> str:
    """The batch sizes whose noise scales are another learning rate's than their best
    (`front._measured_nearest`), as 'batch 8 (best 0.2, measured 0.8), ...'; "" if none."""
    if "b_simple_lr" not in best:
        return ""
    lr, measured = best["learning_rate"].to_numpy(float), best["b_simple_lr"].to_numpy(float)
    other = np.isfinite(measured) & ~np.isclose(measured, lr)
    return ", ".join(f"batch {b:g} (best {a:g}, measured {m:.3g})" for b, a, m in
                     zip(best["batch_size"].to_numpy(float)[other], lr[other], measured[other],
                         strict=True))


def median_with_error(values: pd.Series) -> tuple[float, float]:
    """Median and its large-sample standard error 1.2533 sd/sqrt(n) (NaN for n < 2)."""
    finite = values.astype(float)
    finite = finite[np.isfinite(finite)]
    if not len(finite):
        return math.nan, math.nan
    se = 1.2533 * float(finite.std(ddof=1)) / math.sqrt(len(finite)) if len(finite) > 1 \
        else math.nan
    return float(finite.median()), se


def ratio_with_error(a: float, a_se: float, b: float, b_se: float) -> tuple[float, float]:
    """a/b and its delta-method error: (a/b) sqrt((a_se/a)^2 + (b_se/b)^2)."""
    if not (np.isfinite(a) and np.isfinite(b) and a > 0 and b > 0):
        return math.nan, math.nan
    ratio = a / b
    return ratio, ratio * math.sqrt((a_se / a) ** 2 + (b_se / b) ** 2)


def _add_residuals(front: pd.DataFrame, fits: pd.DataFrame) -> None:
    """steps_fit and resid_log of every front point, from its target's fit."""
    fitted = fits[fits["refused"] == ""].set_index("target")
    s_min = front["target"].map(fitted["s_min"])
    e_min = front["target"].map(fitted["e_min"])
    front["steps_fit"] = predict_steps(front["batch_size"].to_numpy(float), s_min.to_numpy(float),
                                       e_min.to_numpy(float))
    with np.errstate(invalid="ignore", divide="ignore"):
        front["resid_log"] = np.log(front["steps"].astype(float) / front["steps_fit"])
