"""The `gnsweep` command: thin wrappers that parse, compose the config, call one function, print.

User mistakes (bad config, missing or corrupt files) end with one line on stderr and exit code 2,
never a traceback.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 2) -> typer.Exit:
    from gnsweep import redact

    typer.echo(f"gnsweep: error: {redact.text(message)}", err=True)
    return typer.Exit(code)


def user_errors(func: F) -> F:
    """Turn the errors a user can cause into one line and exit code 2: the project's own
    (bad config, missing or corrupt files) and the operating system's (a folder that cannot be
    created or written, a full disk, permission denied), which name the path and the reason."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from gnsweep.config import ConfigError
        from gnsweep.errors import LauncherSignal, os_error_message
        from gnsweep.store import StoreError

        try:
            return func(*args, **kwargs)
        except (ConfigError, StoreError) as err:
            raise fail(str(err)) from None
        except LauncherSignal as err:
            raise fail(f"stopped by signal {err.signum}; its runs went back to pending: "
                       "relaunch the same command to continue", 128 + err.signum) from None
        except KeyboardInterrupt:
            raise fail("interrupted; relaunch the same command to continue", 130) from None
        except BrokenPipeError:
            raise  # the reader went away (`| head`): main() exits quietly
        except OSError as err:
            raise fail(os_error_message(err)) from None

    return wrapper  # type: ignore[return-value]


