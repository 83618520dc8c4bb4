"""The `gnsweep` command: parse the command line, call one `gnsweep.commands` function, exit.

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

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 2) -> typer.Exit:
    from gnsweep import redact

    typer.echo(f"gnsweep: error: {one_line(redact.text(message))}", err=True)
    return typer.Exit(code)


def one_line(message: str) -> str:
    """`message` as one line: a control character (a line break or carriage return inside a
    setting's name or a file's value that the message quotes) shown escaped, as repr shows it."""
    return "".join(ch if ch == "\t" or ch.isprintable() else repr(ch)[1:-1] for ch in message)


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
    from gnsweep.commands.launch import run

    code = run(overrides, sweep_dir=sweep_dir, workers=workers, dry_run=dry_run, quiet=quiet,
               detach=detach, echo=typer.echo)
    if code:
        raise typer.Exit(code)



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
    budget: Annotated[int | None, typer.Option(
        "--budget", help="`gnsweep plan DIR`: examples its rounds may process (default: what "
        "the folder's runs had processed when the plan began).")] = None,
) -> None:
    """Find B_crit at a fraction of the grid's compute: a pilot run's B_simple picks the batch
    sizes, eq. 2.7 the first learning rate at each, and only the rates that can still win run.

    Every run lives under DIR/runs like a launch's (analyze, plot and report work unchanged);
    DIR/plan.json records each decision, and re-running the same command resumes.

    `gnsweep plan DIR` (an analysed sweep folder, no overrides): while `gnsweep recommend DIR`
    is a bound, run exactly its next grid in DIR and analyse again, round after round up to
    --budget examples; DIR/next_grids.json records each round before it runs.
    Examples: gnsweep plan --sweep-dir runs/digits-plan; gnsweep plan runs/digits
    """
    from gnsweep.commands.plan import run

    run(overrides, sweep_dir=sweep_dir, workers=workers, quiet=quiet, echo=typer.echo,
        budget=budget)


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
    from gnsweep.commands.branch import run

    code = run(base_run_dir, at, sweep_dir, overrides, workers=workers, quiet=quiet,
               echo=typer.echo, dry_run=dry_run)
    if code:
        raise typer.Exit(code)


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
    from gnsweep.commands.status import run

    run(sweep_dir, all_runs, typer.echo)



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
        "--targets", help="Comma-separated loss targets, or auto: levels chosen from the "
                          "runs (default: the sweep's; required for loss curves).")] = None,
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
    from gnsweep.commands.analyze import run

    run(sweep_dir, table=table, out=out, targets=targets, loss=loss, ema_examples=ema_examples,
        bootstrap=bootstrap, optimizer=optimizer, group_by=group_by, as_json=as_json,
        skip_corrupt=skip_corrupt, echo=typer.echo)




@app.command()
def recommend(
    sweep_dir: Annotated[Path, typer.Argument(
        help="A sweep folder (analysed now if it was not) or `analyze --table`'s --out folder.")],
    target: Annotated[float | None, typer.Option(
        "--target", help="The target to recommend for (default: the hardest whose B_crit is "
                         "well determined).")] = None,
    prefer: Annotated[str, typer.Option(
        "--prefer", help="time (4 B_crit: 1.25 S_min, 5 E_min), balanced (B_crit: 2 S_min, "
                         "2 E_min) or compute (B_crit/4: 5 S_min, 1.25 E_min); eq. 2.11.")
    ] = "balanced",
    as_json: Annotated[bool, typer.Option("--json", help="Print the recommendation as JSON.")
                       ] = False,
) -> None:
    """The batch size and learning rate to train with, what they cost in steps and examples
    (eq. 2.11), the tradeoff from B_crit/4 to 4 B_crit, and the next grid when the sweep only
    bounds the answer.

    JSON fields: batch_size (the task's unit), batch_size_samples, learning_rate,
    learning_rate_low, learning_rate_high, steps, examples, target, status (fit, bound or
    refused), next_grid (a bound: the runs to add; `gnsweep plan DIR` runs them).
    Example: gnsweep recommend runs/digits --prefer time --json
    """
    from gnsweep.commands.recommend import run

    code = run(sweep_dir, target=target, prefer=prefer, as_json=as_json, echo=typer.echo)
    if code:
        raise typer.Exit(code)


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
    from gnsweep.commands.check import baseline as record_baseline

    record_baseline(folder, output, rtol=rtol, k_se=k_se, echo=typer.echo)


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
    from gnsweep.commands.check import check as run_check

    code = run_check(folder, baseline_file, rtol=rtol, k_se=k_se, junit=junit, echo=typer.echo)
    if code:
        raise typer.Exit(code)


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
    from gnsweep.commands.plot import run

    run(sweep_dir, svg, typer.echo)


@app.command()
def report(
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
    from gnsweep.commands.watch import report_once_or_watch

    report_once_or_watch(sweep_dir, typer.echo, watch, every)


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
    from gnsweep.commands.compare import run

    run(sweep_dirs, out, svg, typer.echo)


@app.command()
def laws(
    out: Annotated[Path, typer.Option("--out", help="Folder for laws.json and the rest.")],
    sweep_dirs: Annotated[list[Path] | None, typer.Argument(
        help="Fixed-budget sweep folders, one per model size N and budget D.")] = None,
    table: Annotated[Path | None, typer.Option("--table", help="CSV or parquet made elsewhere: "
        "N, D, batch_size, learning_rate, loss; or N, batch_size, steps.")] = None,
    predict: Annotated[str | None, typer.Option(help="A new scale: N=7e9,D=1.4e12 (and "
        "M=<FLOPs a token> for DeepSeek's law).")] = None,
    tolerance: Annotated[float, typer.Option(help="Near-optimal: within this relative loss "
                                             "(Step Law's 0.25%).")] = 0.0025,
    bootstrap: Annotated[int, typer.Option(min=0, help="Draws for 95% intervals.")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="laws.json on stdout.")] = False,
) -> None:
    """Batch size and learning rate laws across model size N and data D (docs/laws.md): each
    cell's optimum, power laws c * N^a * D^b with 95% intervals, the largest cell held out.

    Example: gnsweep laws runs/d1k runs/d2k runs/d4k runs/d8k --out runs/laws --predict N=17,D=65536
    """
    from gnsweep.commands.laws import run

    run(list(sweep_dirs or []), table=table, out=out, point=predict, tolerance=tolerance,
        bootstrap=bootstrap, as_json=as_json, echo=typer.echo)


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
