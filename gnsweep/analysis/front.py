"""Best learning rate per batch size and target, and the Pareto front in (examples, steps)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gnsweep.tables import columns

FRONT_COLUMNS = columns("front")
BEST_COLUMNS = FRONT_COLUMNS[:FRONT_COLUMNS.index("on_front")]
"""The best learning rate's row per (target, batch size), before the front is marked."""
EXTRA_COLUMNS = FRONT_COLUMNS[len(BEST_COLUMNS) + 1:FRONT_COLUMNS.index("steps_fit")]
LATE_BUDGET_SHARE = 0.85
"""A point reached after this share of its run's logged steps is late: the centred smoother's
window is cut at a run's end, and a budget's last stretch is where a schedule decays. A run that
stops at its hardest target trains on for the window's half-width (0.2 x its steps), so its
hardest target sits at 1/1.2 = 0.83 of its steps: not late."""
LATE_LR_SHARE = 0.1
"""A point reached with its learning rate below this share of the run's peak is late: a decayed
schedule anneals the loss down faster than the batch size alone would, and only at the batch
sizes whose budget ran out, so the tradeoff it shows is the schedule's."""
MIN_FIT_POINTS = 3
"""Points the fit of eq. 2.11 needs; late points are left out only while this many remain."""
FRONT_TOLERANCE = 0.1
"""A point is off the front for the fit when another needs this share fewer steps *and* fewer
examples. Strict Pareto dominance would drop genuine points by noise alone: where S ~ 1/B the
examples are flat and a few per cent of noise makes half the points dominated, and on the S_min
plateau the steps are."""
OFF_FRONT = (f"off the front: another batch size reached it in {FRONT_TOLERANCE:.0%} fewer "
             "steps with fewer examples")
LATE = (f"reached late (after {LATE_BUDGET_SHARE:.0%} of its steps, or with its learning rate "
        f"below {LATE_LR_SHARE:.0%} of its peak)")


def best_per_batch(steps: pd.DataFrame) -> pd.DataFrame:
    """For each (target, batch size): the learning rate that reaches the target in fewest steps.

    Seeds are averaged first; a (batch size, learning rate) counts as reaching a target only if
    every seed reached it. Batch sizes where no learning rate reached it are left out. A NaN
    learning rate (a table of already-tuned points) is one grid point of its own.
    Columns: BEST_COLUMNS then EXTRA_COLUMNS (docs/analysis.md).
    """
    steps = steps.copy()
    for name in ("b_noise_at_target", "b_noise_mean", "b_simple_true_mean", "b_noise_true_mean",
                 "drift_share", "b_simple_precond_at_target", "b_simple_precond_mean", "lr_share",
                 "last_step"):
        if name not in steps:
            steps[name] = np.nan
    if "seed" not in steps:
        steps["seed"] = 0
    # A run still training has no budget yet: its last step says nothing about lateness.
    running = (steps["state"].astype(str).eq("running") if "state" in steps
               else pd.Series(False, index=steps.index))
    steps["budget_step"] = steps["last_step"].astype(float).where(~running)
    keys = ["target", "batch_size", "learning_rate"]
    grouped = (steps.groupby(keys, as_index=False, dropna=False)
               .agg(steps=("steps", "mean"), all_reached=("reached", "all"),
                    n_seeds=("seed", "nunique"),
                    b_simple_at_target=("b_simple_at_target", "mean"),
                    b_simple_mean=("b_simple_mean", "mean"),
                    b_noise_at_target=("b_noise_at_target", "mean"),
                    b_noise_mean=("b_noise_mean", "mean"),
                    b_simple_true_mean=("b_simple_true_mean", "mean"),
                    b_noise_true_mean=("b_noise_true_mean", "mean"),
                    drift_share=("drift_share", "mean"),
                    b_simple_precond_at_target=("b_simple_precond_at_target", "mean"),
                    b_simple_precond_mean=("b_simple_precond_mean", "mean"),
                    lr_share=("lr_share", "mean"), budget_step=("budget_step", "mean")))
    tried = grouped.groupby(["target", "batch_size"])["learning_rate"]
    grouped["n_lr"] = tried.transform("size")
    grouped["lr_min"] = tried.transform("min")
    grouped["lr_max"] = tried.transform("max")
    reached = grouped[grouped["all_reached"] & np.isfinite(grouped["steps"])]
    if reached.empty:
        return pd.DataFrame(columns=BEST_COLUMNS + EXTRA_COLUMNS)
    best = reached.loc[reached.groupby(["target", "batch_size"])["steps"].idxmin()].copy()
    counts = reached.groupby(["target", "batch_size"]).size().rename("n_lr_reached")
    best = best.join(counts, on=["target", "batch_size"])
    lr = best["learning_rate"]
    low = (best["n_lr"] > 1) & (lr == best["lr_min"])
    high = (best["n_lr"] > 1) & (lr == best["lr_max"])
    best["lr_on_edge"] = (low | high).astype(bool)
    best["lr_edge"] = np.where(low, "low", np.where(high, "high", ""))
    best["examples"] = best["steps"] * best["batch_size"]
    with np.errstate(invalid="ignore", divide="ignore"):
        best["budget_share"] = best["steps"] / best["budget_step"].where(best["budget_step"] > 0)
    best["late"] = ((best["budget_share"] > LATE_BUDGET_SHARE)
                    | (best["lr_share"] < LATE_LR_SHARE)).astype(bool)
    # Each (target, batch size)'s learning rates in order, once (not a filter per row).
    ordered = grouped.sort_values(["target", "batch_size", "learning_rate"], kind="stable")
    curves = {key: (part["learning_rate"].to_numpy(float), part["steps"].to_numpy(float),
                    part["all_reached"].to_numpy(bool))
              for key, part in ordered.groupby(["target", "batch_size"], sort=False)}
    best["lr_opt"] = [_refine(curves[(row.target, row.batch_size)], row)
                      for row in best.itertuples(index=False)]
    _measured_nearest(best, reached)
    return (best[BEST_COLUMNS + EXTRA_COLUMNS].sort_values(["target", "batch_size"])
            .reset_index(drop=True))


