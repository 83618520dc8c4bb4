"""`gnsweep status`: every run's state as the sweep folder, its claims and Slurm's queue tell it."""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer

from gnsweep.commands import Echo
from gnsweep.runs import measurement_note, unmeasured_line
from gnsweep.status_rows import noise_plan_lines, sweep_status

ORDER = ("done", "diverged", "failed", "running", "queued", "pending", "died", "rerun",
         "unreadable")
"""The states in the summary line's order."""


def progress_of(row: dict[str, Any]) -> str:
    """Where an unfinished run stands on disk: step, examples, smoothed loss, the GPUs it is
    training on, requeues."""
    parts = []
    if row.get("step") is not None:
        loss = row.get("loss_smooth")
        shown = f"{loss:.4g}" if isinstance(loss, int | float) else "?"
        parts.append(f"step {row['step']}, {row['examples']} examples, loss {shown}")
    if row.get("gpus") and row["state"] == "running":
        parts.append(f"GPU {row['gpus']}")
    if row["requeues"]:
        parts.append(f"requeued {row['requeues']}x")
    return "; ".join(parts)


INFO_WIDTH = 60
"""The info column's width on a run's line; a longer reason goes on below it, whole."""
INFO_INDENT = 6
WRAP_WIDTH = 100


def info_lines(info: str) -> list[str]:
    """A run's info, whole: its head on the run's line, the rest wrapped below, indented."""
    if len(info) <= INFO_WIDTH:
        return [info]
    head = textwrap.wrap(info, INFO_WIDTH, break_long_words=True, break_on_hyphens=False)[0]
    rest = info[len(head):].strip()
    return [head, *textwrap.wrap(rest, WRAP_WIDTH - INFO_INDENT, break_long_words=True,
                                 break_on_hyphens=False)]


def run(sweep_dir: Path, all_runs: bool, echo: Echo) -> None:
    """`gnsweep status DIR [--all]`: one line a run not done (every run with --all), then the
    counts per state."""
    rows = sweep_status(sweep_dir)
    shown = [r for r in rows if all_runs or r["state"] != "done"]
    if shown:
        echo(f"{'run_id':<28}{'state':<10}{'tries':>5}  {'slurm job':<12}{'owner':<18}info")
    for r in shown:
        lines = info_lines(progress_of(r) or r["info"])
        echo(f"{r['run_id']:<28}{r['state']:<10}{r['attempts']:>5}  "
             f"{r['slurm_job_id']:<12}{r['owner']:<18}{lines[0]}")
        for line in lines[1:]:
            echo(f"{'':<{INFO_INDENT}}{line}")
    counts = Counter(r["state"] for r in rows)
    requeued = sum(r["requeues"] for r in rows)
    echo(f"{len(rows)} runs: " + ", ".join(f"{counts[s]} {s}" for s in ORDER if counts[s])
         + (f"; Slurm requeued runs {requeued} times" if requeued else ""))
    note = measurement_note(rows)
    if note:
        echo(note)
    for line in noise_plan_lines(sweep_dir):
        echo(line)
    unmeasured = unmeasured_line({r["run_id"]: r["b_simple_nan_share"] for r in rows
                                  if r["state"] in ("done", "diverged")})
    if unmeasured:
        echo(unmeasured)


def command(
    sweep_dir: Annotated[Path, typer.Argument(help="A sweep folder written by `gnsweep launch`.")],
    all_runs: Annotated[bool, typer.Option(
        "--all", help="List every run, not only those not done.")] = False,
) -> None:
    """Show pending, queued, running, done, failed and diverged runs, with their Slurm job ids.

    `died`: a run whose worker is gone (kill -9, node lost); a relaunch runs it again.
    `rerun`: a run recorded done or diverged whose metrics file is missing or unreadable; the
    next launch runs it again (the analysis leaves it out and says so).
    Example: gnsweep status runs/digits
    """
    run(sweep_dir, all_runs, typer.echo)
