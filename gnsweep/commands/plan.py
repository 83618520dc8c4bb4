"""`gnsweep plan`: check the task as a launch does (`preflight`), read the finished runs, ask
`pilot.decide` for the next round, record it in D/plan.json (atomically, before any of its runs
starts), write the runs' records and hand them to the executors exactly as `gnsweep launch`
does; repeat until nothing is left to decide.

A re-run resumes: recorded rounds are run to the end first (their finished runs are skipped),
then decisions are derived again from the finished runs, which give the same answer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from gnsweep import store
from gnsweep.commands import Echo
from gnsweep.config import Config, ConfigError
from gnsweep.folder import SweepFolder
from gnsweep.paths import SweepPaths, default_sweep_dir
from gnsweep.planner.pilot import SPREAD, Decision, PlanError, Proposal, RunOutcome, decide
from gnsweep.runs import RunSpec, write_run
from gnsweep.tasks import about

"""The plan's record in the sweep folder: every round decided, its runs and why."""


@dataclass
class PlanSummary:
    """What a plan ran (over all its rounds, resumed ones included)."""

    rounds: int = 0
    run_ids: list[str] = field(default_factory=list)
    capped: list[str] = field(default_factory=list)
    """Runs given a step budget below sweep.max_steps (rule 5)."""
    grid_size: int = 0
    final: Decision | None = None


def plan(config: Config, sweep_dir: Path, *, show_progress: bool = True,
         echo: Callable[[str], None] = print) -> PlanSummary:
    """Run the plan in `sweep_dir` (or resume it) until every chosen batch size is bracketed."""
    from gnsweep.sweep import prepare_folder, run_specs

    if config.sweep.auto_targets:
        raise PlanError("gnsweep plan decides per target and needs sweep.targets; give them "
                        "(a first sweep's `gnsweep analyze DIR --targets auto` suggests levels)")
    path = SweepPaths(sweep_dir).plan
    if (store.is_sweep(sweep_dir) and not os.path.lexists(path)
            and (store.run_ids(sweep_dir) or store.unreadable_runs(sweep_dir))):
        raise ConfigError(f"{sweep_dir}: a sweep folder that `gnsweep launch` wrote (runs but no "
                          f"{path.name}); a plan would add its runs to that grid: give the plan "
                          "a folder of its own (--sweep-dir NEW) or an earlier plan's folder")
    record: Any = store.read_json(path) if os.path.lexists(path) else {"rounds": []}
    if not _plan_record(record):
        raise store.StoreError(f"{path}: not a plan's record (an object with a list of "
                               "rounds, each a phase and its runs); restore it, or give the plan "
                               "a new --sweep-dir")
    prepare_folder(sweep_dir, config)
    rounds: list[dict[str, Any]] = record["rounds"]
    seed = config.sweep.seeds[0]
    grid_size = len(config.sweep.batch_sizes) * len(config.sweep.learning_rates)
    summary = PlanSummary(grid_size=grid_size)
    announced = False
    while True:
        index = summary.rounds
        if index < len(rounds):
            entry = rounds[index]
            echo(f"round {index + 1} ({entry['phase']}, recorded): {len(entry['runs'])} run(s)")
        else:
            outcomes = read_outcomes(sweep_dir, config)
            decision = decide(outcomes, config.sweep.batch_sizes,
                              config.sweep.learning_rates, config.sweep.targets,
                              config.sweep.max_steps,
                              direction=about(config.task).direction)
            proposed = {run["run_id"] for earlier in rounds for run in earlier["runs"]}
            if decision.proposals and all(RunSpec(p.batch_size, p.learning_rate, seed).run_id
                                          in proposed for p in decision.proposals):
                # The rules are a function of the finished runs: a round of runs already run
                # says their outcomes were not read, and would repeat forever.
                again = ", ".join(f"b={p.batch_size} lr={p.learning_rate:g}"
                                  for p in decision.proposals)
                raise PlanError(f"the plan proposes again runs it has run ({again}); their "
                                f"outcomes were not read: check `gnsweep status {sweep_dir}`")
            if decision.pilot is not None and not announced:
                announced = True
                for line in explain(decision, config):
                    echo(line)
            if not decision.proposals:
                summary.final = decision
                record["final"] = _decision_record(decision)
                store.write_json(path, record)
                break
            entry = {"phase": decision.phase,
                     "runs": [{**asdict(p), "seed": seed,
                               "run_id": RunSpec(p.batch_size, p.learning_rate, seed).run_id}
                              for p in decision.proposals]}
            rounds.append(entry)
            store.write_json(path, record)  # decided before anything of it runs
            echo(f"round {index + 1} ({decision.phase}): {len(entry['runs'])} run(s)")
            for run in entry["runs"]:
                budget = (f", max_steps {run['max_steps']}"
                          if run["max_steps"] < config.sweep.max_steps else "")
                echo(f"  b={run['batch_size']} lr={run['learning_rate']:g}{budget}: "
                     f"{run['why']}")
        ids = []
        for run in entry["runs"]:
            run_config = Config.from_dict(
                {**config.to_dict(), "sweep": {**config.to_dict()["sweep"],
                                               "max_steps": int(run["max_steps"])}})
            spec = RunSpec(int(run["batch_size"]), float(run["learning_rate"]), int(run["seed"]))
            write_run(sweep_dir, run_config, spec)
            ids.append(spec.run_id)
            if run["max_steps"] < config.sweep.max_steps:
                summary.capped.append(spec.run_id)
        run_specs(config, sweep_dir, ids, show_progress=show_progress)
        summary.run_ids += ids
        summary.rounds += 1
    return summary


