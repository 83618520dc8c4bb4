"""A sweep folder in, its results out: `analyze_sweep` reads the runs and the sweep's config,
runs the pure pipeline (`gnsweep.analysis.pipeline`) and writes the tables through the store.
Nothing is written until the whole analysis has succeeded.

The pipeline's and the console's names are re-exported here, where the first version kept them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from gnsweep import store
from gnsweep.analysis.adaptive import analyze_adaptive, split_adaptive
from gnsweep.analysis.along import compare_schedule, split_along
from gnsweep.analysis.console import format_fits
from gnsweep.analysis.pipeline import (
    ALL_FIT_COLUMNS,
    FIT_COLUMNS,
    FIT_EXTRA_COLUMNS,
    OUTPUT_FILES,
    Analysis,
    AnalysisError,
    analyze_steps,
    analyze_tables,
    fit_quality,
    fit_target,
    median_with_error,
    ratio_with_error,
)
from gnsweep.analysis.recipe import recipe_warnings
from gnsweep.analysis.results import Results
from gnsweep.analysis.steps import Curves

if TYPE_CHECKING:
    from gnsweep.config import Config

__all__ = ["ALL_FIT_COLUMNS", "FIT_COLUMNS", "FIT_EXTRA_COLUMNS", "OUTPUT_FILES", "Analysis",
           "AnalysisError", "Results", "analyze_steps", "analyze_sweep", "analyze_tables",
           "fit_quality", "fit_target", "format_fits", "median_with_error", "ratio_with_error",
           "write_outputs"]


def write_outputs(out_dir: Path, analysis: Results) -> None:
    """Every output table, each atomically; called only once the analysis is complete."""
    store.write_results(out_dir, analysis)


def analyze_sweep(sweep_dir: Path, loss: str | None = None, skip_corrupt: bool = False, *,
                  bootstrap: int | None = None, ema_examples: float | None = None,
                  targets: list[float] | None = None, out_dir: Path | None = None,
                  write: bool = True) -> Analysis:
    """Load a sweep, analyze it, write its tables into the sweep folder (or `out_dir`).

    `loss` and `bootstrap` default to the sweep's `analysis` config (else smoothed and 0),
    `targets` to the sweep's targets. A task that declares its own metric (cartpole's return)
    has its targets decided on the logged `metric` column, in the task's direction.
    """
    from gnsweep.analysis.load import load_curves
    from gnsweep.config import Config, ConfigError

    curves = load_curves(sweep_dir, skip_corrupt=skip_corrupt)
    # Adaptive runs (appendix D) stay out of the fits of eq. 2.11; they are measured against them.
    fixed, adaptive = split_adaptive(curves)
    # Runs following a measured B_crit curve (sweep.schedule=along): measured against the fit.
    fixed, along = split_along(fixed)
    if adaptive is not None and not len(fixed.runs):
        raise AnalysisError(
            f"{sweep_dir}: only adaptive runs ({len(adaptive.runs)}), which are measured against "
            "the fixed-batch grid's fit (eq. 2.11): launch the grid into this folder first "
            f"(gnsweep launch --sweep-dir {sweep_dir}, the same overrides without "
            "sweep.schedule=adaptive), then analyze again")
    config = Config.load(sweep_dir)
    if config.branch.points:  # runs branched from a base run's checkpoints: local B_crit
        analysis = analyze_branch_sweep(sweep_dir, config, curves, loss=loss,
                                        ema_examples=ema_examples, bootstrap=bootstrap)
        if write:
            write_outputs(out_dir or sweep_dir, analysis)
        return analysis
    targets = targets or config.sweep.targets
    task = config.task
    if task.metric != "loss":
        if loss is not None or ema_examples is not None:
            raise ConfigError(f"task {task.name}: its targets are values of its {task.metric}, "
                              "not of a loss; drop --loss and --ema-examples")
        loss = "metric"
    loss = loss or config.analysis.loss
    if bootstrap is None:
        bootstrap = config.analysis.bootstrap
    analysis = analyze_tables(None, fixed, targets, loss=loss, ema_examples=ema_examples,
                              bootstrap=bootstrap, optimizer=config.train.optimizer,
                              source=str(sweep_dir), direction=task.direction)
    if adaptive is not None:
        analysis.adaptive = analyze_adaptive(adaptive, analysis.fits, targets, loss=loss,
                                             ema_examples=ema_examples,
                                             direction=task.direction)
    if along is not None:
        analysis.along_schedule = compare_schedule(along, analysis.front, targets,
                                                   fits=analysis.fits, loss=loss,
                                                   ema_examples=ema_examples,
                                                   direction=task.direction)
    # Where the learning-rate schedule, not the batch size, decides the answer.
    analysis.warnings += recipe_warnings(config, analysis.fits, analysis.front)
    # What the targets are values of, for figures and the report ("loss", "return"), and B's unit.
    analysis.meta.update(metric=task.metric, unit=task.unit)
    unfinished = curves.runs[~curves.runs["state"].isin(store.FINISHED)]
    running = unfinished["state"] == "running"
    for run in unfinished[~running].itertuples(index=False):
        if getattr(run, "problem", ""):
            analysis.warnings.append(
                f"run {run.run_id} {run.problem}: left out; relaunch the sweep (the same "
                f"`gnsweep launch` command) to run it again")
        else:
            analysis.warnings.append(f"run {run.run_id} is {run.state}: left out")
    if running.any():
        analysis.warnings.append(
            f"{int(running.sum())} runs still running: the targets they have passed are used, "
            "the others wait for them (analyze again when they end)")
    if write:
        write_outputs(out_dir or sweep_dir, analysis)
    return analysis


def analyze_branch_sweep(sweep_dir: Path, config: Config, curves: Curves, *,
                         loss: str | None = None, ema_examples: float | None = None,
                         bootstrap: int | None = None) -> Analysis:
    """A branch sweep (`gnsweep branch`): one analysis per branch point to its relative targets,
    grouped by `at_examples`, with the local B_crit table (`analysis.along`) and the base run's
    noise scale over training where its folder is still there (for the figure)."""
    from gnsweep.analysis.along import BranchPoint, analyze_along, base_curve
    from gnsweep.analysis.load import load_run_curves

    task, branch = config.task, config.branch
    if task.metric != "loss":
        loss = "metric"
    loss = loss or config.analysis.loss
    points = [BranchPoint(int(p["at_examples"]), int(p["at_step"]), float(p["at_loss"]),
                          *(math.nan if p[k] is None else float(p[k])
                            for k in ("b_simple", "b_noise"))) for p in branch.points]
    analysis = analyze_along(curves, points, branch.targets, loss=loss, ema_examples=ema_examples,
                             bootstrap=config.analysis.bootstrap if bootstrap is None
                             else bootstrap, optimizer=config.train.optimizer,
                             direction=task.direction, source=str(sweep_dir))
    base = Path(branch.base)
    try:
        analysis.along_base = base_curve(load_run_curves(base), loss)
    except store.StoreError as err:
        analysis.warnings.append(f"base run: {err}; the figure shows the branch points only")
    analysis.meta.update(metric=task.metric, unit=task.unit, branch_base=str(base))
    unfinished = curves.runs[~curves.runs["state"].isin(store.FINISHED)]
    for run in unfinished.itertuples(index=False):
        analysis.warnings.append(f"run {run.run_id} is {run.state}: left out")
    return analysis
