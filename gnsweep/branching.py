"""`gnsweep branch`: a batch size x learning rate grid started from checkpoints of one base run.

For each requested point N (examples seen), the base run's checkpoint taken for N
(`train.keep_checkpoints_at`: the first step boundary at or past N), else its kept checkpoint
at or before N, is a branch point: its loss is measured on fresh batches at its fixed
parameters (the targets are fractions of it, `branch.targets`), the base run's noise scale
there is read from its metrics, and the grid's runs are written under `D/runs/` (run ids
`at<N>_b..`), each starting from that checkpoint (`gnsweep.training.branch_start`: what is kept and
what is reset). The folder is a sweep like any other: status, analyze (the local B_crit,
`analysis.along`), plot and report work, and the same command again resumes it. docs/along.md.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.analysis.along import branch_point
from gnsweep.compose import compose
from gnsweep.config import Config, ConfigError
from gnsweep.folder import SweepFolder
from gnsweep.paths import RUN_CONFIG, RUNS, RunPaths, SweepPaths, sweep_of
from gnsweep.runs import RunSpec, write_run
from gnsweep.stall import bounded
from gnsweep.tasks import about

PROBE_SEED = 271_828
"""Seed of the batches on which the loss at a branch point is measured (the same at every
relaunch, so a resumed branch sweep finds the same targets)."""
OPTIMIZER_KEYS = ("optimizer", "momentum", "weight_decay", "betas", "eps")
"""The `train` settings that make the optimizer a checkpoint's state belongs to."""
FIXED_BY_BASE = ("task", *(f"train.{k}" for k in OPTIMIZER_KEYS))
"""Settings a branch run takes from the base run: its checkpoint is that model and optimizer."""


def parse_points(text: str) -> list[int]:
    """`--at 1000,4000,16000` (examples seen; 1e4 and 10_000 also read) as sorted integers."""
    points = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            value = float(part.replace("_", ""))
        except ValueError:
            raise ConfigError(f"--at: {part!r} is not a number of examples; give e.g. "
                              "--at 1000,4000,16000") from None
        if not (math.isfinite(value) and value >= 1 and value == int(value)):
            raise ConfigError(f"--at: {part} is not a positive whole number of examples")
        points.append(int(value))
    if not points:
        raise ConfigError("--at: give at least one branch point, e.g. --at 1000,4000")
    return sorted(set(points))


def kept_checkpoints(run_dir: Path) -> tuple[dict[int, Path], dict[int, tuple[int, Path]]]:
    """The checkpoints a run kept (`train.keep_checkpoints_at`, `train.keep_checkpoints=log`;
    while it trains also its latest): by the examples it had seen at each, and by the
    `keep_checkpoints_at` point each was taken for ((examples, path))."""
    from gnsweep.training.checkpoint import kept, taken_for

    return dict(kept(run_dir)), taken_for(run_dir)


def branch_checkpoint(run_dir: Path, at: int, kept: dict[int, Path],
                      taken_for: dict[int, tuple[int, Path]]) -> tuple[int, Path]:
    """(examples, path) of the checkpoint to branch from at `at` examples: the one taken for
    `at` (`keep_checkpoints_at=[at]`: at the first step boundary at or past it), else the kept
    one with the most examples not above `at`; ConfigError (one line, exit 2) when the run kept
    none that early."""
    if at in taken_for:
        return taken_for[at]
    usable = [n for n in kept if n <= at]
    if not usable:
        have = ", ".join(f"{n:,}" for n in sorted(kept)) or "none"
        raise ConfigError(f"{run_dir}: no checkpoint kept at or before {at:,} examples (kept: "
                          f"{have}); branch later, or keep earlier ones in the base run "
                          "(train.keep_checkpoints_at=[...])")
    best = max(usable)
    return best, kept[best]


def refuse_script(base: Config) -> None:
    """ConfigError (exit 2, nothing written) for a task=script base run: a branch starts from
    gnsweep's own checkpoints, and a script's checkpoints are its own."""
    from gnsweep.tasks import SCRIPT

    if base.task.name == SCRIPT:
        raise ConfigError("gnsweep branch starts runs from gnsweep's own checkpoints, and a "
                          "task=script run's checkpoints are its script's: launch a script "
                          "sweep whose command starts from your checkpoint instead "
                          "(docs/scripts.md)")


