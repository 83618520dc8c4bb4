"""An opened sweep folder analysed: its runs read (`folder.SweepFolder`), the pure pipeline
(`gnsweep.analysis`) run on them, its tables written through the store, and what the verbs that
answer from an analysis share (`analyze`, `plot`, `report`, `recommend`, `plan`, `check`).
Nothing is written until the whole analysis has succeeded.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from gnsweep import store
from gnsweep.analysis.adaptive import analyze_adaptive, split_adaptive
from gnsweep.analysis.along import compare_schedule, split_along
from gnsweep.analysis.decision import floor_warnings, recommend
from gnsweep.analysis.pipeline import AnalysisError, analyze_tables
from gnsweep.analysis.recipe_warnings import recipe_of, recipe_warnings
from gnsweep.analysis.results import Results
from gnsweep.analysis.setting import Setting
from gnsweep.analysis.steps import Curves
from gnsweep.answer_record import runs_on_record
from gnsweep.folder import SweepFolder, read_noise_plan, read_results
from gnsweep.noise import Method
from gnsweep.paths import RUNS, SweepPaths
from gnsweep.targets import AUTO
from gnsweep.tasks import about

if TYPE_CHECKING:
    from gnsweep.config import Config


def write_outputs(out_dir: Path, analysis: Results) -> None:
    """Every output table, each atomically; called only once the analysis is complete."""
    store.write_results(out_dir, analysis)


def analyze_sweep(sweep_dir: Path, loss: str | None = None, skip_corrupt: bool = False,
                  **options: Any) -> Results:
    """`analyze_folder` of the sweep folder at `sweep_dir`, opened (and verified) here."""
    return analyze_folder(SweepFolder.open(sweep_dir), loss, skip_corrupt, **options)


def analyze_folder(folder: SweepFolder, loss: str | None = None,
                   skip_corrupt: bool = False, *,
                   bootstrap: int | None = None, ema_examples: float | None = None,
                   targets: list[float] | str | None = None, out_dir: Path | None = None,
                   write: bool = True) -> Results:
    """Analyze an opened sweep folder, write its tables into it (or into `out_dir`).

    `loss` and `bootstrap` default to the sweep's `analysis` config (else smoothed and 0),
    `targets` to the sweep's targets; "auto" (or a sweep with `sweep.targets=auto`) chooses
    them from the runs (`analysis.auto_targets`). A target no run reached is left out with a
    warning; the others are analysed. A task that declares its own metric (cartpole's return)
    has its targets decided on the logged `metric` column, in the task's direction.
    """
    from gnsweep.config import ConfigError

    # Opened once (config.yaml parsed, every run file checked); everything below reads from it.
    sweep_dir = folder.root
    # Read before the rows: a run that moves after this reads as newer than the analysis.
    used = runs_on_record(sweep_dir)
    curves = folder.curves(skip_corrupt=skip_corrupt)
    nothing_yet(sweep_dir, curves)
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
    config = folder.config
    if config.branch.points:  # runs branched from a base run's checkpoints: local B_crit
        analysis = analyze_branch_sweep(sweep_dir, config, curves, loss=loss,
                                        ema_examples=ema_examples, bootstrap=bootstrap)
        analysis.meta["runs_used"] = used
        if write:
            write_outputs(out_dir or sweep_dir, analysis)
        return analysis
    chosen: list[float] | str = targets or config.sweep.targets or AUTO
    task = about(config.task)
    if task.metric != "loss":
        if loss is not None or ema_examples is not None:
            raise ConfigError(f"task {task.name}: its targets are values of its {task.metric}, "
                              "not of a loss; drop --loss and --ema-examples")
        loss = "metric"
    loss = loss or config.analysis.loss
    if bootstrap is None:
        bootstrap = config.analysis.bootstrap
    optimizer = recipe_of(config).optimizer or "sgd"
    held = held_targets(out_dir or sweep_dir) if targets is None and chosen == AUTO else []
    fitted: Results | None = None
    held_note = ""
    if held:  # automatic targets do not move when runs are added
        try:
            fitted = analyze_tables(None, fixed, held, loss=loss, ema_examples=ema_examples,
                                    bootstrap=bootstrap, optimizer=optimizer,
                                    source=str(sweep_dir), direction=task.direction)
        except AnalysisError as err:
            held_note = f"the automatic targets held until now ({err}): chosen again"
        else:
            previous = store.read_json(SweepPaths(out_dir or sweep_dir).fits_json)["meta"]
            fitted.meta["targets_auto"] = previous.get("targets_auto")
            held_note = ("automatic targets held from the earlier analysis (runs added do not "
                         "move them); `gnsweep analyze DIR --targets auto` chooses them again")
    analysis = fitted or analyze_tables(None, fixed, chosen, loss=loss,
                                        ema_examples=ema_examples, bootstrap=bootstrap,
                                        optimizer=optimizer,
                                        source=str(sweep_dir), direction=task.direction)
    if held:
        analysis.meta["targets_held"] = held_note
    analysis.meta["runs_used"] = used
    # The targets analysed: chosen from the runs, or the given ones that some run reached.
    targets = [float(t) for t in analysis.fits["target"]]
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
    analysis.meta.update(metric=task.metric, unit=task.unit, **setting_meta(config, fixed.runs))
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
        finished = int(curves.runs["state"].isin(store.FINISHED).sum())
        analysis.warnings.append(
            f"{int(running.sum())} run{'s' if running.sum() > 1 else ''} still running: the "
            "targets they have passed are used, "
            "the others wait for them (analyze again when they end)"
            + ("; no run has finished yet: a partial analysis of the rows logged so far"
               if not finished else ""))
    analysis.warnings += unreadable_warnings(sweep_dir)
    if config.noise.method != Method.NONE:  # measurement off: B_simple absent by design
        analysis.warnings += unmeasured_warnings(curves, planned_off(sweep_dir))
    analysis.warnings = floor_warnings(analysis, Setting.from_meta(analysis.meta))
    analysis.recommendation = recommend(analysis).to_json()
    if write:
        write_outputs(out_dir or sweep_dir, analysis)
    return analysis


def held_targets(out_dir: Path) -> list[float]:
    """The targets an earlier analysis of the folder chose automatically (fits.json), which a
    later automatic analysis keeps; [] where there is none."""
    path = SweepPaths(out_dir).fits_json
    try:
        saved = store.read_json(path) if path.is_file() else None
    except store.StoreError:
        return []
    meta = saved.get("meta") if isinstance(saved, dict) else None
    if not (isinstance(meta, dict) and meta.get("targets_auto")):
        return []
    rows = saved.get("fits") if isinstance(saved, dict) else None
    targets = [row.get("target") for row in rows if isinstance(row, dict)] \
        if isinstance(rows, list) else []
    if not (targets and all(isinstance(t, int | float) and t > 0 for t in targets)):
        return []
    return [float(t) for t in targets if t is not None]


def nothing_yet(sweep_dir: Path, curves: Curves) -> None:
    """AnalysisError (one line, exit 2) when no run has a row to analyse: none has finished
    with its metrics, and none still training has logged a row yet (an analysis of nothing
    would be a table of NaN, or a fit of no points). Says how many runs are in which state."""
    runs = curves.runs
    lengths = curves.offsets[1:] - curves.offsets[:-1]
    if len(runs) and (lengths > 0).any():
        return
    counts = runs["state"].value_counts()
    states = ", ".join(f"{n} {state}" for state, n in counts.items())
    raise AnalysisError(
        f"{sweep_dir}: no run has logged a row to analyse yet ({states}); analyze again once "
        "a run has trained (a run still training is used up to where it stands; "
        f"`gnsweep status {sweep_dir}` shows why runs failed)")


def unreadable_warnings(sweep_dir: Path) -> list[str]:
    """One warning a run folder that holds no readable run record (`store.unreadable_runs`):
    never left out in silence."""
    return [f"run folder {RUNS}/{run_id}: {why}: left out (its grid point is unknown); "
            "relaunch the sweep (the same `gnsweep launch` command) to write it again"
            for run_id, why in store.unreadable_runs(sweep_dir).items()]


def setting_meta(config: Config, runs: pd.DataFrame) -> dict[str, Any]:
    """What a recommendation needs to say a batch size as the user sets it (fits.json's meta):
    `per_sample` (the task's unit per sample: tokens a sequence, from the runs' examples per
    step over their samples per step), `data_parallel` (processes a run trains on: the batch
    is set in multiples of it) and the `grid` in samples per step."""
    per_sample = 1.0
    if {"samples", "batch_size"} <= set(runs) and len(runs):
        samples = runs["samples"].astype(float)
        ok = samples > 0
        if ok.any():
            per_sample = float((runs["batch_size"].astype(float)[ok] / samples[ok]).median())
    executor = config.executor
    data_parallel = {"torchrun": executor.nproc_per_node,
                     "slurm": executor.nproc_per_node * executor.nodes}.get(executor.kind, 1)
    return {"per_sample": per_sample, "data_parallel": int(data_parallel),
            "grid": {"batch_sizes": list(config.sweep.batch_sizes),
                     "learning_rates": list(config.sweep.learning_rates)}}


def analyze_branch_sweep(sweep_dir: Path, config: Config, curves: Curves, *,
                         loss: str | None = None, ema_examples: float | None = None,
                         bootstrap: int | None = None) -> Results:
    """A branch sweep (`gnsweep branch`): one analysis per branch point to its relative targets,
    grouped by `at_examples`, with the local B_crit table (`analysis.along`) and the base run's
    noise scale over training where its folder is still there (for the figure)."""
    from gnsweep.analysis.along import BranchPoint, analyze_along, base_curve
    from gnsweep.folder import load_run_curves

    task, branch = about(config.task), config.branch
    if task.metric != "loss":
        loss = "metric"
    loss = loss or config.analysis.loss
    points = [BranchPoint(int(p["at_examples"]), int(p["at_step"]), float(p["at_loss"]),
                          *(math.nan if p[k] is None else float(p[k])
                            for k in ("b_simple", "b_noise"))) for p in branch.points]
    analysis = analyze_along(curves, points, branch.targets, loss=loss, ema_examples=ema_examples,
                             bootstrap=config.analysis.bootstrap if bootstrap is None
                             else bootstrap, optimizer=config.train.optimizer,
                             direction=task.direction, source=str(sweep_dir),
                             window=float(branch.window), tolerance=branch.tolerance,
                             unit=task.unit)
    base = Path(branch.base)
    try:
        analysis.along_base = base_curve(load_run_curves(base), loss)
    except store.StoreError as err:
        analysis.warnings.append(f"base run: {err}; the figure shows the branch points only")
    analysis.meta.update(metric=task.metric, unit=task.unit, branch_base=str(base))
    unfinished = curves.runs[~curves.runs["state"].isin(store.FINISHED)]
    for run in unfinished.itertuples(index=False):
        analysis.warnings.append(f"run {run.run_id} is {run.state}: left out")
    analysis.warnings += unreadable_warnings(sweep_dir)
    if config.noise.method != Method.NONE:  # measurement off: B_simple absent by design
        analysis.warnings += unmeasured_warnings(curves, planned_off(sweep_dir))
    return analysis


def load_tables(sweep_dir: Path, analyze: bool = True) -> Results:
    """The results of an analyzed folder: an `analyze --table` output's tables, or a sweep
    folder's (`folder_tables`, the folder opened here, once)."""
    if not store.is_sweep(sweep_dir) \
            and not os.path.lexists(SweepPaths(sweep_dir).config_file) \
            and SweepPaths(sweep_dir).result("fits").is_file():
        return read_results(sweep_dir)  # `analyze --table` output: no runs, no curves
    return folder_tables(SweepFolder.open(sweep_dir), analyze)


def folder_tables(folder: SweepFolder, analyze: bool = True) -> Results:
    """The results of an opened sweep folder with its runs and metrics; runs `gnsweep analyze`
    first when they are missing or older than the runs on record."""
    sweep_dir = folder.root
    if analyze and (not all(folder.result(name).exists() for name in ("steps", "front", "fits"))
                    or _stale(sweep_dir)):
        analyze_folder(folder)  # none yet, or older than the runs on record
    results = read_results(sweep_dir)
    runs, metrics = folder.tables(skip_corrupt=True)
    # Adaptive runs are drawn from the adaptive table (along runs, sweep.schedule=along, are in
    # along_schedule); the curves figures show grid runs.
    varying = runs.get("exchange_rate", 0.0 * runs["batch_size"]) > 0
    if "along" in runs:
        varying = varying | runs["along"].astype(bool)
    adaptive = runs["run_id"][varying]
    results.runs = runs[~runs["run_id"].isin(adaptive)].reset_index(drop=True)
    results.metrics = metrics[~metrics["run_id"].isin(adaptive)].reset_index(drop=True)
    return results


def _stale(sweep_dir: Path) -> bool:
    """Whether the folder's analysis does not cover every run on record as it stands."""
    from gnsweep.answer_record import stale

    try:
        return bool(stale(sweep_dir, store.read_json(SweepPaths(sweep_dir).fits_json)["meta"]))
    except (store.StoreError, KeyError, TypeError):
        return True


def analysed_results(sweep_dir: Path, notes: list[str] | None = None) -> Results:
    """The folder's results: its tables where analysed (an `analyze --table` output, or a sweep
    folder whose analysis covers every run on record as it stands now), else the sweep folder
    analysed now (its tables written, as `gnsweep analyze`). `notes` gets one line where the
    analysis was older than the runs (analysed again, or, where that fails, said)."""
    from gnsweep.analysis.pipeline import AnalysisError
    from gnsweep.answer_record import stale
    if not sweep_dir.is_dir():
        raise store.StoreError(f"{sweep_dir}: no such folder; give a sweep folder or the --out "
                               "folder of `gnsweep analyze --table`")
    if SweepPaths(sweep_dir).result("fits").is_file():
        results = read_results(sweep_dir)
        moved = stale(sweep_dir, results.meta) if store.is_sweep(sweep_dir) else ""
        if not moved:
            return results
        try:
            fresh = analyze_sweep(sweep_dir)
        except (AnalysisError, store.StoreError) as err:
            if notes is not None:
                notes.append(f"this answer is older than the runs ({moved}); analysing them "
                             f"again failed: {err}")
            return results
        if notes is not None:
            notes.append(f"analysed again: the analysis on record was older than the runs "
                         f"({moved})")
        return fresh
    store.require_sweep(sweep_dir)
    return analyze_sweep(sweep_dir)


def setting_of(sweep_dir: Path, results: Results) -> Setting:
    """fits.json's setting (`setting_meta`); for a folder analysed before it
    was recorded, the sweep's config gives the grid and the data-parallel size."""
    setting = Setting.from_meta(results.meta)
    if "grid" in results.meta or not store.is_sweep(sweep_dir):
        return setting
    from dataclasses import replace

    from gnsweep.folder import read_config

    meta = setting_meta(read_config(sweep_dir), results.runs)
    return replace(setting, data_parallel=int(meta["data_parallel"]),
                   batch_sizes=tuple(meta["grid"]["batch_sizes"]),
                   learning_rates=tuple(meta["grid"]["learning_rates"]))


def planned_off(sweep_dir: Path) -> set[str]:
    """The runs the folder's noise plan leaves unmeasured (`gnsweep.noise_plan`)."""
    from gnsweep.noise_plan import OFF

    plan = read_noise_plan(sweep_dir)
    return {run_id for run_id, a in plan.items() if a.role == OFF}


def unmeasured_warnings(curves: Curves, off: set[str] | None = None) -> list[str]:
    """The line naming finished runs whose logged B_simple is NaN on more than
    `runs.UNMEASURED_SHARE` of their rows (`runs.unmeasured_line`), as a warning; none where
    every run was measured, or where none was (a sweep that measures no noise scale). `off`:
    runs the noise plan leaves unmeasured, by design (not named)."""
    from gnsweep.runs import unmeasured_line, unmeasured_share

    b_simple = curves.columns["b_simple"]
    finished = curves.runs["state"].isin(store.FINISHED).to_numpy()
    shares = {}
    for i, run_id in enumerate(curves.runs["run_id"].astype(str)):
        lo, hi = curves.offsets[i], curves.offsets[i + 1]
        if run_id in (off or set()):
            continue
        if finished[i] and hi > lo:
            shares[run_id] = unmeasured_share(b_simple[lo:hi].tolist())
    if shares and all(s == 1.0 for s in shares.values()) and len(shares) > 1:
        # B_simple on no step of any run: a sweep measuring nothing says so once.
        return ["B_simple was not measured in any run (NaN on every step): the report has no "
                "noise scale to compare B_crit with"]
    line = unmeasured_line(shares)
    return [line.removeprefix("WARNING: ")] if line else []
