"""The `gnsweep` command: thin wrappers that parse, compose the config, call one function, print.

User mistakes (bad config, missing or corrupt files) end with one line on stderr and exit code 2,
never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

app = typer.Typer(
    help="Sweep batch size x learning rate, measure the gradient noise scale, and find the "
         "critical batch size (McCandlish et al. 2018).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"gnsweep: error: {message}", err=True)
    return typer.Exit(code)


def user_errors(func: F) -> F:
    """Turn the project's user-facing errors into one line and exit code 2."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from gnsweep.config import ConfigError
        from gnsweep.store import StoreError

        try:
            return func(*args, **kwargs)
        except (ConfigError, StoreError) as err:
            raise fail(str(err)) from None
        except KeyboardInterrupt:
            raise fail("interrupted; relaunch the same command to continue", 130) from None

    return wrapper  # type: ignore[return-value]


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@user_errors
def launch(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Hydra overrides, e.g. task=digits sweep.batch_sizes=[16,64,256]")] = None,
    sweep_dir: Annotated[Path | None, typer.Option(
        "--sweep-dir", help="Sweep folder (default: runs/<sweep name>).")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, help="Worker processes (default: one per core).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the grid and exit.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Run (or resume) a batch-size x learning-rate sweep.

    Example: gnsweep launch task=digits sweep.batch_sizes=[16,64,256] sweep.learning_rates=[0.1,0.3]
    """
    from gnsweep.config import compose
    from gnsweep.sweep import expand_grid
    from gnsweep.sweep import launch as run_sweep

    overrides = list(overrides or [])
    if workers is not None:
        overrides.append(f"executor.workers={workers}")
    config = compose(overrides)
    sweep_dir = sweep_dir or Path("runs") / config.sweep.name
    specs = expand_grid(config)
    if dry_run:
        typer.echo(f"sweep {config.sweep.name}: task {config.task.name}, {len(specs)} runs "
                   f"-> {sweep_dir}")
        typer.echo(f"{'run_id':<28}{'batch_size':>11}{'learning_rate':>15}{'seed':>6}")
        for spec in specs:
            typer.echo(f"{spec.run_id:<28}{spec.batch_size:>11}{spec.learning_rate:>15g}"
                       f"{spec.seed:>6}")
        return
    summary = run_sweep(config, sweep_dir, show_progress=not quiet)
    typer.echo(f"sweep {sweep_dir}: {len(summary.done)} done, {len(summary.diverged)} diverged, "
               f"{len(summary.failed)} failed this launch")
    if summary.failed:
        typer.echo(f"failed runs (see their status.json): {', '.join(summary.failed)}", err=True)
    typer.echo(f"next: gnsweep analyze {sweep_dir}")


@app.command()
@user_errors
def analyze(
    sweep_dir: Annotated[Path, typer.Argument(help="A sweep folder written by `gnsweep launch`.")],
    loss: Annotated[str, typer.Option(help="Loss deciding a target: smoothed, raw or eval.")
                    ] = "smoothed",
    skip_corrupt: Annotated[bool, typer.Option(
        "--skip-corrupt", help="Leave out runs whose metrics file is unreadable.")] = False,
) -> None:
    """Steps-to-target, best learning rates, Pareto fronts and the fit of eq. 2.11.

    Writes steps.parquet, front.parquet, fits.parquet and fits.json into the sweep folder.
    Example: gnsweep analyze runs/digits
    """
    from gnsweep.analysis.report import analyze_sweep
    from gnsweep.config import LOSS_KINDS, ConfigError

    if loss not in LOSS_KINDS:
        raise ConfigError(f"--loss: {loss!r} is not one of {', '.join(LOSS_KINDS)}")
    result = analyze_sweep(sweep_dir, loss=loss, skip_corrupt=skip_corrupt)
    typer.echo(format_fits(result.fits))
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"tables: {sweep_dir}/steps.parquet, front.parquet, fits.parquet, fits.json")


def format_fits(fits: Any) -> str:
    header = (f"{'target':>8} {'#B':>3} {'S_min':>16} {'E_min':>18} {'B_crit':>16} "
              f"{'B_simple':>9} {'B_crit/B_simple':>15}")
    lines = [header]
    for row in fits.itertuples(index=False):
        if row.refused:
            lines.append(f"{row.target:>8g} {row.n_batch_sizes:>3} no fit: {row.refused}")
            continue
        lines.append(
            f"{row.target:>8g} {row.n_batch_sizes:>3} {_pm(row.s_min, row.s_min_se):>16} "
            f"{_pm(row.e_min, row.e_min_se):>18} {_pm(row.b_crit, row.b_crit_se):>16} "
            f"{row.b_simple_mean:>9.3g} {row.ratio:>15.2f}")
    return "\n".join(lines)


def _pm(value: float, error: float) -> str:
    return f"{value:.4g} ± {error:.2g}"


@app.command()
@user_errors
def plot(
    sweep_dir: Annotated[Path, typer.Argument(help="An analyzed sweep folder.")],
) -> None:
    """Draw the Pareto fronts with their fits and B_crit against B_simple (PNG and PDF).

    Runs `gnsweep analyze` first when its tables are missing.
    Example: gnsweep plot runs/digits
    """
    import pandas as pd

    from gnsweep import plots, store
    from gnsweep.analysis.report import analyze_sweep

    store.require_sweep(sweep_dir)
    if not (sweep_dir / "fits.parquet").exists():
        analyze_sweep(sweep_dir)
    front = store.read_table(sweep_dir / "front.parquet").to_pandas()
    fits = store.read_table(sweep_dir / "fits.parquet").to_pandas()
    out = sweep_dir / "figures"
    written = plots.save(plots.pareto_fronts(front, fits), "pareto_fronts", out)
    if pd.notna(fits["b_crit"]).any():
        written += plots.save(plots.bcrit_vs_bsimple(fits), "bcrit_vs_bsimple", out)
    else:
        typer.echo("skipped bcrit_vs_bsimple: no target has a fit", err=True)
    for path in written:
        typer.echo(str(path))


@app.command()
def tasks() -> None:
    """List the built-in tasks and their options.

    Example: gnsweep tasks
    """
    from gnsweep.tasks import describe

    for name, text in describe().items():
        typer.echo(f"{name:<10} {text}")


@app.command()
def bench(
    subjects: Annotated[list[str] | None, typer.Argument(
        help="noise, analysis, executors (default: all)")] = None,
) -> None:
    """Run benchmarks and print ratios measured side by side (table and JSON).

    Example: gnsweep bench noise
    """
    from gnsweep.bench.__main__ import main as run_bench

    run_bench(list(subjects or []))


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        sys.exit(1)
