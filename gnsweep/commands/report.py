"""`gnsweep report`: read a sweep, draw its figures as PNG bytes, render the one-page HTML
(`gnsweep.report.html`) and write <sweep>/report.html atomically.

`gnsweep report DIR --watch` keeps DIR/report.html current while the sweep runs: every `every`
seconds the runs' states and rows are read; when any moved, the page is written again: the
live view (progress, the runs not finished, every run's loss curve so far; `report.live`)
above the report of what the runs have reached so far (analysed again; before any run has
reached anything, why there is no answer yet). The page reloads itself while the sweep runs.
The watch ends once no run is left to run (done, diverged or failed), after a last page
without the reload, or on Ctrl-C."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from gnsweep import store
from gnsweep.analysis.results import Results
from gnsweep.commands import Echo
from gnsweep.config import Config
from gnsweep.folder import SweepFolder, live_metrics
from gnsweep.paths import SweepPaths, run_dir
from gnsweep.tasks import about


def write_report(sweep_dir: Path) -> tuple[Path, dict[str, str], list[str]]:
    """Draw the figures and write <folder>/report.html; returns (path, skipped, notes).

    The folder is a sweep, or the output of `gnsweep analyze --table` (one section per group
    when it was grouped; skipped figures and notes are then named `<group>/<figure>`)."""
    text, skipped, notes = report_text(sweep_dir)
    path = SweepPaths(sweep_dir).report
    store.write_text(path, text)
    return path, skipped, notes


def report_text(sweep_dir: Path, live: list[str] | None = None, refresh: float | None = None
                ) -> tuple[str, dict[str, str], list[str]]:
    """The report's HTML, its skipped figures and its notes (`write_report`); `live` and
    `refresh`: the live view's section and reload period (`gnsweep.commands.report`)."""
    import json

    from gnsweep.analysis.groups import split
    from gnsweep.folder import SweepFolder
    from gnsweep.report import figures as plots
    from gnsweep.report.figures import png_bytes
    from gnsweep.report.html import render
    from gnsweep.sweep_analysis import folder_tables, load_tables

    # A sweep folder is opened once (config.yaml parsed, run files checked) and passed down.
    opened = SweepFolder.open(sweep_dir) if store.is_sweep(sweep_dir) else None
    tables = folder_tables(opened) if opened is not None else load_tables(sweep_dir)
    measured = None
    if opened is not None:
        from gnsweep.status_rows import sweep_measurement_note

        measured = sweep_measurement_note(sweep_dir)
        loaded = opened.config
        config: Config | None = loaded
        config_text = store.read_text(opened.config_file)
        name = about(loaded.task).label  # what was trained, not the sweep file's name ("tiny")
    else:
        config, name = None, sweep_dir.name
        config_text = json.dumps(tables.meta, indent=2, sort_keys=True, default=str)
    sections: dict[str, tuple[Results, dict[str, bytes | str], list[str]]] = {}
    skipped: dict[str, str] = {}
    all_notes: list[str] = []
    for group, part in split(tables).items():
        figures: dict[str, bytes | str] = {}
        for figure, result in plots.draw_all(part).items():
            if isinstance(result, str):
                figures[figure] = result
                skipped[f"{group}/{figure}" if group else figure] = result
            else:
                figures[figure] = png_bytes(result)
                import matplotlib.pyplot as plt

                plt.close(result)
        notes = plots.notes(part)
        if measured and not group:
            notes.append(measured)
        all_notes += [f"{group}: {n}" if group else n for n in notes]
        sections[group] = (part, figures, notes)
    along: dict[str, bytes | str] = {}
    for figure, result in plots.draw_along(tables).items():
        if isinstance(result, str):
            along[figure] = skipped[figure] = result
        else:
            along[figure] = png_bytes(result)
            import matplotlib.pyplot as plt

            plt.close(result)
    title = f"gnsweep report: {name} ({sweep_dir})"
    if list(sections) == [""]:
        part, figures, notes = sections[""]
        text = render(tables, figures, config, config_text, title, notes, along_figures=along,
                      live=live, refresh=refresh)
    else:
        text = render(tables, {}, config, config_text, title, groups=sections,
                      along_figures=along, live=live, refresh=refresh)
    from gnsweep.report.laws_html import report_section

    text = text.replace("</body>", report_section(sweep_dir) + "</body>", 1)
    return text, skipped, all_notes


def run(sweep_dir: Path, echo: Echo) -> None:
    """`gnsweep report DIR`: write the report, say where it is."""
    path, skipped, notes = write_report(sweep_dir)
    for name, reason in skipped.items():
        echo(f"skipped {name}: {reason}", err=True)
    if notes:
        # Listed in the report itself; `gnsweep plot` (run before it by `make demo`) prints them.
        echo(f"the report lists {len(notes)} note(s) on how to read the figures", err=True)
    echo(f"report: {path.resolve().as_uri()}")


