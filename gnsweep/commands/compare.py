"""`gnsweep compare`: the I/O around the pure comparison (`gnsweep.analysis.crit_vs_simple`) and its
figures (`gnsweep.report.compare_figures`).

    <out>/compare.parquet                    one row per sweep x target (store.COMPARE_SCHEMA)
    <out>/bcrit_vs_noise_scale.png, .pdf     the paper's headline figure
    <out>/noise_scale_vs_target.png, .pdf    B_simple against the target reached, per task
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer

from gnsweep import store
from gnsweep.analysis.crit_vs_simple import SweepFits, compare_rows
from gnsweep.commands import Echo
from gnsweep.errors import ConfigError, StoreError
from gnsweep.paths import RUNS, SWEEP_CONFIG, OutPaths, SweepPaths
from gnsweep.tasks import about

FORMATS = ("png", "pdf")


def load_sweep_fits(sweep_dir: Path) -> SweepFits:
    """An analysed sweep's fits with what its task declares (the folder opened, no torch).

    StoreError in one line for a folder that is not a sweep or not analysed yet.
    """
    from gnsweep.folder import SweepFolder

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise StoreError(f"{sweep_dir}: no such folder; give sweep folders written by "
                         "`gnsweep launch` and analysed by `gnsweep analyze`")
    if not store.is_sweep(sweep_dir):
        raise StoreError(f"{sweep_dir}: not a sweep folder (no {SWEEP_CONFIG} and "
                         f"{RUNS}/); give folders written by `gnsweep launch`")
    fits_file = SweepPaths(sweep_dir).result("fits")
    if not fits_file.is_file():
        raise StoreError(f"{sweep_dir}: not an analysed sweep (no fits.parquet); run "
                         f"`gnsweep analyze {sweep_dir}` first")
    config = SweepFolder.open(sweep_dir).config  # its run files checked, as every reader does
    fits = store.read_table(fits_file).to_pandas()
    task = about(config.task)
    return SweepFits(task=task.label, sweep=sweep_dir.name, sweep_dir=str(sweep_dir),
                     metric=task.metric, direction=task.direction,
                     unit=task.unit, fits=fits)


@dataclass
class Compared:
    table: pd.DataFrame
    paths: list[Path]
    """compare.parquet and the figures written."""
    skipped: dict[str, str]
    """figure name -> why it was not drawn"""


def compare_sweeps(sweep_dirs: list[Path], out_dir: Path,
                   formats: tuple[str, ...] = FORMATS) -> Compared:
    """Read every sweep (all of them first: a bad folder stops before anything is written),
    then write compare.parquet and the figures into `out_dir`."""
    from gnsweep.figure_files import save
    from gnsweep.report import compare_figures as compare_plots

    if not sweep_dirs:
        raise ConfigError("give at least one analysed sweep folder")
    seen: set[Path] = set()
    for path in sweep_dirs:
        if Path(path).resolve() in seen:
            raise ConfigError(f"{path}: given twice")
        seen.add(Path(path).resolve())
    out_dir = Path(out_dir)
    owner = store.sweep_owning(out_dir)
    if owner is not None:
        where = ("a sweep folder" if owner == Path(os.path.abspath(out_dir))
                 else f"inside the runs of sweep {owner}")
        raise ConfigError(f"--out {out_dir}: {where}; a comparison gets a folder of its own: "
                          "give another --out")
    table = compare_rows([load_sweep_fits(Path(p)) for p in sweep_dirs])
    compared = OutPaths(out_dir).compare
    store.write_frame(compared, table, schema=store.COMPARE_SCHEMA)
    paths = [compared]
    skipped: dict[str, str] = {}
    for name, figure in compare_plots.draw_all(table).items():
        if isinstance(figure, str):
            skipped[name] = figure
        else:
            paths += save(figure, name, out_dir, formats)
    return Compared(table, paths, skipped)


def read_compare(out_dir: Path) -> pd.DataFrame:
    """compare.parquet of a `gnsweep compare` folder."""
    return store.read_table(OutPaths(Path(out_dir)).compare).to_pandas()


def run(sweep_dirs: list[Path], out: Path, svg: bool, echo: Echo) -> None:
    """`gnsweep compare DIR... --out OUT [--svg]`: the table, then the files written."""
    from gnsweep.report.console import format_compare

    result = compare_sweeps(sweep_dirs, out, formats=("png", "svg" if svg else "pdf"))
    echo(format_compare(result.table))
    for name, reason in result.skipped.items():
        echo(f"skipped {name}: {reason}", err=True)
    for path in result.paths:
        echo(str(path))


def command(
    sweep_dirs: Annotated[list[Path], typer.Argument(
        help="Analysed sweep folders (`gnsweep analyze` wrote their fits.parquet).")],
    out: Annotated[Path, typer.Option("--out", help="Folder for compare.parquet and the "
                                                    "figures.")],
    svg: Annotated[bool, typer.Option("--svg", help="SVG instead of PDF beside each PNG.")
                   ] = False,
) -> None:
    """B_crit against the noise scale B_simple across sweeps (the paper's headline figure).

    Writes OUT/compare.parquet (one row per sweep x target), bcrit_vs_noise_scale.png/.pdf and
    noise_scale_vs_target.png/.pdf (docs/compare.md).
    Example: gnsweep compare runs/paper/digits runs/paper/linreg --out runs/paper/compare
    """
    run(sweep_dirs, out, svg, typer.echo)