class _App(typer.Typer):
    """Every command registered here reports user errors the same way (`user_errors`): the
    one place, so a new command cannot forget it."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:
        def decorator(func: F) -> F:
            help_text = kwargs.get("help") or reflow(func.__doc__ or "")
            super(_App, self).command(*args, **{**kwargs, "help": help_text})(user_errors(func))
            return func

        return decorator


def reflow(doc: str) -> str:
    """A docstring as help text: each paragraph's lines joined into one line, which the help
    wraps at the terminal's width (the source's line breaks would otherwise stay and cut
    sentences in two); a line starting with "Example" or "- " keeps its own line."""
    import inspect

    paragraphs = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            line = line.strip()
            if lines and not line.startswith(("Example", "- ")):
                lines[-1] += " " + line
            else:
                lines.append(line)
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


app = _App(
    help="Sweep batch size x learning rate, measure the gradient noise scale, and find the "
         "critical batch size (McCandlish et al. 2018).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Hydra overrides, e.g. task=digits sweep.batch_sizes=[16,64,256]")] = None,
    sweep_dir: Annotated[Path | None, typer.Option(
        "--sweep-dir", help="Sweep folder (default: runs/<sweep name>).")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, help="Worker processes (default: one a GPU, else a core).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the grid and exit.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    detach: Annotated[bool, typer.Option(
        "--detach", help="executor=slurm: return once the jobs are submitted.")] = False,
) -> None:
    """Run (or resume) a batch-size x learning-rate sweep.

    Exit codes: 0 every run ended done or diverged; 1 a run failed (named on stderr; `gnsweep
    status` shows why); 2 bad input (config, task that fails its check, sweep folder); 130
    interrupted (Ctrl-C; relaunch to continue).

    Relaunching on the same folder runs only what is missing (also while an earlier launch or
    its Slurm jobs still run: runs are claimed, none runs twice). Executors: executor=local
    (default), executor=torchrun executor.nproc_per_node=2, executor=slurm
    executor.partition=gpu executor.gpus_per_node=8 executor.nproc_per_node=8.

    Adaptive batch size runs beside the grid (appendix D, docs/adaptive.md): sweep.schedule=adaptive
    sweep.exchange_rates=[30,300] (eps_max from the folder's fit, or sweep.eps_max=...).

    Example: gnsweep launch task=digits sweep.batch_sizes=[16,64,256] sweep.learning_rates=[0.1,0.3]
    """
    from gnsweep.config import compose
    from gnsweep.sweep import expand_grid, resolve_adaptive_lr
    from gnsweep.sweep import launch as run_sweep

    overrides = list(overrides or [])
    if workers is not None:
        overrides.append(f"executor.workers={workers}")
    config = compose(overrides)
    sweep_dir = sweep_dir or Path("runs") / config.sweep.name
    config = resolve_adaptive_lr(config, sweep_dir)  # adaptive runs: eq. 2.7 from the folder's fit
    if config.sweep.schedule == "along":  # the measured B_crit curve of a branch sweep
        from gnsweep.branching import resolve_along

        config = resolve_along(config, sweep_dir)
    specs = expand_grid(config)
    if dry_run:
        typer.echo(_grid_line(config, specs, sweep_dir))
        typer.echo(f"{'run_id':<28}{'batch_size':>16}{'learning_rate':>16}{'seed':>6}")
        for spec in specs:
            # An adaptive run's batch size follows the noise scale, its rate is eps_max (eq. 2.7).
            batch, lr = ((f"adaptive r={spec.exchange_rate:g}", f"eps_max {spec.learning_rate:g}")
                         if spec.adaptive else ("along B_crit", f"eps_max {spec.learning_rate:g}")
                         if spec.along else (str(spec.batch_size), f"{spec.learning_rate:g}"))
            typer.echo(f"{spec.run_id:<28}{batch:>16}{lr:>16}{spec.seed:>6}")
        return
    from gnsweep.tasks.check import check_task

    # Before the sweep folder is written: a task that cannot train is refused here (exit 2).
    # A custom task's unit is recorded in the folder's config for the analysis.
    unit = check_task(config.task.name, config.task.options, config.sweep.seeds[0],
                      config.sweep.stall_seconds)
    config = dataclasses.replace(config, task=config.task.with_unit(unit))
    typer.echo(_grid_line(config, specs, sweep_dir))  # the grid that runs, before it runs
    summary = run_sweep(config, sweep_dir, show_progress=not quiet, wait=not detach)
    if detach and config.executor.kind == "slurm":
        jobs = ", ".join(summary.submitted) or "none (nothing left to run)"
        typer.echo(f"sweep {sweep_dir}: submitted Slurm jobs {jobs}")
        typer.echo(f"follow: gnsweep status {sweep_dir}")
        return
    typer.echo(f"sweep {sweep_dir}: {summary.describe()}")
    if summary.failed:
        typer.echo(f"failed runs (gnsweep status {sweep_dir} shows why): "
                   f"{', '.join(summary.failed)}", err=True)
    if summary.done or summary.diverged or not summary.failed:  # not when every run failed
        typer.echo(f"next: gnsweep analyze {sweep_dir}")
    if summary.failed:
        raise typer.Exit(1)


def _grid_line(config: Any, specs: list[Any], sweep_dir: Path) -> str:
    """`sweep NAME: task T, N runs (batch sizes ... x learning rates ... x seeds ...) -> DIR`."""
    sweep = config.sweep

    def listed(values: list[Any]) -> str:
        return ",".join(f"{v:g}" for v in values)

    grid = (f"batch sizes {listed(sweep.batch_sizes)} x learning rates "
            f"{listed(sweep.learning_rates)} x seeds {listed(sweep.seeds)}")
    if sweep.schedule == "adaptive":
        grid += f", adaptive at exchange rates {listed(sweep.exchange_rates)}"
    return (f"sweep {sweep.name}: task {config.task.label}, {len(specs)} runs ({grid}; "
            f"targets {listed(sweep.targets)}) -> {sweep_dir}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@user_errors
def plan(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Hydra overrides, as for `gnsweep launch`; the grid bounds what the plan runs")
    ] = None,
    sweep_dir: Annotated[Path | None, typer.Option(
        "--sweep-dir", help="Sweep folder (default: runs/<sweep name>-plan).")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, help="Worker processes (default: one a GPU, else a core).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Find B_crit at a fraction of the grid's compute: a pilot run's B_simple picks the batch
    sizes, eq. 2.7 the first learning rate at each, and only the rates that can still win run.

    Every run lives under DIR/runs like a launch's (analyze, plot and report work unchanged);
    DIR/plan.json records each decision, and re-running the same command resumes.
    Example: gnsweep plan --sweep-dir runs/digits-plan
    """
    from gnsweep.config import compose
    from gnsweep.planner.orchestrate import examples_processed
    from gnsweep.planner.orchestrate import plan as run_plan

    overrides = list(overrides or [])
    if workers is not None:
        overrides.append(f"executor.workers={workers}")
    config = compose(overrides)
    from gnsweep.tasks.check import check_task

    # As for launch: a task that cannot train is refused (exit 2), a custom task's unit recorded.
    unit = check_task(config.task.name, config.task.options, config.sweep.seeds[0],
                      config.sweep.stall_seconds)
    config = dataclasses.replace(config, task=config.task.with_unit(unit))
    sweep_dir = sweep_dir or Path("runs") / f"{config.sweep.name}-plan"
    summary = run_plan(config, sweep_dir, show_progress=not quiet, echo=typer.echo)
    ids = sorted(set(summary.run_ids))
    typer.echo(f"plan {sweep_dir}: {len(ids)} of {summary.grid_size} grid runs in "
               f"{summary.rounds} round(s) ({summary.grid_size - len(ids)} pruned: never run; "
               f"{len(set(summary.capped))} with a smaller step budget); "
               f"{examples_processed(sweep_dir, ids):,} examples processed")
    typer.echo(f"next: gnsweep analyze {sweep_dir}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def branch(
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
) -> None:
    """Measure the critical batch size along a run: a batch size x learning rate grid started
    from the base run's checkpoints, to targets relative to the loss at each (docs/along.md).

    Runs live under DIR/runs (status, analyze, plot and report work; `gnsweep analyze DIR`
    writes along.parquet); the same command again resumes. Exit codes as `gnsweep launch`;
    2 also when the base run kept no checkpoint at or before a point.
    Example: gnsweep branch runs/linreg/runs/b00016_lr0.4_s0 --at 256,1024,4096
    --sweep-dir runs/linreg-along sweep=linreg branch.targets=[0.7,0.6,0.5]
    """
    from gnsweep.branching import branch as run_branch
    from gnsweep.branching import parse_points

    overrides = list(overrides or [])
    if workers is not None:
        overrides.append(f"executor.workers={workers}")
    summary = run_branch(base_run_dir, parse_points(at), sweep_dir, overrides,
                         show_progress=not quiet)
    typer.echo(f"branch sweep {sweep_dir}: {summary.describe()}")
    if summary.failed:
        typer.echo(f"failed runs (gnsweep status {sweep_dir} shows why): "
                   f"{', '.join(summary.failed)}", err=True)
        raise typer.Exit(1)
    typer.echo(f"next: gnsweep analyze {sweep_dir}")


@app.command()
def status(
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
    from collections import Counter

    from gnsweep.sweep import measurement_note, sweep_status

    rows = sweep_status(sweep_dir)
    shown = [r for r in rows if all_runs or r["state"] != "done"]
    if shown:
        typer.echo(f"{'run_id':<28}{'state':<10}{'tries':>5}  {'slurm job':<12}{'owner':<18}info")
    for r in shown:
        info = _progress_of(r) or r["info"]
        info = info if len(info) <= 60 else info[:57] + "..."
        typer.echo(f"{r['run_id']:<28}{r['state']:<10}{r['attempts']:>5}  "
                   f"{r['slurm_job_id']:<12}{r['owner']:<18}{info}")
    counts = Counter(r["state"] for r in rows)
    order = ("done", "diverged", "failed", "running", "queued", "pending", "died", "rerun")
    requeued = sum(r["requeues"] for r in rows)
    typer.echo(f"{len(rows)} runs: " + ", ".join(f"{counts[s]} {s}" for s in order if counts[s])
               + (f"; Slurm requeued runs {requeued} times" if requeued else ""))
    note = measurement_note(rows)
    if note:
        typer.echo(note)


def _progress_of(row: dict[str, Any]) -> str:
    """Where an unfinished run stands on disk: step, examples, smoothed loss, the GPUs it is
    training on, requeues."""
    parts = []
    if row.get("step") is not None:
        parts.append(f"step {row['step']}, {row['examples']} examples, loss "
                     f"{row['loss_smooth']:.4g}")
    if row.get("gpus") and row["state"] == "running":
        parts.append(f"GPU {row['gpus']}")
    if row["requeues"]:
        parts.append(f"requeued {row['requeues']}x")
    return "; ".join(parts)


@app.command()
def analyze(
    sweep_dir: Annotated[Path | None, typer.Argument(
        help="A sweep folder written by `gnsweep launch` (or use --table).")] = None,
    table: Annotated[Path | None, typer.Option(
        "--table", help="CSV or parquet of measurements made elsewhere: steps-to-target rows "
                        "or loss curves (docs/analysis.md).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Folder for the tables (default: the sweep folder; required with "
                      "--table).")] = None,
    targets: Annotated[str | None, typer.Option(
        "--targets", help="Comma-separated loss targets (default: the sweep's; required for "
                          "loss curves).")] = None,
    loss: Annotated[str | None, typer.Option(
        help="Loss deciding a target: smoothed, raw or eval (default: the sweep's "
             "analysis.loss, else smoothed).")] = None,
    ema_examples: Annotated[float | None, typer.Option(
        "--ema-examples", min=1e-9, help="Re-smooth the raw loss with an EMA of this many "
                                         "examples (default: the logged smoothed loss).")] = None,
    bootstrap: Annotated[int | None, typer.Option(
        "--bootstrap", min=0, help="Bootstrap resamples for 95% intervals (default: the "
                                   "sweep's analysis.bootstrap, else 0).")] = None,
    optimizer: Annotated[str, typer.Option(
        help="For --table: sgd, momentum, adam or adamw (picks the eps_opt(B) model).")] = "sgd",
    group_by: Annotated[str | None, typer.Option(
        "--group-by", help="For --table: a column naming the workload; one fit per value, "
                           "that column in every output table (a target column is then "
                           "optional).")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print fits.json's content on stdout; the table goes to stderr.")] = False,
    skip_corrupt: Annotated[bool, typer.Option(
        "--skip-corrupt", help="Leave out runs whose metrics file is unreadable.")] = False,
) -> None:
    """Steps-to-target, best learning rates, Pareto fronts, the fit of eq. 2.11, B_crit against
    B_simple, eps_opt(B) and B_crit(L).

    Writes steps, front, fits, lr_fits and loss_scaling (.parquet) and fits.json.
    Examples: gnsweep analyze runs/digits --bootstrap 1000;
    gnsweep analyze --table docs/examples/steps.csv --out /tmp/ext
    """
    import json

    from gnsweep.analysis.external import analyze_table
    from gnsweep.analysis.report import analyze_sweep, format_fits, write_outputs
    from gnsweep.config import LOSS_KINDS, OPTIMIZERS, ConfigError

    if (sweep_dir is None) == (table is None):
        raise ConfigError("give a sweep folder or --table FILE (one of them)")
    if loss is not None and loss not in LOSS_KINDS:
        raise ConfigError(f"--loss: {loss!r} is not one of {', '.join(LOSS_KINDS)}")
    if ema_examples is not None and (loss or "smoothed") != "smoothed":
        raise ConfigError("--ema-examples re-smooths the training loss; it needs --loss smoothed")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    target_list = _parse_targets(targets)
    if group_by is not None and table is None:
        raise ConfigError("--group-by groups the rows of a --table FILE; a sweep folder is one "
                          "workload")
    if table is not None:
        if out is None:
            raise ConfigError("--table needs --out DIR for the tables")
        result = analyze_table(table, target_list, loss=loss or "smoothed",
                               ema_examples=ema_examples, bootstrap=bootstrap or 0,
                               optimizer=optimizer, group_by=group_by)
        write_outputs(out, result)
    else:
        assert sweep_dir is not None
        result = analyze_sweep(sweep_dir, loss=loss, skip_corrupt=skip_corrupt,
                               ema_examples=ema_examples, bootstrap=bootstrap,
                               targets=target_list, out_dir=out)
        out = out or sweep_dir
    typer.echo(format_fits(result.fits, result.loss_scaling, result.meta.get("group_by")),
               err=as_json)
    if len(result.along_schedule):  # runs following a measured B_crit (sweep.schedule=along)
        from gnsweep.analysis.along import format_schedule

        typer.echo(format_schedule(result.along_schedule), err=as_json)
    if len(result.along):  # a branch sweep (`gnsweep branch`): the local B_crit per point
        from gnsweep.analysis.along import format_along

        typer.echo(format_along(result.along, result.meta.get("unit", "examples")), err=as_json)
    if len(result.adaptive):
        from gnsweep.analysis.adaptive import format_adaptive

        typer.echo(format_adaptive(result.adaptive), err=as_json)
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"tables: {out}/steps.parquet, front.parquet, fits.parquet, lr_fits.parquet, "
               "loss_scaling.parquet, temperature.parquet, fits.json"
               + (", along.parquet" if len(result.along) else ""), err=as_json)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2, sort_keys=True))


