"""`gnsweep plot`: read a sweep's tables, draw its figures (`gnsweep.report.figures`), write
them atomically.

    <sweep>/figures/<name>.png, <name>.pdf   one pair per figure of gnsweep.report.figures.FIGURES
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from gnsweep import store
from gnsweep.commands import Echo
from gnsweep.figure_files import FORMATS, save
from gnsweep.paths import SweepPaths
from gnsweep.sweep_analysis import load_tables


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
        out = store.subdir(sweep_dir, SweepPaths(sweep_dir).figures_of(
            folder_name(group) if group else None))
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


def command(
    sweep_dir: Annotated[Path, typer.Argument(help="An analyzed sweep folder.")],
    svg: Annotated[bool, typer.Option("--svg", help="SVG instead of PDF beside each PNG.")
                   ] = False,
) -> None:
    """Draw every figure the sweep supports into DIR/figures (PNG and PDF).

    A figure the sweep cannot support is skipped with one line saying why (docs/figures.md).
    Runs `gnsweep analyze` first when its tables are missing.
    Example: gnsweep plot runs/digits
    """
    run(sweep_dir, svg, typer.echo)
