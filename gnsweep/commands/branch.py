"""`gnsweep branch`: write the branch sweep (`gnsweep.branching.prepare_branch`: the base run's
checkpoints, the loss at each point, the grid) and run what has not finished (docs/along.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gnsweep.commands import Echo
from gnsweep.tasks import about

if TYPE_CHECKING:
    from gnsweep.config import Config
    from gnsweep.runs import RunSpec


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
        workers: int | None, quiet: bool, echo: Echo, dry_run: bool = False) -> int:
    """`gnsweep branch`; returns the exit code (1 when a run failed, named on stderr). With
    `dry_run` it lists the branch runs, done and pending, and writes nothing."""
    from gnsweep.branching import parse_points, plan_branch
    from gnsweep.sweep import unmeasured_runs

    overrides = list(overrides or [])
    if workers is not None:
        overrides.append(f"executor.workers={workers}")
    if dry_run:
        config, planned = plan_branch(base_run_dir, parse_points(at), sweep_dir, overrides)
        echo(describe_plan(config, planned, sweep_dir))
        return 0
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


def describe_plan(config: Config, planned: list[tuple[RunSpec, str]], sweep_dir: Path) -> str:
    """`gnsweep branch --dry-run`'s lines: the grid, the targets and each run's state."""
    branch = config.branch
    done = sum(state in ("done", "diverged") for _, state in planned)
    if branch.automatic:
        window = (f"{branch.window:,} examples ({about(config.task).unit})" if branch.window
                  else f"{branch.window_steps} steps of the largest batch size")
        targets = f"automatic targets, one window of {window} a run"
    else:
        targets = f"targets {', '.join(f'{f:g}' for f in branch.targets)} x the loss there"
    lines = [f"branch sweep -> {sweep_dir}: {len(planned)} runs ({done} done, "
             f"{len(planned) - done} to run); {targets}; read on the "
             f"{config.analysis.loss} loss",
             f"{'run_id':<34}{f'from ({about(config.task).unit})':>16}{'batch_size':>12}"
             f"{'learning_rate':>15}{'seed':>6}  state"]
    for spec, state in planned:
        lines.append(f"{spec.run_id:<34}{spec.at_examples:>16,}{spec.batch_size:>12}"
                     f"{spec.learning_rate:>15g}{spec.seed:>6}  {state}")
    return "\n".join(lines)


def command(
    base_run_dir: Annotated[Path, typer.Argument(
        help="The base run's folder, e.g. runs/digits/runs/b00032_lr0.1_s0.")],
    at: Annotated[str, typer.Option(
        "--at", help="Branch points in examples seen, e.g. 1000,4000,16000 (each: the base "
                     "run's kept checkpoint at or before it).")],
    sweep_dir: Annotated[Path, typer.Option("--sweep-dir", help="The branch sweep's folder.")],
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Hydra overrides for the branch grid, e.g. sweep.batch_sizes=[16,64,256] "
             "branch.targets=[0.97,0.94,0.9]")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, help="Worker processes (default: one a GPU, else a core).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="List the branch runs, done and pending, and exit: nothing is "
                          "written or trained.")] = False,
) -> None:
    """Measure the critical batch size along a run: a batch size x learning rate grid started
    from the base run's checkpoints, to targets relative to the loss at each (docs/along.md).

    Runs live under DIR/runs (status, analyze, plot and report work; `gnsweep analyze DIR`
    writes along.parquet); the same command again resumes. Exit codes as `gnsweep launch`;
    2 also when the base run kept no checkpoint at or before a point.
    Example: gnsweep branch runs/linreg/runs/b00016_lr0.4_s0 --at 256,1024,4096
    --sweep-dir runs/linreg-along sweep=linreg branch.targets=[0.7,0.6,0.5]
    """
    code = run(base_run_dir, at, sweep_dir, overrides, workers=workers, quiet=quiet,
               echo=typer.echo, dry_run=dry_run)
    if code:
        raise typer.Exit(code)
