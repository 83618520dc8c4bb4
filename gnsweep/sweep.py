"""A sweep folder made ready and run: the grid's run specs (`runs.expand_grid`, the pure expansion)
written into the folder (`prepare`, checked against what an earlier launch wrote), which of
them remain, and `launch`, which hands those to the configured executor (`gnsweep.executors`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gnsweep import notices, redact, store, tasks
from gnsweep.config import Config, ConfigError
from gnsweep.folder import SweepFolder, read_config
from gnsweep.paths import SWEEP_CONFIG, SweepPaths, run_dir
from gnsweep.runs import (
    FINISHED,
    RELAUNCH_MAY_CHANGE,
    RunSpec,
    check_records,
    config_differences,
    expand_grid,
    fresh_retries,
    ids_free,
    parse_run_record,
    read_state,
    unmeasured_line,
    write_run,
)

# RunSpec, expand_grid, parse_run_record: from gnsweep.runs
__all__ = ["RunSpec", "expand_grid", "launch", "parse_run_record", "prepare", "prepare_folder",
           "remaining", "resolve_adaptive_lr", "run_specs", "unmeasured_runs"]


GRID_KEYS = ("batch_sizes", "learning_rates", "seeds", "exchange_rates")


def _check_relaunch(sweep_dir: Path, config: Config) -> dict[str, Any]:
    """The sweep config to write: the new one, its grid the union of the old and new grids.

    Raises ConfigError naming every setting that differs from the sweep folder's config in a
    way that changes what runs train.
    """
    new = config.to_dict()
    if not SweepPaths(sweep_dir).config_file.is_file():
        if store.run_ids(sweep_dir):
            raise ConfigError(
                f"{sweep_dir} holds runs but no {SWEEP_CONFIG}, so nothing says how they "
                f"were trained and this launch would adopt them: put the folder's "
                f"{SWEEP_CONFIG} back, or choose another --sweep-dir")
        return new
    # Typed: an older folder's missing settings read as their defaults, unknown ones are named.
    # Compared as written (secrets masked on both sides).
    old = redact.config(read_config(sweep_dir).to_dict())
    changed = [d for d in config_differences(old, redact.config(new))
               if not d.split(":")[0].startswith(RELAUNCH_MAY_CHANGE)]
    if changed:
        raise ConfigError(
            f"{sweep_dir} holds a sweep with other settings ({'; '.join(changed)}); runs "
            "trained differently cannot share one analysis: choose another --sweep-dir, or "
            "relaunch with the folder's settings (see its config.yaml)")
    for key in GRID_KEYS:
        if key == "exchange_rates" and new["sweep"]["schedule"] != "adaptive":
            continue  # a fixed-batch relaunch of a folder that holds adaptive runs
        merged = set(old.get("sweep", {}).get(key) or []) | set(new["sweep"][key])
        new["sweep"][key] = sorted(merged)
    Config.from_dict(new)  # the union grid must suit this executor too (batch / world size)
    return new


def resolve_adaptive_lr(config: Config, sweep_dir: Path) -> Config:
    """The config with the adaptive runs' learning-rate rule resolved: sweep.eps_max as given,
    else the eps_max of the eq. 2.7 fit of the folder's analysed fixed-batch runs
    (`fits.parquet`) at the hardest target that has one (the adaptive run trains to it); with
    `adaptive_lr=fit` and no `adaptive_lr_noise`, that fit's `b_noise_lr` too. ConfigError
    (exit 2) when neither is given nor fitted."""
    import dataclasses
    import math

    sweep = config.sweep
    need_noise = sweep.adaptive_lr == "fit" and not sweep.adaptive_lr_noise
    # An along run (docs/along.md) takes the same rule, eq. 2.7 with the fit's B_noise.
    if sweep.schedule not in ("adaptive", "along") or (sweep.eps_max > 0 and not need_noise):
        return config
    path = SweepPaths(sweep_dir).result("fits")
    if not path.is_file():
        raise ConfigError(f"sweep.schedule={sweep.schedule} needs eps_max (and the B_noise of "
                          f"eq. 2.7), and {path} does not exist: set sweep.eps_max=... and "
                          f"sweep.adaptive_lr_noise=..., or launch and analyse the fixed-batch "
                          f"grid first (gnsweep analyze {sweep_dir})")
    fits = store.read_table(path, columns=["target", "eps_max", "b_noise_lr"]).to_pylist()
    # The hardest target first: its fit speaks for the whole run.
    direction = tasks.about(config.task).direction
    order = direction.in_training_order(fits, key=lambda row: row["target"])[::-1]
    found = [row for row in order
             if all(row[k] is not None and math.isfinite(row[k]) and row[k] > 0
                    for k in ("eps_max", "b_noise_lr"))]
    if not found:
        raise ConfigError(f"{path}: no target has a learning-rate fit (eps_max, b_noise_lr); "
                          "set sweep.eps_max=... and sweep.adaptive_lr_noise=...")
    # The precision of the run id.
    eps_max = sweep.eps_max if sweep.eps_max > 0 else float(f"{found[0]['eps_max']:.4g}")
    lr_noise = float(f"{found[0]['b_noise_lr']:.4g}") if need_noise else sweep.adaptive_lr_noise
    return dataclasses.replace(config, sweep=dataclasses.replace(
        sweep, eps_max=eps_max, adaptive_lr_noise=lr_noise))


def prepare_folder(sweep_dir: Path, config: Config,
                   specs: list[RunSpec] | None = None) -> SweepFolder:
    """Create the sweep folder or check that it matches (ConfigError if runs would train
    differently; StoreError naming a run file of `specs` that disagrees with the sweep), and
    write its config.yaml (the grid: the union of the old and new grids). Returns the folder
    opened with the config it now holds (typed from what was written, not read back)."""
    from omegaconf import OmegaConf

    config = tasks.checked(config)  # the task's options complete, as config.yaml holds them
    if not sweep_dir.is_dir():
        _check_relaunch(sweep_dir, config)  # a new folder: nothing of it exists before this
        sweep_dir.mkdir(parents=True, exist_ok=True)
    # Read, merge and write config.yaml under the folder's lock: two launchers with different
    # grids at once leave the union of both (each reads what the other wrote).
    with store.exclusive(SweepPaths(sweep_dir).lock):
        merged = _check_relaunch(sweep_dir, config)
        # Before anything is written: a run file that disagrees with the sweep (of this grid
        # or another run of the folder) refuses the whole launch (exit 2, nothing run).
        check_records(sweep_dir, config, [s.run_id for s in specs or []])
        store.subdir(sweep_dir, SweepPaths(sweep_dir).runs_dir)
        written = dict(merged)
        if config.task.name == tasks.SCRIPT:
            # gnsweep's own loop's recipe describes nothing a script does (its recipe is the
            # task's optimizer, grad_clip, schedule): not written where it would read as one.
            written.pop("train", None)
        store.write_text(SweepPaths(sweep_dir).config_file,
                         OmegaConf.to_yaml(redact.config(written)))
    return SweepFolder(sweep_dir, tasks.checked(Config.from_dict(merged)))


def prepare(sweep_dir: Path, config: Config) -> list[RunSpec]:
    """The grid's run specs, the folder made ready (`prepare_opened`)."""
    return prepare_opened(sweep_dir, config)[1]