def _plan_record(record: Any) -> bool:
    """Whether plan.json holds what `plan` writes: {"rounds": [{"phase", "runs": [{batch_size,
    learning_rate, seed, max_steps, run_id}...]}...]} with numbers where numbers belong."""
    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) \
            and math.isfinite(value)

    if not isinstance(record, dict) or not isinstance(record.get("rounds"), list):
        return False
    for entry in record["rounds"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("phase"), str)
                and isinstance(entry.get("runs"), list)):
            return False
        for run in entry["runs"]:
            if not (isinstance(run, dict) and isinstance(run.get("run_id"), str)
                    and all(number(run.get(k)) for k in (
                        "batch_size", "learning_rate", "seed", "max_steps"))):
                return False
    return True


def read_outcomes(sweep_dir: Path, config: Config) -> list[RunOutcome]:
    """Every finished run of the folder at `seed`, as the rules see it (steps-to-target on the
    sweep's loss, B_simple's S_min-weighted mean up to each target)."""
    from gnsweep.analysis.steps import steps_to_target
    from gnsweep.folder import SweepFolder

    if not store.run_ids(sweep_dir):
        return []
    seed = config.sweep.seeds[0]
    # The folder as it stands after this round's launch (its config.yaml merged, its runs).
    folder = SweepFolder.open(sweep_dir)
    curves = folder.curves()
    steps = steps_to_target(curves, None, config.sweep.targets, loss=config.analysis.loss,
                            direction=about(config.task).direction)
    out = []
    for run in curves.runs.itertuples(index=False):
        if run.state not in ("done", "diverged", "failed") or run.seed != seed:
            continue
        rows = steps[(steps["run_id"] == run.run_id) & steps["reached"]]
        # The grid point as the config names it: the analysis's runs table counts the batch in
        # the task's unit (tokens), the grid in samples per step.
        run_config, spec = folder.read_run(str(run.run_id))
        b_simple = {float(r.target): float(r.b_simple_mean) for r in rows.itertuples()
                    if math.isfinite(r.b_simple_mean)}
        ran = store.read_status(folder.run(str(run.run_id)).folder).steps
        out.append(RunOutcome(int(spec.batch_size), float(spec.learning_rate), str(run.state),
                              run_config.sweep.max_steps,
                              {float(r.target): float(r.steps) for r in rows.itertuples()},
                              b_simple, int(ran) if ran is not None else None))
    return out


def examples_processed(sweep_dir: Path, run_ids: list[str] | None = None) -> int:
    """Compute of the runs: examples processed (steps x batch size), diverged runs included."""
    total = 0
    for run_id in run_ids if run_ids is not None else store.run_ids(sweep_dir):
        run = SweepPaths(sweep_dir).run(run_id)
        batch = int(store.read_json(run.record)["run"]["batch_size"])
        total += (store.read_status(run.folder).steps or 0) * batch
    return total


