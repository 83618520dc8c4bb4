"""The noise scale against the temperature `T = eps/B` (the paper's appendix C).

SGD with learning rate eps on batches of B is, to first order, a diffusion at temperature
`T = eps/B`; in equilibrium the loss fluctuates in proportion to T, |G|^2 grows with it while
tr(Sigma) barely moves, so B_simple goes like 1/T. Every sweep holds B_simple at many (eps, B)
at each target: per target, the slope of log B_simple (at the moment each run reaches it) against
log T over those runs is the measured `exponent`, -1 in the paper's equilibrium picture.

For Adam the step is `eps P g`: its temperature in the preconditioned coordinates is still
`eps/B` (P is shared by every batch size at a given loss only roughly, since v tracks the
gradient's second moment, which includes the noise tr(Sigma)/B), so the same `T = eps/B` is
used, and the slope of B_simple_P is reported beside (`exponent_precond`). Pure: steps table in,
one table out.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gnsweep.tables import columns

TEMPERATURE_COLUMNS = columns("temperature")
"""temperature.parquet: one row per target (docs/analysis.md)."""
MIN_RUNS = 3
"""A slope with its standard error needs one more run than its two parameters."""


def log_slope(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least-squares slope of y on x, its standard error and the rms residual."""
    n = len(x)
    xc = x - x.mean()
    sxx = float(xc @ xc)
    slope = float(xc @ (y - y.mean())) / sxx
    resid = y - y.mean() - slope * xc
    s2 = float(resid @ resid) / (n - 2) if n > 2 else math.nan
    return slope, math.sqrt(s2 / sxx), float(np.sqrt(np.mean(resid ** 2)))


def _fit(t: np.ndarray, b: np.ndarray) -> tuple[float, float, int, int, float, str]:
    ok = np.isfinite(t) & np.isfinite(b) & (t > 0) & (b > 0)
    t, b = t[ok], b[ok]
    n, distinct = len(t), len(np.unique(t))
    if n < MIN_RUNS:
        return math.nan, math.nan, n, distinct, math.nan, (
            f"{n} run(s) reached it with a positive noise scale; a slope needs {MIN_RUNS}")
    if distinct < 2:
        return math.nan, math.nan, n, distinct, math.nan, "one temperature eps/B only"
    slope, se, rmse = log_slope(np.log(t), np.log(b))
    return slope, se, n, distinct, rmse, ""


def fit_temperature(steps: pd.DataFrame) -> pd.DataFrame:
    """Per target: the exponent of B_simple at the target against T = eps/B over the runs that
    reached it (every learning rate, not only the best), its standard error and the number of
    runs; a target with fewer than `MIN_RUNS` runs, or one temperature, keeps its row with
    `refused` saying why. Runs with a non-positive (noisy) B_simple are left out."""
    rows = []
    if steps.empty or "target" not in steps:
        return pd.DataFrame(columns=TEMPERATURE_COLUMNS)
    for target in pd.unique(steps["target"]):
        runs = steps[(steps["target"] == target) & steps["reached"].astype(bool)]
        t = (runs["learning_rate"].astype(float) / runs["batch_size"].astype(float)).to_numpy()
        slope, se, n, distinct, rmse, why = _fit(t, runs["b_simple_at_target"]
                                                 .to_numpy(float))
        row = {"target": float(target), "exponent": slope, "exponent_se": se, "n_runs": n,
               "n_temperatures": distinct, "rmse_log": rmse, "refused": why,
               "exponent_precond": math.nan, "exponent_precond_se": math.nan,
               "n_runs_precond": 0}
        if "b_simple_precond_at_target" in runs:
            slope, se, n, _, _, why = _fit(t, runs["b_simple_precond_at_target"]
                                           .to_numpy(float))
            if not why:
                row.update(exponent_precond=slope, exponent_precond_se=se, n_runs_precond=n)
        rows.append(row)
    out = pd.DataFrame(rows, columns=TEMPERATURE_COLUMNS)
    for name in ("n_runs", "n_temperatures", "n_runs_precond"):
        out[name] = out[name].astype(np.int64)
    return out
