"""`gnsweep report`: read a sweep, draw its figures as PNG bytes, render the one-page HTML
(`gnsweep.report.html`) and write <sweep>/report.html atomically."""

from __future__ import annotations

from pathlib import Path

from gnsweep import store
from gnsweep.analysis.results import Results
from gnsweep.commands import Echo
from gnsweep.config import Config
from gnsweep.paths import SweepPaths
from gnsweep.tasks import about


def write_report(sweep_dir: Path) -> tuple[Path, dict[str, str], list[str]]:
    """Draw the figures and write <folder>/report.html; returns (path, skipped, notes).

    The folder is a sweep, or the output of `gnsweep analyze --table` (one section per group
    when it was grouped; skipped figures and notes are then named `<group>/<figure>`)."""
    import json

    from gnsweep.analysis.groups import split
    from gnsweep.folder import SweepFolder
    from gnsweep.report import figures as plots
    from gnsweep.report.figures import png_bytes
    from gnsweep.report.html import render
    from gnsweep.sweep_analysis import load_tables

    # A sweep folder is opened once (config.yaml parsed, run files checked) and passed down.
    opened = SweepFolder.open(sweep_dir) if store.is_sweep(sweep_dir) else None
    tables = load_tables(opened or sweep_dir)
    measured = None
    if opened is not None:
        from gnsweep.runs import sweep_measurement_note

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
        text = render(tables, figures, config, config_text, title, notes, along_figures=along)
    else:
        text = render(tables, {}, config, config_text, title, groups=sections,
                      along_figures=along)
    path = SweepPaths(sweep_dir).report
    store.write_text(path, text)
    return path, skipped, all_notes


def run(sweep_dir: Path, echo: Echo) -> None:
    """`gnsweep report DIR`: write the report, say where it is."""
    path, skipped, notes = write_report(sweep_dir)
    for name, reason in skipped.items():
        echo(f"skipped {name}: {reason}", err=True)
    if notes:
        # Listed in the report itself; `gnsweep plot` (run before it by `make demo`) prints them.
        echo(f"the report lists {len(notes)} note(s) on how to read the figures", err=True)
    echo(f"report: {path.resolve().as_uri()}")