def _parse_targets(text: str | None) -> list[float] | None:
    from gnsweep.config import ConfigError

    if not text:
        return None
    try:
        values = [float(part) for part in text.replace(" ", "").strip("[]").split(",") if part]
    except ValueError:
        raise ConfigError(f"--targets: {text!r} is not a comma-separated list of numbers"
                          ) from None
    if not values or any(not (v > 0 and v < float("inf")) for v in values):
        raise ConfigError(f"--targets: {text!r}: give positive finite losses, e.g. 0.5,0.2")
    return values


def _fits_of(folder: Path) -> tuple[Any, str | None]:
    """Fresh fits of a sweep folder (analyzed now, nothing written), or a folder's fits.parquet;
    with the column the fits are grouped by (`analyze --group-by`), else None."""
    from gnsweep import store
    from gnsweep.analysis.groups import group_of
    from gnsweep.analysis.report import analyze_sweep
    from gnsweep.analysis.results import read_results

    if store.is_sweep(folder):
        analysis = analyze_sweep(folder, write=False)
        for warning in analysis.warnings:
            if "left out" in warning:  # runs missing from these fits: never in silence
                typer.echo(f"warning: {warning}", err=True)
        return analysis.fits, None
    if (folder / "fits.parquet").is_file():
        results = read_results(folder)
        return results.fits, group_of(results)
    store.require_sweep(folder)  # raises with the usual message
    return None, None


