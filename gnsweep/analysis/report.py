"""From a sweep's tables to its results: steps.parquet, front.parquet, fits.parquet, fits.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from gnsweep import store
from gnsweep.analysis.fit import FitRefused, fit_hyperbola
from gnsweep.analysis.front import best_per_batch, pareto_front
from gnsweep.analysis.steps import steps_to_target

FIT_COLUMNS = ["target", "n_batch_sizes", "s_min", "s_min_se", "e_min", "e_min_se", "b_crit",
               "b_crit_se", "rmse_log", "b_simple_at_target", "b_simple_mean", "ratio",
               "refused"]


@dataclass
class Analysis:
    steps: pd.DataFrame
    """One row per (run, target)."""
    front: pd.DataFrame
    """Best learning rate per (target, batch size), with on_front."""
    fits: pd.DataFrame
    """One row per target: the fit, B_crit, B_simple beside it."""
    warnings: list[str] = field(default_factory=list)


def analyze_tables(runs: pd.DataFrame, metrics: pd.DataFrame, targets: list[float],
                   loss: str = "smoothed") -> Analysis:
    steps = steps_to_target(metrics, runs, targets, loss=loss)
    best = best_per_batch(steps)
    front = pareto_front(best)
    warnings = []
    for row in best.itertuples(index=False):
        if row.lr_on_edge:
            warnings.append(f"target {row.target:g}, batch {row.batch_size}: best learning rate "
                            f"{row.learning_rate:g} is on the edge of the grid; widen it there")
    fits = [fit_target(target, best[best["target"] == target], warnings) for target in targets]
    return Analysis(steps, front, pd.DataFrame(fits, columns=FIT_COLUMNS), warnings)


def fit_target(target: float, best: pd.DataFrame, warnings: list[str]) -> dict:
    """The fit of eq. 2.11 at one target, with B_simple of the best-tuned runs beside it."""
    row: dict = dict.fromkeys(FIT_COLUMNS, math.nan)
    row.update(target=target, n_batch_sizes=len(best), refused="")
    # B_simple from the best-tuned runs: the median over batch sizes, robust to one bad run.
    row["b_simple_at_target"] = _median(best["b_simple_at_target"])
    row["b_simple_mean"] = _median(best["b_simple_mean"])
    try:
        fit = fit_hyperbola(best["batch_size"].to_numpy(), best["steps"].to_numpy())
    except FitRefused as err:
        row["refused"] = str(err)
        warnings.append(f"target {target:g}: no fit: {err}")
        return row
    row.update({k: v for k, v in fit.as_dict().items() if k in row})
    row["ratio"] = fit.b_crit / row["b_simple_mean"] if row["b_simple_mean"] > 0 else math.nan
    return row


def _median(values: pd.Series) -> float:
    finite = values[np.isfinite(values.astype(float))]
    return float(finite.median()) if len(finite) else math.nan


def write_outputs(out_dir: Path, analysis: Analysis) -> None:
    store.write_frame(out_dir / "steps.parquet", analysis.steps)
    store.write_frame(out_dir / "front.parquet", analysis.front)
    store.write_frame(out_dir / "fits.parquet", analysis.fits)
    records = analysis.fits.replace({np.nan: None}).to_dict(orient="records")
    store.write_json(out_dir / "fits.json", {"fits": records, "warnings": analysis.warnings})


def analyze_sweep(sweep_dir: Path, loss: str = "smoothed", skip_corrupt: bool = False
                  ) -> Analysis:
    """Load a sweep, analyze it, write its tables into the sweep folder."""
    from gnsweep.analysis.load import load_sweep

    runs, metrics = load_sweep(sweep_dir, skip_corrupt=skip_corrupt)
    targets = sweep_targets(sweep_dir)
    analysis = analyze_tables(runs, metrics, targets, loss=loss)
    unfinished = runs[~runs["state"].isin(store.FINISHED)]
    for run in unfinished.itertuples(index=False):
        analysis.warnings.append(f"run {run.run_id} is {run.state}: left out")
    write_outputs(sweep_dir, analysis)
    return analysis


def sweep_targets(sweep_dir: Path) -> list[float]:
    import yaml

    path = sweep_dir / store.SWEEP_CONFIG
    try:
        config = yaml.safe_load(path.read_text())
        return [float(t) for t in config["sweep"]["targets"]]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as err:
        raise store.StoreError(f"{path}: cannot read the sweep's targets ({err})") from None
