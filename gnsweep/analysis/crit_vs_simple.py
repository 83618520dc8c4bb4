"""The paper's headline comparison across sweeps: B_crit (eq. 2.12) against the noise scale
B_simple measured in the same runs, one row per sweep x target. Pure: the sweeps' fits come in
as tables (`gnsweep.commands.compare` reads them from the sweep folders), one table goes out.

The paper's claim (section 3, fig. 4): across domains whose B_crit differs by orders of
magnitude, B_crit is about B_simple averaged over training up to the target (the S_min-weighted
mean of DESIGN.md, `b_simple_mean`), within a small factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gnsweep.tables import columns
from gnsweep.targets import KEY as DIRECTION_KEY
from gnsweep.targets import Direction

COMPARE_COLUMNS = columns("compare")
"""compare.parquet's columns (docs/compare.md says what each means)."""

_FROM_FITS = ["n_batch_sizes", "b_crit", "b_crit_se", "b_simple_mean", "b_simple_mean_se",
              "b_simple_at_target", "b_simple_at_target_se", "b_noise_mean", "b_noise_mean_se",
              "ratio", "ratio_se", "ratio_noise", "refused", "quality", "b_simple_precond_mean",
              "ratio_precond", "ratio_precond_se", "bcrit_status", "b_crit_bound",
              "at_examples"]


@dataclass(frozen=True)
class SweepFits:
    """One analysed sweep: what it trained and its fits table (fits.parquet)."""

    task: str
    sweep: str
    """The sweep's name in the comparison (its folder's name)."""
    sweep_dir: str
    metric: str
    """What the targets are values of: "loss", or the task's own metric ("return")."""
    direction: Direction | bool
    """Which way the targets are reached (a declared flag is read as `Direction.of` it)."""
    unit: str
    """What B counts: examples, tokens, environment steps."""
    fits: pd.DataFrame


def compare_rows(sweeps: list[SweepFits]) -> pd.DataFrame:
    """One row per sweep x target, in the order given, with `ratio` = B_crit / B_simple_mean.

    Targets whose fit was refused keep their row (B_crit NaN, `refused` says why): marked, never
    dropped. Columns a sweep's analysis did not write (an older version) are NaN or "".
    """
    rows = []
    for sweep in sweeps:
        fits = sweep.fits
        for i in range(len(fits)):
            fit = fits.iloc[i]
            row: dict = {"task": sweep.task, "sweep": sweep.sweep, "sweep_dir": sweep.sweep_dir,
                         "metric": sweep.metric,
                         DIRECTION_KEY: Direction.of(sweep.direction).rises,
                         "unit": sweep.unit, "target": float(fit["target"])}
            for name in _FROM_FITS:
                text = name in ("refused", "quality", "bcrit_status")
                value = fit.get(name, "" if text else math.nan)
                if text:
                    row[name] = "" if value is None or value != value else str(value)
                else:
                    row[name] = float(value) if value is not None else math.nan
            rows.append(row)
    out = pd.DataFrame(rows, columns=COMPARE_COLUMNS)
    out["n_batch_sizes"] = out["n_batch_sizes"].fillna(0).astype(np.int64)
    out[DIRECTION_KEY] = out[DIRECTION_KEY].astype(bool)
    return out


def placeable(table: pd.DataFrame, x: str = "b_simple_mean", y: str = "b_crit") -> pd.DataFrame:
    """The rows a log-log figure of `y` against `x` can show: both finite and positive."""
    ok = pd.Series(True, index=table.index)
    for column in (x, y):
        values = pd.to_numeric(table[column], errors="coerce")
        ok &= np.isfinite(values) & (values > 0)
    return table[ok]


def within_factor(table: pd.DataFrame, factor: float) -> pd.Series:
    """Whether each row's B_crit / B_simple_mean lies within `factor` of 1 (NaN rows: False)."""
    ratio = pd.to_numeric(table["ratio"], errors="coerce")
    return (ratio >= 1.0 / factor) & (ratio <= factor)


def log_error_bars(values: np.ndarray, errors: np.ndarray) -> np.ndarray:
    """Asymmetric (2, n) error bars for a log axis: +-se, the lower bar stopped at a tenth of the
    value (a standard error as large as the value would reach zero, off a log axis); NaN -> 0."""
    v = np.asarray(values, float)
    e = np.nan_to_num(np.asarray(errors, float), nan=0.0)
    return np.vstack([np.minimum(e, 0.9 * v), e])