@app.command()
def baseline(
    folder: Annotated[Path, typer.Argument(
        help="A sweep folder (analyzed now) or a folder holding fits.parquet.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Baseline JSON to write.")],
    rtol: Annotated[float, typer.Option(
        min=0.0, help="Relative change `gnsweep check` allows.")] = 0.05,
    k_se: Annotated[float, typer.Option(
        "--k-se", min=0.0, help="Or this many combined standard errors (0: off).")] = 0.0,
) -> None:
    """Record the fits (B_crit, S_min, E_min per target) for `gnsweep check`.

    Example: gnsweep baseline runs/tiny -o tests/baseline/tiny.json
    """
    from gnsweep import store
    from gnsweep.analysis.baseline import make_baseline

    fits, group_by = _fits_of(folder)
    record = make_baseline(fits, rtol=rtol, k_se=k_se, source=folder.name, group_by=group_by)
    store.write_json(output, record)
    fitted = sum(1 for t in record["targets"] if t["b_crit"] is not None)
    typer.echo(f"baseline {output}: {fitted} of {len(record['targets'])} target(s) with a fit")


@app.command()
def check(
    folder: Annotated[Path, typer.Argument(
        help="A sweep folder (analyzed now) or a folder holding fits.parquet.")],
    baseline_file: Annotated[Path, typer.Option("--baseline", help="From `gnsweep baseline`.")],
    rtol: Annotated[float | None, typer.Option(
        min=0.0, help="Allowed relative change (default: the baseline's).")] = None,
    k_se: Annotated[float | None, typer.Option(
        "--k-se", min=0.0, help="Or this many combined standard errors (default: the "
                                "baseline's).")] = None,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write JUnit XML here.")] = None,
) -> None:
    """Compare fresh fits with a baseline; exit 1 when B_crit, S_min or E_min moved too far.

    Example: gnsweep check runs/tiny --baseline tests/baseline/tiny.json --junit fits.xml
    """
    from gnsweep import store
    from gnsweep.analysis.baseline import BaselineError, compare, junit_xml

    record = store.read_json(baseline_file)
    fits, _ = _fits_of(folder)
    try:
        cases = compare(record, fits, rtol=rtol, k_se=k_se)
    except BaselineError as err:
        raise store.StoreError(f"{baseline_file}: {err}") from None
    for case in cases:
        mark = "ok  " if case.ok else "FAIL"
        where = f"{case.group} " if case.group else ""
        typer.echo(f"{mark} {where}target {case.target:<8g} {case.figure:<7} {case.message}")
    if junit is not None:
        store.write_text(junit, junit_xml(cases))
    failed = [c for c in cases if not c.ok]
    if failed:
        typer.echo(f"gnsweep check: {len(failed)} of {len(cases)} figure(s) regressed "
                   f"against {baseline_file}", err=True)
        raise typer.Exit(1)
    typer.echo(f"gnsweep check: all {len(cases)} figure(s) within tolerance of {baseline_file}")