def explain(decision: Decision, config: Config) -> list[str]:
    """What the plan decided from the pilot and why, in a few lines."""
    assert decision.pilot is not None
    b_pilot, lr_pilot = decision.pilot
    declared = about(config.task)
    order = declared.direction.in_training_order(decision.b_noise)
    noise = ", ".join(f"{decision.b_noise[t]:.4g} ({declared.metric} {t:g})" for t in order)
    grid = sorted(config.sweep.batch_sizes)
    finite = [v for v in decision.b_noise.values() if math.isfinite(v) and v > 0]
    k = SPREAD
    span = (f"the grid's within [{min(finite) / k:.3g}, {max(finite) * k:.3g}] = B_simple / {k:g}"
            f" .. B_simple x {k:g}, where S = S_min + E_min/B is within {1 / k:.1%} of each "
            "asymptote, and the smaller ones (cheap: E is near E_min there)" if finite
            else "no B_simple measured: the whole grid")
    first = ", ".join(f"{b}: {lr:g}" for b, lr in sorted(decision.first.items()))
    return [
        f"pilot b={b_pilot} lr={lr_pilot:g}: B_simple {noise}; predicts B_crit ~ B_simple",
        f"batch sizes {decision.batch_sizes} ({len(decision.batch_sizes)} of {len(grid)}): "
        f"{span}",
        f"learning rates: eps_opt(B) = eps_max / (1 + B_noise/B) (eq. 2.7), B_noise ~ "
        f"{decision.b_noise_lr:.4g}, eps_max {decision.eps_max:.4g} (the pilot's rate optimal "
        f"at b={b_pilot}); first rate per batch size {first}; then each target's best rate is "
        "bracketed by known worse rates (rule 4: a neighbour that stopped too soon to tell is "
        "walked past)",
    ]


def _decision_record(decision: Decision) -> dict[str, Any]:
    return {"pilot": list(decision.pilot) if decision.pilot else None,
            "b_noise": {f"{t:g}": v for t, v in decision.b_noise.items()},
            "batch_sizes": decision.batch_sizes, "eps_max": decision.eps_max,
            "b_noise_lr": decision.b_noise_lr,
            "first": {str(b): lr for b, lr in decision.first.items()}}


__all__ = ["PlanSummary", "Proposal", "examples_processed", "explain", "plan",
           "read_outcomes"]


UNFINISHED = ("pending", "running")
"""States of a recorded round's run that a resumed plan runs (a failed run stays failed, as the
executor left it after its retries)."""


def folder_argument(overrides: list[str] | None) -> Path | None:
    """The analysed sweep folder of `gnsweep plan DIR` (one argument, not an override, naming a
    folder), else None (a plan from overrides)."""
    if overrides and len(overrides) == 1 and "=" not in overrides[0]:
        path = Path(overrides[0])
        if path.is_dir():
            return path
        raise store.StoreError(f"{path}: no such sweep folder; give a folder that `gnsweep "
                               "launch` wrote, or Hydra overrides (key=value) for a new plan")
    return None


def _next_grids_record(record: Any) -> bool:
    """Whether next_grids.json holds what `next_grids` writes: {"budget": int, "rounds": [{"runs":
    [{batch_size, learning_rate, seed, run_id}...]}...]}."""
    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) \
            and math.isfinite(value)

    if not (isinstance(record, dict) and isinstance(record.get("rounds"), list)
            and number(record.get("budget"))):
        return False
    return all(isinstance(entry, dict) and isinstance(entry.get("runs"), list) and all(
        isinstance(run, dict) and isinstance(run.get("run_id"), str)
        and all(number(run.get(k)) for k in ("batch_size", "learning_rate", "seed"))
        for run in entry["runs"]) for entry in record["rounds"])


def _state(sweep_dir: Path, run_id: str) -> str:
    """A run's state as a resumed plan acts on it (pending where its record was never written)."""
    from gnsweep.runs import read_state

    path = SweepPaths(sweep_dir).run(run_id).folder
    return str(read_state(path).state) if path.is_dir() else "pending"


