"""Steps-to-target: the first logged step at which a run's loss reaches each target."""

from __future__ import annotations

import numpy as np
import pandas as pd

LOSS_COLUMNS = {"smoothed": "loss_smooth", "raw": "loss", "eval": "eval_loss"}


def steps_to_target(metrics: pd.DataFrame, runs: pd.DataFrame, targets: list[float],
                    loss: str = "smoothed") -> pd.DataFrame:
    """One row per (run, target): whether and when the run reached the target.

    `metrics` has run_id, step, examples, the loss column and b_simple; `runs` has run_id,
    batch_size, learning_rate, seed, state. Runs that never reach a target, or diverged, keep a
    row with reached=False and steps=NaN: they are marked, never dropped.

    Besides the step, each row carries B_simple when the target was reached and B_simple averaged
    over the run up to it with S_min weights `dS / (1 + B_simple/B)` (DESIGN.md): B_crit at a
    target is the S_min-weighted mean of the noise scale over the path to it.
    """
    column = LOSS_COLUMNS[loss]
    out = []
    by_run = dict(tuple(metrics.groupby("run_id", sort=False)))
    for run in runs.itertuples(index=False):
        frame = by_run.get(run.run_id)
        for target in sorted(targets, reverse=True):
            row = {"run_id": run.run_id, "batch_size": run.batch_size,
                   "learning_rate": run.learning_rate, "seed": run.seed, "target": target,
                   "state": run.state, "reached": False, "steps": np.nan, "examples": np.nan,
                   "b_simple_at_target": np.nan, "b_simple_mean": np.nan}
            if frame is not None and run.state != "diverged":
                _fill(row, frame, column, target, run.batch_size)
            out.append(row)
    return pd.DataFrame(out, columns=STEPS_COLUMNS)


STEPS_COLUMNS = ["run_id", "batch_size", "learning_rate", "seed", "target", "state", "reached",
                 "steps", "examples", "b_simple_at_target", "b_simple_mean"]


def _fill(row: dict, frame: pd.DataFrame, column: str, target: float, batch: int) -> None:
    values = frame[column].to_numpy()
    hit = np.flatnonzero(values <= target)
    if not len(hit):
        return
    first = hit[0]
    steps = frame["step"].to_numpy()
    row.update(reached=True, steps=float(steps[first]), examples=float(steps[first] * batch))
    b_simple = frame["b_simple"].to_numpy()[: first + 1]
    row["b_simple_at_target"] = _last_finite(b_simple)
    row["b_simple_mean"] = smin_weighted_mean(steps[: first + 1], b_simple, batch)


def smin_weighted_mean(steps: np.ndarray, b_simple: np.ndarray, batch: float) -> float:
    """Mean of B_simple over a run weighted by dS_min = dS / (1 + B_simple/B) (eq. 2.11 path)."""
    ds = np.diff(np.concatenate([[0.0], steps.astype(float)]))
    ok = np.isfinite(b_simple) & (b_simple > -batch)
    if not ok.any():
        return np.nan
    weights = ds[ok] / (1.0 + b_simple[ok] / batch)
    total = weights.sum()
    return float((weights * b_simple[ok]).sum() / total) if total > 0 else np.nan


def _last_finite(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite[-1]) if len(finite) else np.nan
