"""`gnsweep analyze`: a sweep folder (or a table of measurements) in, its results out.
`analyze_sweep` reads the runs and the sweep's config, runs the pure pipeline
(`gnsweep.analysis.pipeline`) and writes the tables through the store. Nothing is written until
the whole analysis has succeeded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from gnsweep import store
from gnsweep.analysis.adaptive import analyze_adaptive, split_adaptive
from gnsweep.analysis.along import compare_schedule, split_along
from gnsweep.analysis.decision import floor_warnings, recommend
from gnsweep.analysis.pipeline import AnalysisError, analyze_tables
from gnsweep.analysis.recipe_warnings import recipe_warnings
from gnsweep.analysis.results import Results
from gnsweep.analysis.setting import Setting
from gnsweep.analysis.steps import Curves
from gnsweep.answer_record import runs_on_record
from gnsweep.commands import Echo
from gnsweep.folder import SweepFolder
from gnsweep.paths import SweepPaths
from gnsweep.targets import AUTO
from gnsweep.tasks import about

if TYPE_CHECKING:
    from gnsweep.config import Config


def write_outputs(out_dir: Path, analysis: Results) -> None:
    """Every output table, each atomically; called only once the analysis is complete."""
    store.write_results(out_dir, analysis)


def analyze_sweep(sweep_dir: Path | SweepFolder, loss: str | None = None,
                  skip_corrupt: bool = False, *,
                  bootstrap: int | None = None, ema_examples: float | None = None,
                  targets: list[float] | str | None = None, out_dir: Path | None = None,
                  write: bool = True) -> Results:
    """Load a sweep, analyze it, write its tables into the sweep folder (or `out_dir`).

    `loss` and `bootstrap` default to the sweep's `analysis` config (else smoothed and 0),
    `targets` to the sweep's targets; "auto" (or a sweep with `sweep.targets=auto`) chooses
    them from the runs (`analysis.auto_targets`). A target no run reached is left out with a
    warning; the others are analysed. A task that declares its own metric (cartpole's return)
    has its targets decided on the logged `metric` column, in the task's direction.
    """
    from gnsweep.config import ConfigError

    # Opened once: config.yaml parsed, every run file checked; everything below reads from it.
    folder = sweep_dir if isinstance(sweep_dir, SweepFolder) else SweepFolder.open(sweep_dir)
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
    held = held_targets(out_dir or sweep_dir) if targets is None and chosen == AUTO else []
    fitted: Results | None = None
    held_note = ""
    if held:  # automatic targets do not move when runs are added
        try:
            fitted = analyze_tables(None, fixed, held, loss=loss, ema_examples=ema_examples,
                                    bootstrap=bootstrap, optimizer=config.train.optimizer,
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
                                        optimizer=config.train.optimizer,
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
    if config.noise.method != "none":  # measurement off: B_simple absent by design
        analysis.warnings += unmeasured_warnings(curves)
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
    return [f"run folder {store.RUNS}/{run_id}: {why}: left out (its grid point is unknown); "
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
    if config.noise.method != "none":  # measurement off: B_simple absent by design
        analysis.warnings += unmeasured_warnings(curves)
    return analysis


def parse_targets(text: str | None) -> list[float] | str | None:
    """`--targets 0.5,0.2` (or `[0.5, 0.2]`) as numbers, `auto` as AUTO; ConfigError for
    anything else."""
    from gnsweep.config import ConfigError

    if not text:
        return None
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        values = [float(part) for part in text.replace(" ", "").strip("[]").split(",") if part]
    except ValueError:
        raise ConfigError(f"--targets: {text!r} is not a comma-separated list of numbers"
                          ) from None
    if not values or any(not (v > 0 and v < float("inf")) for v in values):
        raise ConfigError(f"--targets: {text!r}: give positive finite losses, e.g. 0.5,0.2, "
                          "or auto")
    return values


def run(sweep_dir: Path | None, *, table: Path | None, out: Path | None, targets: str | None,
        loss: str | None, ema_examples: float | None, bootstrap: int | None, optimizer: str,
        group_by: str | None, as_json: bool, skip_corrupt: bool, echo: Echo) -> None:
    """`gnsweep analyze`: check the options, analyze a sweep folder or a --table file, write the
    tables, print the fits (on stderr with --json, which prints fits.json's content instead)."""
    import json

    from gnsweep.analysis.external import analyze_table
    from gnsweep.config import LOSS_KINDS, OPTIMIZERS, ConfigError
    from gnsweep.report.console import format_fits

    if (sweep_dir is None) == (table is None):
        raise ConfigError("give a sweep folder or --table FILE (one of them)")
    if loss is not None and loss not in LOSS_KINDS:
        raise ConfigError(f"--loss: {loss!r} is not one of {', '.join(LOSS_KINDS)}")
    if ema_examples is not None and (loss or "smoothed") != "smoothed":
        raise ConfigError("--ema-examples re-smooths the training loss; it needs --loss smoothed")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    target_list = parse_targets(targets)
    if group_by is not None and table is None:
        raise ConfigError("--group-by groups the rows of a --table FILE; a sweep folder is one "
                          "workload")
    if table is not None:
        if out is None:
            raise ConfigError("--table needs --out DIR for the tables")
        result = analyze_table(table, target_list, loss=loss or "smoothed",
                               ema_examples=ema_examples, bootstrap=bootstrap or 0,
                               optimizer=optimizer, group_by=group_by)
        if group_by is None:  # one workload: one decision
            result.warnings = floor_warnings(result, Setting.from_meta(result.meta))
            result.recommendation = recommend(result).to_json()
        write_outputs(out, result)
    else:
        assert sweep_dir is not None
        result = analyze_sweep(sweep_dir, loss=loss, skip_corrupt=skip_corrupt,
                               ema_examples=ema_examples, bootstrap=bootstrap,
                               targets=target_list, out_dir=out)
        out = out or sweep_dir
    if result.meta.get("targets_held"):
        echo(str(result.meta["targets_held"]), err=as_json)
    if sweep_dir is not None and out is sweep_dir and result.recommendation is not None:
        from gnsweep.answer_record import remember

        for line in remember(sweep_dir, "analyze", result.recommendation, result.meta,
                             result.fits):
            echo(line, err=as_json)
    if result.recommendation is not None:  # the decision first, then what it rests on
        from gnsweep.report.recommendation import lines
        from gnsweep.report.views import quantity

        for line in lines(result.recommendation, quantity(result.meta)):
            echo(line, err=as_json)
    echo(format_fits(result.fits, result.loss_scaling, result.meta.get("group_by"), result.front),
         err=as_json)
    if len(result.along_schedule):  # runs following a measured B_crit (sweep.schedule=along)
        from gnsweep.report.console import format_schedule

        echo(format_schedule(result.along_schedule), err=as_json)
    if len(result.along):  # a branch sweep (`gnsweep branch`): the local B_crit per point
        from gnsweep.report.console import format_along

        echo(format_along(result.along, result.meta.get("unit", "examples")), err=as_json)
    if len(result.adaptive):
        from gnsweep.report.console import format_adaptive

        echo(format_adaptive(result.adaptive), err=as_json)
    if sweep_dir is not None:  # what share of the steps the noise scale was measured on
        from gnsweep.commands.status import sweep_measurement_note

        note = sweep_measurement_note(sweep_dir)
        if note:
            echo(note, err=as_json)
    for warning in result.warnings:
        echo(f"warning: {warning}", err=True)
    echo(f"tables: {out}/steps.parquet, front.parquet, fits.parquet, lr_fits.parquet, "
         "loss_scaling.parquet, temperature.parquet, fits.json"
         + (", along.parquet" if len(result.along) else ""),
         err=as_json)
    if as_json:
        echo(json.dumps(result.to_json(), indent=2, sort_keys=True))


def unmeasured_warnings(curves: Curves) -> list[str]:
    """The line naming finished runs whose logged B_simple is NaN on more than
    `runs.UNMEASURED_SHARE` of their rows (`runs.unmeasured_line`), as a warning; none where
    every run was measured, or where none was (a sweep that measures no noise scale)."""
    from gnsweep.runs import unmeasured_line, unmeasured_share

    b_simple = curves.columns["b_simple"]
    finished = curves.runs["state"].isin(store.FINISHED).to_numpy()
    shares = {}
    for i, run_id in enumerate(curves.runs["run_id"].astype(str)):
        lo, hi = curves.offsets[i], curves.offsets[i + 1]
        if finished[i] and hi > lo:
            shares[run_id] = unmeasured_share(b_simple[lo:hi].tolist())
    if shares and all(s == 1.0 for s in shares.values()) and len(shares) > 1:
        # B_simple on no step of any run: a sweep measuring nothing says so once.
        return ["B_simple was not measured in any run (NaN on every step): the report has no "
                "noise scale to compare B_crit with"]
    line = unmeasured_line(shares)
    return [line.removeprefix("WARNING: ")] if line else []