def next_grids(sweep_dir: Path, *, workers: int | None = None, show_progress: bool = True,
               budget: int | None = None, echo: Callable[[str], None] = print) -> list[str]:
    """`gnsweep plan DIR`: while the folder's recommendation (`analysis.decision`) is a bound,
    run exactly the runs of its next grid (`planner.next_grid`: every seed of the sweep, the
    folder's grid widened to hold them) and analyse again, round after round while the runs of
    the plan have processed fewer examples than its budget (`budget`, else the one recorded,
    else the examples the folder's runs had processed when the plan began: the plan at most
    about doubles the sweep). Stops with its reason: the answer settled, nothing left to run,
    or the budget spent. Returns the run ids of its rounds.

    Each round is recorded in DIR/next_grids.json before any of its runs is written or starts.
    A re-run (after a kill, even mid-round) first runs what its recorded rounds left unfinished,
    then derives the next round from the finished runs, exactly as an uninterrupted plan would:
    the same runs, none twice, none lost."""
    import dataclasses

    from gnsweep.analysis.decision import recommend
    from gnsweep.report.recommendation import summary
    from gnsweep.report.views import quantity
    from gnsweep.sweep import prepare_folder, run_specs
    from gnsweep.sweep_analysis import analyze_sweep, setting_of

    config = SweepFolder.open(sweep_dir).config  # config.yaml parsed, run files checked, once
    if config.branch.points:
        raise PlanError(f"{sweep_dir}: a branch sweep; its next batch sizes are read from "
                        f"`gnsweep analyze {sweep_dir}` per branch point")
    if budget is not None and budget <= 0:
        raise ConfigError(f"--budget: {budget} examples; give a positive number of examples")
    if workers is not None:
        config = dataclasses.replace(
            config, executor=dataclasses.replace(config.executor, workers=workers))
    path = SweepPaths(sweep_dir).next_grids
    record: Any = store.read_json(path) if os.path.lexists(path) else None
    if record is not None and not _next_grids_record(record):
        raise store.StoreError(f"{path}: not a record of `gnsweep plan DIR` (a budget and a "
                               "list of rounds, each a list of runs); restore it or remove it")
    if record is None:
        record = {"budget": budget or max(examples_processed(sweep_dir), 1),
                  "before": examples_processed(sweep_dir), "rounds": []}
        how = "--budget" if budget else ("the examples the folder's runs processed before it: "
                                         "at most about doubling the sweep; --budget N to change")
    else:
        how = "recorded when the plan began"
        if budget is not None:
            record["budget"], how = budget, "--budget"
    record.pop("stopped", None)
    store.write_json(path, record)
    limit = int(record["budget"])
    echo(f"budget: {limit:,} examples ({how}); a round starts while the plan's runs have "
         "processed fewer")

    def run_round(entry: dict[str, Any]) -> list[str]:
        nonlocal config
        specs = [RunSpec(int(r["batch_size"]), float(r["learning_rate"]), int(r["seed"]))
                 for r in entry["runs"]]
        sweep = config.sweep
        config = dataclasses.replace(config, sweep=dataclasses.replace(
            sweep, batch_sizes=sorted({*sweep.batch_sizes, *(s.batch_size for s in specs)}),
            learning_rates=sorted({*sweep.learning_rates, *(s.learning_rate for s in specs)})))
        prepare_folder(sweep_dir, config, specs)
        for spec in specs:
            write_run(sweep_dir, config, spec)
        ids = [spec.run_id for spec in specs]
        run_specs(config, sweep_dir, ids, show_progress=show_progress)
        return ids

    ran: list[str] = []
    for index, entry in enumerate(record["rounds"]):  # what a killed plan left unfinished
        ids = [str(r["run_id"]) for r in entry["runs"]]
        left = [i for i in ids if _state(sweep_dir, i) in UNFINISHED]
        if left:
            echo(f"next grid, round {index + 1} (recorded): {len(left)} of {len(ids)} run(s) "
                 "left to run")
            run_round(entry)
        ran += ids
    while True:
        results = analyze_sweep(sweep_dir)
        rec = recommend(results, setting=setting_of(sweep_dir, results))
        spent = examples_processed(sweep_dir, ran)
        said = summary(rec.to_json(), quantity(results.meta))
        if rec.status != "bound":
            stopped = f"the answer is {rec.status}"
        elif rec.next_grid is None or not rec.next_grid.runs:
            stopped = ("still a bound and nothing left to run: "
                       + (rec.next_grid.reason if rec.next_grid is not None else rec.reason))
        elif spent >= limit:
            stopped = (f"budget spent: the plan's runs processed {spent:,} of {limit:,} examples "
                       f"and the answer is still a bound; `gnsweep plan {sweep_dir} --budget "
                       f"{2 * limit}` runs more")
        else:
            stopped = ""
        if stopped:
            record["stopped"] = stopped
            store.write_json(path, record)
            echo(said)
            echo(f"plan stopped after {len(record['rounds'])} round(s): {stopped}")
            return ran
        grid = rec.next_grid
        assert grid is not None
        specs = [RunSpec(r.batch_size, r.learning_rate, seed)
                 for r in grid.runs for seed in config.sweep.seeds]
        known = set(store.run_ids(sweep_dir))
        if all(spec.run_id in known for spec in specs):
            # The next grid is a function of the finished runs: the same runs again say their
            # outcomes did not move the answer (failed, or not finished).
            again = ", ".join(spec.run_id for spec in specs[:4])
            raise PlanError(f"the next grid proposes again runs the folder has ({again}...): "
                            f"check `gnsweep status {sweep_dir}`")
        entry = {"reason": grid.reason,
                 "runs": [{"batch_size": s.batch_size, "learning_rate": s.learning_rate,
                           "seed": s.seed, "run_id": s.run_id} for s in specs]}
        record["rounds"].append(entry)
        store.write_json(path, record)  # decided before anything of it is written or runs
        echo(f"next grid, round {len(record['rounds'])} ({len(specs)} run(s): {grid.reason}; "
             f"{spent:,} of {limit:,} examples spent)")
        for r in grid.runs:
            echo(f"  b={r.batch_size} lr={r.learning_rate:g}: {r.why}")
        ran += run_round(entry)


