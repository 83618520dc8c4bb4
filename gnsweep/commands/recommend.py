"""`gnsweep recommend`: an analysed sweep folder (or `analyze --table` output) in, the batch size
and learning rate to train with out (`analysis.decision`). Runs `gnsweep analyze` first where
the folder has not been analysed; writes nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

from gnsweep import store
from gnsweep.analysis.decision import PREFERENCES, Recommendation, recommend
from gnsweep.analysis.results import Results
from gnsweep.analysis.setting import Setting
from gnsweep.commands import Echo
from gnsweep.errors import ConfigError
from gnsweep.folder import read_results
from gnsweep.paths import SweepPaths


def load(sweep_dir: Path, notes: list[str] | None = None) -> Results:
    """The folder's results: its tables where analysed (an `analyze --table` output, or a sweep
    folder whose analysis covers every run on record as it stands now), else the sweep folder
    analysed now (its tables written, as `gnsweep analyze`). `notes` gets one line where the
    analysis was older than the runs (analysed again, or, where that fails, said)."""
    from gnsweep.analysis.pipeline import AnalysisError
    from gnsweep.answer_record import stale
    from gnsweep.commands.analyze import analyze_sweep

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
    """fits.json's setting (`commands.analyze.setting_meta`); for a folder analysed before it
    was recorded, the sweep's config gives the grid and the data-parallel size."""
    setting = Setting.from_meta(results.meta)
    if "grid" in results.meta or not store.is_sweep(sweep_dir):
        return setting
    from dataclasses import replace

    from gnsweep.commands.analyze import setting_meta
    from gnsweep.folder import read_config

    meta = setting_meta(read_config(sweep_dir), results.runs)
    return replace(setting, data_parallel=int(meta["data_parallel"]),
                   batch_sizes=tuple(meta["grid"]["batch_sizes"]),
                   learning_rates=tuple(meta["grid"]["learning_rates"]))


def make(sweep_dir: Path, *, target: float | None = None, prefer: str = "balanced",
         notes: list[str] | None = None) -> tuple[Recommendation, Results]:
    """The recommendation for a folder (module doc); ConfigError for a bad --prefer or a
    --target that was not analysed."""
    if prefer not in PREFERENCES:
        raise ConfigError(f"--prefer: {prefer!r} is not one of {', '.join(PREFERENCES)}")
    results = load(sweep_dir, notes)
    if len(results.along):
        raise ConfigError(f"{sweep_dir}: a branch sweep; its answer is per branch point: "
                          f"gnsweep analyze {sweep_dir} (along.parquet)")
    try:
        return recommend(results, prefer, target, setting_of(sweep_dir, results)), results
    except KeyError as err:
        raise ConfigError(str(err.args[0]).replace("DIR", str(sweep_dir))) from None


def run(sweep_dir: Path, *, target: float | None, prefer: str, as_json: bool,
        echo: Echo) -> int:
    """`gnsweep recommend`: the recommendation as text (or JSON with --json); exit code 0
    whatever its status (a script reads `status`), 2 for bad input."""
    from gnsweep.answer_record import remember
    from gnsweep.report.recommendation import lines
    from gnsweep.report.views import quantity

    notes: list[str] = []
    rec, results = make(sweep_dir, target=target, prefer=prefer, notes=notes)
    data = rec.to_json()
    for note in notes:
        echo(note, err=as_json)
    if store.is_sweep(sweep_dir):  # recorded with its runs; a changed answer says why
        key = "recommend" + (f" --prefer {prefer}" if prefer != "balanced" else "") + (
            f" --target {target:g}" if target is not None else "")
        for line in remember(sweep_dir, key, data, results.meta, results.fits):
            echo(line, err=as_json)
    if as_json:
        echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        for line in lines(data, quantity(results.meta)):
            echo(line)
        if rec.status == "bound" and rec.next_grid is not None and rec.next_grid.runs \
                and store.is_sweep(sweep_dir):
            echo(f"to run exactly those {len(rec.next_grid.runs)} runs: gnsweep plan {sweep_dir}")
    return 0