@app.command()
def plot(
    sweep_dir: Annotated[Path, typer.Argument(help="An analyzed sweep folder.")],
    svg: Annotated[bool, typer.Option("--svg", help="SVG instead of PDF beside each PNG.")
                   ] = False,
) -> None:
    """Draw every figure the sweep supports into DIR/figures (PNG and PDF).

    A figure the sweep cannot support is skipped with one line saying why (docs/figures.md).
    Runs `gnsweep analyze` first when its tables are missing.
    Example: gnsweep plot runs/digits
    """
    from gnsweep.figures import write_figures

    written = write_figures(sweep_dir, formats=("png", "svg" if svg else "pdf"))
    for name, reason in written.skipped.items():
        typer.echo(f"skipped {name}: {reason}", err=True)
    for note in written.notes:
        typer.echo(f"note: {note}", err=True)
    for path in written.paths:
        typer.echo(str(path))


@app.command()
def report(
    sweep_dir: Annotated[Path, typer.Argument(help="A sweep folder written by `gnsweep launch`.")],
) -> None:
    """Write DIR/report.html: the answer per target, warnings, fits, figures, grid, config.

    One self-contained file (figures embedded): open it in a browser or send it around.
    Runs `gnsweep analyze` first when its tables are missing.
    Example: gnsweep report runs/digits
    """
    from gnsweep.html_report import write_report

    path, skipped, notes = write_report(sweep_dir)
    for name, reason in skipped.items():
        typer.echo(f"skipped {name}: {reason}", err=True)
    if notes:
        # Listed in the report itself; `gnsweep plot` (run before it by `make demo`) prints them.
        typer.echo(f"the report lists {len(notes)} note(s) on how to read the figures", err=True)
    typer.echo(f"report: {path.resolve().as_uri()}")