DEFAULT_EVERY = 5.0
"""Seconds between two looks at the sweep (and the page's reload period)."""
BUSY_SHARE = 0.5
"""The share of the time the watch may spend writing pages: a page that took t seconds (the
analysis and every figure) is written again no sooner than t / BUSY_SHARE later, so that a
watch beside a sweep never takes the CPU its runs train on."""


def curves_of(folder: SweepFolder, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each run's smoothed loss so far: run id -> (steps, losses, batch size)."""
    specs = folder.specs
    out = {}
    for row in rows:
        spec = specs.get(row["run_id"])
        if spec is None:
            continue
        table = live_metrics(run_dir(folder.root, row["run_id"]))
        if table is None:
            continue
        out[row["run_id"]] = (table.column("step").to_numpy(),
                              table.column("loss_smooth").to_numpy(), spec.batch_size)
    return out


def write_page(sweep_dir: Path, rows: list[dict[str, Any]], every: float, over: bool) -> str:
    """Write the page once; returns the reason there is no answer yet ("" when the report
    has one)."""
    import matplotlib.pyplot as plt

    from gnsweep.paths import SweepPaths
    from gnsweep.report.figures import png_bytes
    from gnsweep.report.live import curves_figure, progress_parts, waiting_page
    from gnsweep.sweep_analysis import analyze_folder

    folder = SweepFolder.open(sweep_dir)  # the grid may have grown (a relaunch, a plan)
    figure = curves_figure(curves_of(folder, rows))
    png = None
    if figure is not None:
        png = png_bytes(figure)
        plt.close(figure)
    live = progress_parts(rows, png, every)
    refresh = None if over else every
    reason = ""
    try:
        analyze_folder(folder)  # what the runs have reached by now
        text, _, _ = report_text(sweep_dir, live, refresh)
    except Exception as err:  # no run has reached anything yet, a fit not yet possible
        reason = str(err) or type(err).__name__
        text = waiting_page(f"gnsweep report: {sweep_dir} (live)", live, reason, refresh)
    store.write_text(SweepPaths(sweep_dir).report, text)
    return reason


def watch(sweep_dir: Path, every: float, echo: Echo,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """Keep the report current until no run is left to run (module docstring)."""
    from gnsweep.paths import SweepPaths
    from gnsweep.report.live import LIVE_STATES
    from gnsweep.status_rows import sweep_status

    SweepFolder.open(sweep_dir)  # a folder that is not a sweep: one line, exit 2
    page = SweepPaths(sweep_dir).report.resolve().as_uri()
    echo(f"watching {sweep_dir}: {page} (written when a run moves; Ctrl-C to stop)")
    seen: Any = None
    said = ""
    not_before = 0.0
    try:
        while True:
            rows = sweep_status(sweep_dir)
            over = not any(r["state"] in LIVE_STATES for r in rows)
            moved = [(r["run_id"], r["state"], r["step"]) for r in rows]
            if moved != seen and (over or time.monotonic() >= not_before):
                started = time.monotonic()
                reason = write_page(sweep_dir, rows, every, over)
                not_before = started + (time.monotonic() - started) / BUSY_SHARE
                if reason and reason != said:
                    echo(f"no answer yet: {reason}", err=True)
                said, seen = reason, moved
            if over:
                echo(f"the sweep is over: {page}")
                return
            sleep(every)
    except KeyboardInterrupt:
        echo(f"stopped watching; the last page: {page}")


def report_once_or_watch(sweep_dir: Path, echo: Echo, watch_it: bool, every: float) -> None:
    """`gnsweep report DIR [--watch]`: the report written once, or kept current."""
    if watch_it:
        watch(sweep_dir, every, echo)
        return
    run(sweep_dir, echo)


def command(
    sweep_dir: Annotated[Path, typer.Argument(help="A sweep folder written by `gnsweep launch`.")],
    watch: Annotated[bool, typer.Option(
        "--watch", help="Keep report.html current while the sweep runs: progress and every "
                        "run's loss curve so far, the page reloading itself; ends when no run "
                        "is left to run, or on Ctrl-C.")] = False,
    every: Annotated[float, typer.Option(
        "--every", min=0.5, help="With --watch: seconds between two looks.")] = 5.0,
) -> None:
    """Write DIR/report.html: the answer per target, warnings, fits, figures, grid, config.

    One self-contained file (figures embedded): open it in a browser or send it around.
    Runs `gnsweep analyze` first when its tables are missing.
    Example: gnsweep report runs/digits (live, while a launch runs: --watch)
    """
    report_once_or_watch(sweep_dir, typer.echo, watch, every)