NOISE_COLUMNS = ("b_simple_at_target", "b_simple_mean", "b_noise_at_target", "b_noise_mean",
                 "b_simple_true_mean", "b_noise_true_mean", "drift_share",
                 "b_simple_precond_at_target", "b_simple_precond_mean")
"""The measured noise scales of a best point, taken together from one learning rate."""


def _measured_nearest(best: pd.DataFrame, reached: pd.DataFrame) -> None:
    """Where the best learning rate's runs did not measure the noise scale (`noise.runs=auto`
    measures a few runs a batch size, `gnsweep.noise_plan`), its noise scales are those of the
    measured learning rate nearest it (in log distance; the mean of two as near) among those
    that reached the same target at the same batch size. `b_simple_lr` says whose: the best
    rate itself, another, or NaN where none at that batch size measured."""
    measured = np.isfinite(best["b_simple_at_target"].to_numpy(float))
    best["b_simple_lr"] = best["learning_rate"].where(measured)
    if measured.all():
        return
    donors = reached[np.isfinite(reached["b_simple_at_target"].to_numpy(float))
                     & (reached["learning_rate"].to_numpy(float) > 0)]
    pools = {key: part for key, part in donors.groupby(["target", "batch_size"])}
    for index in best.index[~measured]:
        row = best.loc[index]
        pool = pools.get((row["target"], row["batch_size"]))
        if pool is None or not row["learning_rate"] > 0:
            continue
        rates = pool["learning_rate"].to_numpy(float)
        distance = np.round(np.abs(np.log(rates / float(row["learning_rate"]))), 9)
        nearest = pool[distance == distance.min()]
        for name in NOISE_COLUMNS:
            best.loc[index, name] = nearest[name].mean()
        best.loc[index, "b_simple_lr"] = float(np.exp(np.log(nearest["learning_rate"]).mean()))


def best_steps_per_batch(steps: pd.DataFrame) -> pd.DataFrame:
    """`best_per_batch`'s target, batch_size and steps only (the same rows, the same numbers),
    without the noise scales and the learning-rate refinement: what a refit of eq. 2.11 needs."""
    keys = ["target", "batch_size", "learning_rate"]
    grouped = (steps.groupby(keys, as_index=False, dropna=False)
               .agg(steps=("steps", "mean"), all_reached=("reached", "all")))
    reached = grouped[grouped["all_reached"] & np.isfinite(grouped["steps"])]
    best = reached.loc[reached.groupby(["target", "batch_size"])["steps"].idxmin()]
    return (best[["target", "batch_size", "steps"]].sort_values(["target", "batch_size"])
            .reset_index(drop=True))


def _refine(curve: tuple[np.ndarray, np.ndarray, np.ndarray], row) -> float:
    """Vertex of the parabola in (log lr, log steps) through the best lr and its two neighbours.

    Near its optimum the steps to target are a smooth bowl in log lr; the vertex places the
    optimum between grid points. On an edge, or without both neighbours reaching the target, the
    grid value stands. `curve`: the (target, batch size)'s learning rates in increasing order,
    their mean steps and whether every seed reached the target.
    """
    if row.lr_on_edge or not np.isfinite(row.learning_rate):
        return float(row.learning_rate)
    lrs, steps, reached = curve
    i = int(np.flatnonzero(lrs == row.learning_rate)[0])
    if i == 0 or i == len(lrs) - 1:
        return float(row.learning_rate)
    window = slice(i - 1, i + 2)
    # Steps 0: the target was met before the first update (no bowl to fit).
    if not reached[window].all() or not (steps[window] > 0).all():
        return float(row.learning_rate)
    x = np.log(lrs[window])
    y = np.log(steps[window])
    a, b, _ = np.polyfit(x, y, 2)
    if not a > 0:
        return float(row.learning_rate)
    # The vertex lies within the bracket because the middle point is the lowest.
    return float(math.exp(min(max(-b / (2 * a), x[0]), x[2])))