def run(overrides: list[str] | None, *, sweep_dir: Path | None, workers: int | None,
        quiet: bool, echo: Echo, budget: int | None = None) -> None:
    """`gnsweep plan`: the config and its checks as for `gnsweep launch`, then the plan's rounds;
    ends with what it ran and pruned. `gnsweep plan DIR` (an analysed sweep folder): the next
    grids of its recommendation (`next_grids`)."""
    from gnsweep.preflight import compose_config, preflight

    folder = folder_argument(overrides)
    if folder is not None:
        if sweep_dir is not None:
            raise PlanError("gnsweep plan DIR runs the next grid inside DIR; drop --sweep-dir")
        ids = next_grids(folder, workers=workers, show_progress=not quiet, budget=budget,
                         echo=echo)
        echo(f"plan {folder}: {len(ids)} run(s) of next grids, "
             f"{examples_processed(folder, ids):,} examples processed")
        echo(f"next: gnsweep recommend {folder}")
        return
    if budget is not None:
        raise PlanError("--budget bounds the rounds of `gnsweep plan DIR` (an analysed sweep "
                        "folder); a plan from overrides runs only the grid it is given")

    # As for launch: a task that cannot train is refused (exit 2), a custom task's unit recorded.
    config, _, _ = preflight(compose_config(overrides, workers), overrides)
    sweep_dir = sweep_dir or default_sweep_dir(f"{config.sweep.name}-plan")
    summary = plan(config, sweep_dir, show_progress=not quiet, echo=echo)
    ids = sorted(set(summary.run_ids))
    echo(f"plan {sweep_dir}: {len(ids)} of {summary.grid_size} grid runs in "
         f"{summary.rounds} round(s) ({summary.grid_size - len(ids)} pruned: never run; "
         f"{len(set(summary.capped))} with a smaller step budget); "
         f"{examples_processed(sweep_dir, ids):,} examples processed")
    echo(f"next: gnsweep analyze {sweep_dir}")


def command(
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
    run(overrides, sweep_dir=sweep_dir, workers=workers, quiet=quiet, echo=typer.echo,
        budget=budget)
