"""`gnsweep launch`: compose the config, resolve the schedules that read other folders, expand
the grid, check the task (`preflight`), then run what has not finished (`gnsweep.sweep.launch`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gnsweep import store
from gnsweep.commands import Echo
from gnsweep.config import Config
from gnsweep.paths import SweepPaths, default_sweep_dir
from gnsweep.preflight import compose_config, preflight
from gnsweep.tasks import about


def grid_line(config: Any, specs: list[Any], sweep_dir: Path) -> str:
    """`sweep NAME: task T, N runs (batch sizes ... x learning rates ... x seeds ...) -> DIR`."""
    sweep = config.sweep

    def listed(values: list[Any]) -> str:
        return ",".join(f"{v:g}" for v in values)

    grid = (f"batch sizes {listed(sweep.batch_sizes)} x learning rates "
            f"{listed(sweep.learning_rates)} x seeds {listed(sweep.seeds)}")
    if sweep.schedule == "adaptive":
        grid += f", adaptive at exchange rates {listed(sweep.exchange_rates)}"
    return (f"sweep {sweep.name}: task {about(config.task).label}, {len(specs)} runs ({grid}; "
            f"targets {listed(sweep.targets) if sweep.targets else 'auto (from the runs)'}) -> "
            f"{sweep_dir}")


def run_states(sweep_dir: Path, specs: list[Any]) -> dict[str, str]:
    """Each run's state in the sweep folder as a launch would act on it (done, diverged,
    failed, running, pending: a run not written yet, or recorded finished with its metrics
    lost)."""
    from gnsweep.runs import read_state

    out = {}
    for spec in specs:
        path = SweepPaths(sweep_dir).run(spec.run_id).folder
        out[spec.run_id] = read_state(path).state.value if path.is_dir() else "pending"
    return out


def run(overrides: list[str] | None, *, sweep_dir: Path | None, workers: int | None,
        dry_run: bool, quiet: bool, detach: bool, echo: Echo) -> int:
    """Run (or resume) the sweep; returns the exit code: 0 every run ended done or diverged,
    1 a run failed (named on stderr)."""
    from gnsweep.sweep import expand_grid, resolve_adaptive_lr, unmeasured_runs
    from gnsweep.sweep import launch as run_sweep

    config = compose_config(overrides, workers)
    sweep_dir = sweep_dir or default_sweep_dir(config.sweep.name)
    config = resolve_adaptive_lr(config, sweep_dir)  # adaptive runs: eq. 2.7 from the folder's fit
    if config.sweep.schedule == "along":  # the measured B_crit curve of a branch sweep
        from gnsweep.branching import resolve_along

        config = resolve_along(config, sweep_dir)
    specs = expand_grid(config)
    if dry_run:
        from collections import Counter

        from gnsweep.tasks import SCRIPT

        script = config.task.name == SCRIPT
        per_sample = 1.0
        if script:  # its command checked as a launch checks it; its examples a sample
            config, per_sample, _ = preflight(config, overrides)
        echo(grid_line(config, specs, sweep_dir))
        for line in [budget_line(config), *budget_lines(config, per_sample)]:
            echo(line)
        echo(f"{'run_id':<28}{'batch_size':>16}{'learning_rate':>16}{'seed':>6}  state")
        states = run_states(sweep_dir, specs)
        shown = specs[:COMMANDS_SHOWN] if script else specs
        for spec in shown:
            # An adaptive run's batch size follows the noise scale, its rate is eps_max (eq. 2.7).
            batch, lr = ((f"adaptive r={spec.exchange_rate:g}", f"eps_max {spec.learning_rate:g}")
                         if spec.adaptive else ("along B_crit", f"eps_max {spec.learning_rate:g}")
                         if spec.along else (str(spec.batch_size), f"{spec.learning_rate:g}"))
            echo(f"{spec.run_id:<28}{batch:>16}{lr:>16}{spec.seed:>6}  {states[spec.run_id]}")
            if script:
                echo(f"    $ {filled_command(config, spec, sweep_dir)}")
        if len(shown) < len(specs):
            echo(f"... and {len(specs) - len(shown)} more runs, each its command with its own "
                 "batch size, learning rate and seed")
        counts = Counter(states.values())
        echo(f"{len(specs)} runs: " + ", ".join(f"{n} {state}" for state, n in
                                              sorted(counts.items()))
             + " (a launch runs every run not done or diverged)")
        return 0
    # Before the sweep folder is written: a task that cannot train is refused here (exit 2).
    # Windows given in samples are converted to the task's unit (tokens).
    config, per_sample, scale = preflight(config, overrides)
    echo(grid_line(config, specs, sweep_dir))  # the grid that runs, before it runs
    if not sweep_dir.exists() or store.is_sweep(sweep_dir) or not any(sweep_dir.iterdir()):
        # The model size N for `gnsweep laws`; a folder that is not a sweep is refused below.
        sweep_dir.mkdir(parents=True, exist_ok=True)
        store.write_json(SweepPaths(sweep_dir).scale, scale)
    for line in budget_lines(config, per_sample):
        echo(line)
    summary = run_sweep(config, sweep_dir, show_progress=not quiet, wait=not detach)
    if detach and config.executor.kind == "slurm":
        jobs = ", ".join(summary.submitted) or "none (nothing left to run)"
        echo(f"sweep {sweep_dir}: submitted Slurm jobs {jobs}")
        echo(f"follow: gnsweep status {sweep_dir}")
        return 0
    echo(f"sweep {sweep_dir}: {summary.describe()}")
    from gnsweep.status_rows import noise_plan_lines

    for line in noise_plan_lines(sweep_dir)[:1]:  # which runs measured (noise_plan.json: why)
        echo(line)
    if summary.failed:
        echo(f"failed runs (gnsweep status {sweep_dir} shows why): "
             f"{', '.join(summary.failed)}", err=True)
    # A noise scale missing on most of a run is said loudly (the runs still count: exit 0).
    unmeasured = unmeasured_runs(sweep_dir, [spec.run_id for spec in specs])
    if unmeasured:
        echo(unmeasured, err=True)
    if summary.done or summary.diverged or not summary.failed:  # not when every run failed
        echo(f"next: gnsweep analyze {sweep_dir}")
    return 1 if summary.failed else 0


COMMANDS_SHOWN = 10
"""A script sweep's dry run shows this many runs, each with its filled-in command."""