def pareto_mask(examples: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """True where no other point needs both fewer (or equal) examples and fewer steps."""
    examples, steps = np.asarray(examples, float), np.asarray(steps, float)
    keep = np.ones(len(steps), bool)
    for i in range(len(steps)):
        dominated = (examples <= examples[i]) & (steps <= steps[i]) & (
            (examples < examples[i]) | (steps < steps[i]))
        keep[i] = not dominated.any()
    return keep


def pareto_front(best: pd.DataFrame) -> pd.DataFrame:
    """The best points with `on_front`: whether each is Pareto-optimal within its target."""
    parts = []
    for _, group in best.groupby("target", sort=False):
        group = group.copy()
        group["on_front"] = pareto_mask(group["examples"].to_numpy(), group["steps"].to_numpy())
        parts.append(group)
    if parts:
        front = pd.concat(parts, ignore_index=True)
    else:
        front = best.assign(on_front=pd.Series(dtype=bool))
    front["on_front"] = front["on_front"].astype(bool)
    for name in ("steps_fit", "resid_log"):
        if name not in front:
            front[name] = np.nan
    if "late" not in front:
        front["late"] = False
    front["late"] = front["late"].fillna(False).astype(bool)
    front["in_fit"], front["left_out"] = fit_points(front)
    return front[[c for c in FRONT_COLUMNS if c in front]]


def dominated_beyond_noise(examples: np.ndarray, steps: np.ndarray,
                           tolerance: float = FRONT_TOLERANCE) -> np.ndarray:
    """True where another point needs `tolerance` fewer steps and fewer examples (relative)."""
    examples, steps = np.asarray(examples, float), np.asarray(steps, float)
    shrink = 1.0 / (1.0 + tolerance)
    with np.errstate(invalid="ignore"):
        better = ((examples[None, :] <= shrink * examples[:, None])
                  & (steps[None, :] <= shrink * steps[:, None]))
    return np.asarray(better.any(axis=1), bool)


def fit_points(front: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Which best points enter the fit of eq. 2.11 (`in_fit`), and why each other one does not
    (`left_out`): only points on the front (within FRONT_TOLERANCE), and of those the late ones
    (`late`) only while fewer than MIN_FIT_POINTS would remain without them (then they stay, and
    the fit says so)."""
    in_fit = np.ones(len(front), bool)
    for _, rows in front.groupby("target", sort=False).indices.items():
        in_fit[rows] = ~dominated_beyond_noise(front["examples"].to_numpy(float)[rows],
                                               front["steps"].to_numpy(float)[rows])
    left_out = np.where(in_fit, "", OFF_FRONT).astype(object)
    late = front["late"].to_numpy(bool)
    for _, rows in front.groupby("target", sort=False).indices.items():
        timely = in_fit[rows] & ~late[rows]
        if timely.sum() >= MIN_FIT_POINTS:
            drop = rows[in_fit[rows] & late[rows]]
            in_fit[drop] = False
            left_out[drop] = LATE
    return in_fit, left_out


def censored_points(steps: pd.DataFrame) -> pd.DataFrame:
    """The batch sizes at each target that no learning rate reached although every run of them
    finished: the target lies beyond their budget, S > the steps they ran (a bound, not a point).
    Columns target, batch_size, budget (the most steps any of them ran)."""
    if not len(steps) or not {"outcome", "last_step", "reached"} <= set(steps):
        return pd.DataFrame(columns=["target", "batch_size", "budget"])
    outcome = steps["outcome"].astype(str)
    # Only a run that trained to its end without reaching the target bounds S; one still
    # training, never started or diverged says nothing about the steps it would need, and one
    # that met it before its smoothing window was whole (`early`) may have needed very few.
    finished = ~outcome.isin(("running", "pending", "no_metrics", "early"))
    budget = steps["last_step"].astype(float).where(outcome.eq("not_reached"))
    grouped = (steps.assign(finished=finished, budget=budget)
               .groupby(["target", "batch_size"], as_index=False)
               .agg(any_reached=("reached", "any"), all_finished=("finished", "all"),
                    budget=("budget", "max")))
    keep = ~grouped["any_reached"] & grouped["all_finished"] & (grouped["budget"] > 0)
    return grouped.loc[keep, ["target", "batch_size", "budget"]].reset_index(drop=True)