def branch_config(base: Config, overrides: list[str], *, has_eval: bool = False) -> Config:
    """The branch sweep's config: the overrides composed as for `gnsweep launch`, with the base
    run's task and optimizer settings (FIXED_BY_BASE). Overrides of those may repeat the base
    run's settings; one that differs from them is refused. A custom task gives its batch sizes
    and learning rates (its targets are `branch.targets`, or automatic: no sweep.targets).

    Read on the eval loss where the task has one (`has_eval`) and `analysis.loss` is not set:
    a branch run's targets lie a few per cent below its point, and a noisy training loss
    cannot tell them apart."""
    from gnsweep.sweep import config_differences
    from gnsweep.tasks import CUSTOM

    refuse_script(base)
    config = compose(overrides, grid=("batch_sizes", "learning_rates"),
                     custom=base.task.name == CUSTOM)
    keys = [(o, o.lstrip("+~").split("=", 1)[0]) for o in overrides]
    if has_eval and about(base.task).metric == "loss" \
            and "analysis.loss" not in {k for _, k in keys}:
        config = dataclasses.replace(config, analysis=dataclasses.replace(config.analysis,
                                                                         loss="eval"))
    touched = [o for o, key in keys
               if any(key == f or key.startswith(f"{f}.") for f in FIXED_BY_BASE)]
    if touched:
        # Only what the overrides touch: the task not named keeps the default's, not the base's.
        task_touched = any(k == "task" or k.startswith("task.") for _, k in keys)

        def fixed(c: Config) -> dict:
            return {**({"task": c.to_dict()["task"]} if task_touched else {}),
                    "train": {k: getattr(c.train, k) for k in OPTIMIZER_KEYS}}

        differ = config_differences(fixed(base), fixed(config))
        if differ:
            raise ConfigError(f"{' '.join(touched)}: a branch run trains the base run's model "
                              f"with its optimizer, and this changes them ({'; '.join(differ)}); "
                              "drop it")
    if config.sweep.schedule != "constant":
        raise ConfigError(f"sweep.schedule={config.sweep.schedule}: a branch sweep is a grid of "
                          "fixed batch sizes; drop the schedule")
    if config.train.lr_scheduled:
        raise ConfigError("a branch run trains at the grid's constant learning rate from its "
                          "point (a warmup or decay would start again there and be measured "
                          "instead of the batch size); drop train.warmup_steps/warmup_examples "
                          "and train.decay")
    train = dataclasses.replace(config.train, **{k: getattr(base.train, k)
                                                 for k in OPTIMIZER_KEYS})
    return dataclasses.replace(config, task=base.task, train=train)


def loss_at(base: Config, base_spec: RunSpec, source: dict[str, Any], batch_size: int,
            batches: int, loss: str) -> float:
    """The loss at a checkpoint's fixed parameters: the mean loss over `batches` fresh batches
    of `batch_size` (train mode, as the training loop measures it; each batch weighted by the
    examples it counts), or the task's eval loss with `loss=eval`. No update, no gradient: the
    branch point's own loss, free of the lag and curvature bias a smoother of the base run's
    logged losses has where the loss falls fast (docs/along.md)."""
    import torch

    from gnsweep.tasks import examples_of, make_task
    from gnsweep.training.data import make_data

    task = make_task(base.task.name, base.task.options, base_spec.seed)
    model = task.model()
    model.load_state_dict(source["model"])
    if loss == "eval" and hasattr(task, "eval_loss"):
        model.eval()
        with torch.no_grad():
            return float(task.eval_loss(model))
    # The task's own data (its sample() or its dataset()), drawn from a seed of the probe's.
    data = make_data(task, PROBE_SEED, 1, 0, torch.device("cpu"))
    total = count = 0.0
    try:
        with torch.no_grad():
            for _ in range(batches):
                batch = data.draw(batch_size)
                n = examples_of(task, batch)
                total += float(task.loss(model, batch)) * n
                count += n
    finally:
        data.close()
    return total / count


def base_noise(run_dir: Path, at_step: int, at_examples: int, loss: str
               ) -> tuple[float, float, float]:
    """The base run's smoothed loss, B_simple and B_noise at a checkpoint, from its logged rows
    (NaN where it logged none there)."""
    from gnsweep.analysis.along import base_curve
    from gnsweep.analysis.pipeline import AnalysisError
    from gnsweep.folder import load_run_curves

    try:
        point = branch_point(base_curve(load_run_curves(run_dir), loss), at_step, at_examples)
    except (AnalysisError, store.StoreError):  # no rows there (yet)
        return math.nan, math.nan, math.nan
    return point.at_loss, point.b_simple, point.b_noise