def prepare_opened(sweep_dir: Path, config: Config) -> tuple[SweepFolder, list[RunSpec]]:
    """Create the sweep folder (or check it matches), write every run's config; return the grid.

    An existing sweep folder keeps its runs: relaunching with a larger grid adds runs (the
    folder's config.yaml lists the union), and the runs already finished are never touched. A
    relaunch whose settings would train runs differently is refused (ConfigError).
    """
    config = tasks.checked(config)  # a config built in code enters here: its task checked
    specs = expand_grid(config)
    ids_free(sweep_dir, specs)
    folder = prepare_folder(sweep_dir, config, specs)
    for spec in specs:
        write_run(sweep_dir, config, spec)
    return folder, specs


def remaining(sweep_dir: Path, specs: list[RunSpec], *,
              include_held: bool = True) -> list[RunSpec]:
    """Specs whose run has not finished (done or diverged).

    A run that a live executor holds (see `gnsweep.executors.claims`) is left out unless
    `include_held`; one whose owner died counts as remaining.
    """
    from gnsweep.executors import claims

    out = []
    for spec in specs:
        path = run_dir(sweep_dir, spec.run_id)
        if read_state(path).state in FINISHED:
            continue
        if not include_held:
            claim = claims.read_claim(path)
            if claim is not None and not claims.is_stale(claim):
                continue
        out.append(spec)
    return out