def filled_command(config: Config, spec: Any, sweep_dir: Path) -> str:
    """The command a script run's first attempt starts, every placeholder filled (under
    torchrun for executor=torchrun), as a shell would take it."""
    import shlex

    from gnsweep.training.script_command import command, placeholder_values

    run_path = SweepPaths(sweep_dir).run(spec.run_id).folder
    return shlex.join(command(config, placeholder_values(config, spec, run_path, 0, 1)))


def budget_line(config: Config) -> str:
    """What each run may spend and when it ends: the step and example budgets, the targets
    it stops at, its retries."""
    sweep = config.sweep
    unit = about(config.task).unit
    examples = (f"sweep.max_examples={sweep.max_examples:,} {unit}" if sweep.max_examples
                else "sweep.max_examples=0 (no limit in examples)")
    stop = (f"stops at target {about(config.task).hardest(sweep.targets):g} (the hardest)"
            if sweep.targets else "trains its whole budget (targets auto)")
    return (f"budget a run: sweep.max_steps={sweep.max_steps:,} steps, {examples}; each run "
            f"{stop}; a failed run is retried up to sweep.max_retries={sweep.max_retries} "
            "times (a failure that would repeat is not)")


def budget_lines(config: Config, per_sample: float) -> list[str]:
    """A line where `sweep.max_steps` ends some batch sizes' runs before `sweep.max_examples`
    would (their budget in examples is then smaller than the larger batches'), naming them;
    none without `max_examples`. `per_sample`: examples a sample (tokens a sequence)."""
    sweep = config.sweep
    if not sweep.max_examples:
        return []
    short = [b for b in sweep.batch_sizes if sweep.max_steps * b * per_sample < sweep.max_examples]
    if not short:
        return []
    listed = ",".join(str(b) for b in short)
    return [f"note: sweep.max_steps={sweep.max_steps} ends runs at batch sizes {listed} before "
            f"sweep.max_examples={sweep.max_examples:,} (at batch size {short[-1]}, "
            f"{sweep.max_steps:,} steps train {round(sweep.max_steps * short[-1] * per_sample):,}"
            " examples); raise sweep.max_steps to give them the same budget in examples"]


def command(
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
    code = run(overrides, sweep_dir=sweep_dir, workers=workers, dry_run=dry_run, quiet=quiet,
               detach=detach, echo=typer.echo)
    if code:
        raise typer.Exit(code)