def prepare_branch(base_run: Path, at: list[int], sweep_dir: Path, overrides: list[str]
                   ) -> tuple[Config, list[RunSpec]]:
    """Resolve the branch points, write the branch sweep's config and every run's record (those
    already written are kept: the same command resumes); returns (config, specs)."""
    from gnsweep.sweep import prepare_folder
    from gnsweep.training.branch_start import read_checkpoint

    base, base_spec = read_base(base_run)
    refuse_script(base)
    config = branch_config(base, overrides, has_eval=has_eval_loss(base, base_spec))
    metric_task = about(config.task).metric != "loss"
    loss = "metric" if metric_task else config.analysis.loss
    kept, asked = kept_checkpoints(base_run)
    chosen = sorted({branch_checkpoint(base_run, n, kept, asked) for n in at})
    points = []
    for examples, path in chosen:
        source = read_checkpoint(path)
        step = int(source["progress"]["step"])
        smoothed, b_simple, b_noise = base_noise(base_run, step, examples, loss)
        if metric_task:  # a return cannot be probed at fixed parameters: the logged one
            if not math.isfinite(smoothed):
                raise ConfigError(f"{base_run}: its logged {about(config.task).metric} does not "
                                  f"cover step {step}; a branch needs it there")
            at_loss = smoothed
        else:
            at_loss = bounded(
                config.sweep.stall_seconds, f"{base_run}: the loss at its checkpoint at step "
                f"{step} (the task's own code)",
                lambda source=source: loss_at(base, base_spec, source,  # type: ignore[misc]
                                              max(config.sweep.batch_sizes),
                                              config.branch.probe_batches, loss))
        points.append({"at_examples": examples, "at_step": step, "at_loss": at_loss,
                       "b_simple": b_simple, "b_noise": b_noise,
                       "checkpoint": str(path.resolve())})
    branch = dataclasses.replace(config.branch, base=str(base_run.resolve()), points=points)
    config = dataclasses.replace(config, branch=branch)
    prepare_folder(sweep_dir, config)
    specs = []
    # Each point's runs train one window (automatic targets) or stop at its own hardest
    # target: derived from the sweep's config and the run's point when the run is built
    # (`runs.run_config`).
    for point in branch.points:
        for spec in _grid(config, point["at_examples"]):
            write_run(sweep_dir, config, spec)
            specs.append(spec)
    return config, specs


def read_base(base_run: Path) -> tuple[Config, RunSpec]:
    """The base run's config and grid point (ConfigError: not a run folder of a sweep). Its
    record is checked against its sweep's config.yaml, as every reader does, before its task is
    built: a run file never names code of its own."""
    if not RunPaths(base_run).record.is_file() or base_run.parent.name != RUNS:
        raise ConfigError(f"{base_run}: not a run folder of a sweep (no {RUN_CONFIG} in "
                          f"<sweep>/{RUNS}/<run id>); give a run of a sweep, e.g. "
                          "runs/digits/runs/b00032_lr0.1_s0")
    base_sweep = sweep_of(base_run)
    return SweepFolder.open(base_sweep).read_run(base_run.name)


def has_eval_loss(base: Config, base_spec: RunSpec) -> bool:
    """Whether the base run's task has a held-out loss (`eval_loss`)."""
    from gnsweep.tasks import make_task

    return hasattr(make_task(base.task.name, base.task.options, base_spec.seed), "eval_loss")


def plan_branch(base_run: Path, at: list[int], sweep_dir: Path, overrides: list[str]
                ) -> tuple[Config, list[tuple[RunSpec, str]]]:
    """What `gnsweep branch` would run, writing nothing and training nothing: the branch
    sweep's config (its points resolved to the base run's checkpoints, the loss there not yet
    measured) and each run's grid point with its state in `sweep_dir` (pending where it has no
    record yet)."""
    from gnsweep.runs import read_state

    base, base_spec = read_base(base_run)
    refuse_script(base)
    config = branch_config(base, overrides, has_eval=has_eval_loss(base, base_spec))
    kept, asked = kept_checkpoints(base_run)
    chosen = sorted({branch_checkpoint(base_run, n, kept, asked) for n in at})
    planned = []
    for examples, _path in chosen:
        for spec in _grid(config, examples):
            run = SweepPaths(sweep_dir).run(spec.run_id)
            state = (read_state(run.folder).state.value
                     if run.status.is_file() else "pending")
            planned.append((spec, state))
    return config, planned


def _grid(config: Config, at_examples: int) -> list[RunSpec]:
    sweep = config.sweep
    return sorted(RunSpec(b, lr, s, at_examples=at_examples) for b in sweep.batch_sizes
                  for lr in sweep.learning_rates for s in sweep.seeds)


def resolve_along(config: Config, sweep_dir: Path) -> Config:
    """The config with an along schedule's curve resolved (`sweep.schedule=along`): the local
    B_crit of `sweep.along_from`'s along.parquet at each branch point, at the fraction nearest 1
    that has a fit there (the most local reading), as [examples, B_crit] pairs. ConfigError
    (exit 2) when that folder has no analysed branch sweep or no fit at any point. The learning
    rate's rule is resolved with the adaptive one's (`sweep.resolve_adaptive_lr`: eq. 2.7 from
    this folder's fixed-batch fit)."""
    sweep = config.sweep
    if sweep.schedule != "along" or sweep.along_points:
        return config
    source = Path(sweep.along_from)
    path = SweepPaths(source).result("along")
    if not path.is_file():
        raise ConfigError(f"sweep.along_from={source}: no along.parquet there; run gnsweep "
                          f"branch into it, then gnsweep analyze {source}")
    along = store.read_table(path).to_pandas()
    fitted = along[(along["refused"].astype(str) == "") & (along["b_crit"] > 0)]
    points = []
    for at, rows in fitted.groupby("at_examples"):
        row = rows.loc[rows["target"].idxmax()]
        points.append([float(at), float(row["b_crit"])])
    if not points:
        raise ConfigError(f"{path}: no branch point has a fit of eq. 2.11; nothing to follow")
    return dataclasses.replace(config, sweep=dataclasses.replace(sweep, along_points=points))
