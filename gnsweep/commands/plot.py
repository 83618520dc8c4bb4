"""`gnsweep plot`: read a sweep's tables, draw its figures (`gnsweep.report.figures`), write
them atomically.

    <sweep>/figures/<name>.png, <name>.pdf   one pair per figure of gnsweep.report.figures.FIGURES
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gnsweep import store
from gnsweep.analysis.results import Results
from gnsweep.commands import Echo
from gnsweep.folder import SweepFolder, read_results
from gnsweep.paths import SweepPaths

FORMATS = ("png", "pdf")


def load_tables(sweep_dir: Path | SweepFolder, analyze: bool = True) -> Results:
    """The results of an analyzed sweep with its runs and metrics; runs `gnsweep analyze`
    first when they are missing. A sweep folder is opened once (`SweepFolder.open`) unless
    given opened."""
    from gnsweep.commands.analyze import analyze_sweep

    if isinstance(sweep_dir, SweepFolder):
        folder: SweepFolder | None = sweep_dir
        sweep_dir = sweep_dir.root
    else:
        folder = None
    if folder is None and not store.is_sweep(sweep_dir) \
            and not os.path.lexists(SweepPaths(sweep_dir).config_file) \
            and SweepPaths(sweep_dir).result("fits").is_file():
        return read_results(sweep_dir)  # `analyze --table` output: no runs, no curves
    folder = folder or SweepFolder.open(sweep_dir)
    if analyze and (not all(folder.result(name).exists() for name in ("steps", "front", "fits"))
                    or _stale(sweep_dir)):
        analyze_sweep(folder)  # none yet, or older than the runs on record
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


def save(fig, stem: str, out_dir: Path, formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """Write one figure in each format atomically and close it; returns the paths."""
    import matplotlib.pyplot as plt

    paths = []
    for fmt in formats:
        path = Path(out_dir) / f"{stem}.{fmt}"
        with store.atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt)
        paths.append(path)
    plt.close(fig)
    return paths


@dataclass
class Written:
    paths: list[Path]
    skipped: dict[str, str]
    """figure name -> why it was not drawn"""
    notes: list[str]


def write_figures(sweep_dir: Path, formats: tuple[str, ...] = FORMATS) -> Written:
    """Draw every figure the sweep supports into <sweep>/figures/ (into figures/<group>/ for
    each group of an `analyze --group-by` output; skipped and notes then name the group)."""
    from gnsweep.analysis.groups import split
    from gnsweep.report import figures as plots

    tables = load_tables(sweep_dir)
    paths: list[Path] = []
    skipped: dict[str, str] = {}
    notes: list[str] = []
    for group, part in split(tables).items():
        # A real folder inside the sweep folder: a `figures` link must not send writes elsewhere.
        out = store.subdir(sweep_dir, f"{store.FIGURES}/{folder_name(group)}" if group
                           else store.FIGURES)
        for name, result in plots.draw_all(part).items():
            if isinstance(result, str):
                skipped[f"{group}/{name}" if group else name] = result
            else:
                paths += save(result, name, out, formats)
        notes += [f"{group}: {n}" if group else n for n in plots.notes(part)]
    # A branch sweep: the local B_crit of every branch point in one figure.
    for name, result in plots.draw_along(tables).items():
        if isinstance(result, str):
            skipped[name] = result
        else:
            paths += save(result, name, SweepPaths(sweep_dir).figures, formats)
    return Written(paths, skipped, notes)


def folder_name(group: str) -> str:
    """A group's value as a folder name (slashes and spaces replaced)."""
    import re

    return re.sub(r"[^\w.=+-]+", "_", group).strip("._") or "_"


def run(sweep_dir: Path, svg: bool, echo: Echo) -> None:
    """`gnsweep plot DIR [--svg]`: the figures written, one path a line; skipped figures and
    notes on stderr."""
    written = write_figures(sweep_dir, formats=("png", "svg" if svg else "pdf"))
    for name, reason in written.skipped.items():
        echo(f"skipped {name}: {reason}", err=True)
    for note in written.notes:
        echo(f"note: {note}", err=True)
    for path in written.paths:
        echo(str(path))
