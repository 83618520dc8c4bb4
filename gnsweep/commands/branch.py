"""`gnsweep branch`: write the branch sweep (`gnsweep.branching.prepare_branch`: the base run's
checkpoints, the loss at each point, the grid) and run what has not finished (docs/along.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gnsweep.commands import Echo


def branch(base_run: Path, at: list[int], sweep_dir: Path, overrides: list[str], *,
           show_progress: bool = True) -> Any:
    """Write the branch sweep (`prepare_branch`) and run what has not finished with the
    configured executor; returns the executor's summary."""
    from gnsweep.branching import prepare_branch
    from gnsweep.sweep import run_specs

    config, specs = prepare_branch(base_run, at, sweep_dir, overrides)
    return run_specs(config, sweep_dir, [spec.run_id for spec in specs],
                     show_progress=show_progress)


def run(base_run_dir: Path, at: str, sweep_dir: Path, overrides: list[str] | None, *,
        workers: int | None, quiet: bool, echo: Echo) -> int:
    """`gnsweep branch`; returns the exit code (1 when a run failed, named on stderr)."""
    from gnsweep.branching import parse_points
    from gnsweep.sweep import unmeasured_runs

    overrides = list(overrides or [])
    if workers is not None:
        overrides.append(f"executor.workers={workers}")
    summary = branch(base_run_dir, parse_points(at), sweep_dir, overrides,
                     show_progress=not quiet)
    echo(f"branch sweep {sweep_dir}: {summary.describe()}")
    if summary.failed:
        echo(f"failed runs (gnsweep status {sweep_dir} shows why): "
             f"{', '.join(summary.failed)}", err=True)
    unmeasured = unmeasured_runs(sweep_dir)
    if unmeasured:
        echo(unmeasured, err=True)
    if summary.failed:
        return 1
    echo(f"next: gnsweep analyze {sweep_dir}")
    return 0
