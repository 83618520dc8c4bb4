"""`gnsweep report DIR --watch`: keep DIR/report.html current while the sweep runs.

Every `every` seconds the runs' states and rows are read; when any moved, the page is written
again: the live view (progress, the runs not finished, every run's loss curve so far;
`report.live`) above the report of what the runs have reached so far (analysed again; before
any run has reached anything, why there is no answer yet). The page reloads itself while the
sweep runs. The watch ends once no run is left to run (done, diverged or failed), after a
last page without the reload, or on Ctrl-C.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.commands import Echo
from gnsweep.folder import SweepFolder, live_metrics

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
        table = live_metrics(store.run_dir(folder.root, row["run_id"]))
        if table is None:
            continue
        out[row["run_id"]] = (table.column("step").to_numpy(),
                              table.column("loss_smooth").to_numpy(), spec.batch_size)
    return out


def write_page(sweep_dir: Path, rows: list[dict[str, Any]], every: float, over: bool) -> str:
    """Write the page once; returns the reason there is no answer yet ("" when the report
    has one)."""
    import matplotlib.pyplot as plt

    from gnsweep.commands.analyze import analyze_sweep
    from gnsweep.commands.report import report_text
    from gnsweep.paths import SweepPaths
    from gnsweep.report.figures import png_bytes
    from gnsweep.report.live import curves_figure, progress_parts, waiting_page

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
        analyze_sweep(folder)  # what the runs have reached by now
        text, _, _ = report_text(sweep_dir, live, refresh)
    except Exception as err:  # no run has reached anything yet, a fit not yet possible
        reason = str(err) or type(err).__name__
        text = waiting_page(f"gnsweep report: {sweep_dir} (live)", live, reason, refresh)
    store.write_text(SweepPaths(sweep_dir).report, text)
    return reason


def watch(sweep_dir: Path, every: float, echo: Echo,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """Keep the report current until no run is left to run (module docstring)."""
    from gnsweep.commands.status import sweep_status
    from gnsweep.paths import SweepPaths
    from gnsweep.report.live import LIVE_STATES

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
    from gnsweep.commands.report import run

    run(sweep_dir, echo)