def run_specs(config: Config, sweep_dir: Path, run_ids: list[str], *,
              show_progress: bool = True, wait: bool = True,
              folder: SweepFolder | None = None) -> Any:
    """Hand the runs (records written) that have not finished to the configured executor;
    returns its summary. `launch` runs the grid with it, `gnsweep plan` its chosen runs.
    `folder`: the sweep folder as `prepare_folder` returned it (else its config.yaml is read
    here, once); the executor and its workers get it."""
    import os
    import uuid

    from gnsweep.executors import LAUNCH_ENV
    from gnsweep.executors.registry import executor_for
    from gnsweep.executors.rounds import stop_on_signals
    from gnsweep.progress import SweepProgress

    # Every worker inherits it and records it with each attempt: the summary can then say
    # which runs this launch ran and which another launch on the same folder did. Put back
    # after: what this process starts later is no part of a launch that has ended.
    before = os.environ.get(LAUNCH_ENV)
    os.environ[LAUNCH_ENV] = uuid.uuid4().hex
    # The real values of the secrets masked on disk, for this launch's workers only (those
    # given now, else those kept for this folder when they were given).
    redact.export(config.to_dict(), sweep_dir)
    left = [name for name in redact.masked_settings(
        redact.restore(config.to_dict(), redact.exported())) if name.startswith("task.")]
    if left:
        raise ConfigError(f"{left[0]} holds a credential masked as {redact.MASK} whose real "
                          "value is not kept on this machine for this user: give the setting "
                          "again with its real value (e.g. task.command='...')")
    # Nothing gnsweep writes into may be a link: refused here (exit 2), before a run is
    # claimed, rather than half-way through one.
    store.check_links(sweep_dir)
    folder = folder or SweepFolder.of_config(sweep_dir)
    specs = [folder.read_run(r)[1] for r in run_ids]  # each checked against config.yaml
    # Runs another launcher holds stay in: every executor waits for them (and runs them should
    # their owner die), but none starts them while their owner lives.
    todo = [spec.run_id for spec in remaining(sweep_dir, specs)]
    # Which of them measure the noise scale, decided once per run before any starts (a run
    # already planned keeps its part: relaunches, resumes and requeues measure alike).
    folder.plan_noise(todo)
    fresh_retries(sweep_dir, todo)
    try:
        with SweepProgress(len(specs), len(specs) - len(todo),
                           enabled=show_progress) as progress:
            run = executor_for(config.executor.kind, script=config.task.name == tasks.SCRIPT)
            with stop_on_signals():
                return run(folder, todo, config.executor,
                           max_retries=config.sweep.max_retries, progress=progress, wait=wait)
    finally:
        if wait:  # its workers are done: the launch's notice markers go (gnsweep.notices)
            notices.forget(sweep_dir, os.environ[LAUNCH_ENV])
        if before is None:
            os.environ.pop(LAUNCH_ENV, None)
        else:
            os.environ[LAUNCH_ENV] = before


def launch(config: Config, sweep_dir: Path, *, show_progress: bool = True,
           wait: bool = True) -> Any:
    """Run every run of the sweep that has not finished; returns the executor's summary.

    Safe to call again at any time, also while another launch runs: runs are claimed before they
    start, so none runs twice. `wait=False` (Slurm only) returns once the jobs are submitted.
    """
    folder, specs = prepare_opened(sweep_dir, config)
    return run_specs(config, sweep_dir, [spec.run_id for spec in specs],
                     show_progress=show_progress, wait=wait, folder=folder)


def unmeasured_runs(sweep_dir: Path, run_ids: list[str] | None = None) -> str | None:
    """`runs.unmeasured_line` for the folder's finished runs (or `run_ids` of them): the runs
    whose B_simple is NaN on more than `runs.UNMEASURED_SHARE` of their steps, from their
    status.json; None when there is none."""
    shares = {}
    for run_id in run_ids if run_ids is not None else store.run_ids(sweep_dir):
        status = read_state(run_dir(sweep_dir, run_id))
        if status.state in FINISHED:
            shares[run_id] = status.b_simple_nan_share
    return unmeasured_line(shares)