@app.command()
@user_errors
def compare(
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
    from gnsweep.analysis.compare import format_compare
    from gnsweep.comparison import compare_sweeps

    result = compare_sweeps(sweep_dirs, out, formats=("png", "svg" if svg else "pdf"))
    typer.echo(format_compare(result.table))
    for name, reason in result.skipped.items():
        typer.echo(f"skipped {name}: {reason}", err=True)
    for path in result.paths:
        typer.echo(str(path))


@app.command()
def tasks() -> None:
    """List the built-in tasks and their options.

    Example: gnsweep tasks
    """
    from gnsweep.tasks import describe

    for name, text in describe().items():
        typer.echo(f"{name:<10} {text}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    subjects: Annotated[list[str] | None, typer.Argument(
        help="noise, analysis, executors (default: all), then options for them, e.g. "
             "--runs 100")] = None,
) -> None:
    """Run benchmarks and print ratios measured side by side (table and JSON).

    Example: gnsweep bench noise
    """
    from gnsweep.bench.__main__ import main as run_bench

    run_bench(list(subjects or []))


def main() -> None:
    from gnsweep import allocator

    # The analysis's large arrays and the workers forked from `launch` alike: temporaries on the
    # heap, not page-faulted back on every use.
    allocator.tune()
    try:
        app()
    except BrokenPipeError:
        sys.exit(1)
