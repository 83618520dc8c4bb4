"""Claims, resume and retries with real files and real processes (no mocks)."""

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from gnsweep import paths, store
from gnsweep.compose import compose
from gnsweep.config import ConfigError
from gnsweep.executors import claims, execute_run, open_folder, runnable, take_run
from gnsweep.paths import CLAIM
from gnsweep.store import RunStatus
from gnsweep.sweep import parse_run_record, prepare, remaining
from gnsweep.training import train

SMALL = ["sweep.batch_sizes=[8,32]", "sweep.learning_rates=[0.3]", "sweep.targets=[0.5]",
         "sweep.max_steps=200", "sweep.max_retries=1"]


def _claim_all(sweep_dir: str, run_ids: list[str], out, release) -> None:
    from pathlib import Path

    won = [r for r in run_ids if claims.try_claim(Path(sweep_dir) / "runs" / r)[0] is not None]
    out.put(won)
    release.wait(60)  # stay alive: the claims of a dead process are stale, free to take


@pytest.mark.process
def test_processes_racing_for_the_same_runs_each_win_a_disjoint_set(tmp_path):
    run_ids = [f"r{i:03d}" for i in range(60)]
    (tmp_path / "runs").mkdir()
    ctx = mp.get_context("fork")
    out, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_claim_all, args=(str(tmp_path), run_ids, out, release))
             for _ in range(3)]
    for p in procs:
        p.start()
    won = [out.get(timeout=60) for _ in procs]
    release.set()
    for p in procs:
        p.join()
    assert sorted(r for w in won for r in w) == run_ids  # each run won exactly once


@pytest.mark.process
def test_a_claim_is_stale_once_its_owner_process_is_gone(tmp_path):
    path = tmp_path / "runs" / "r"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        info = {**claims.owner(), "pid": child.pid, "pid_start": claims._pid_start(child.pid)}
        assert not claims.is_stale(info)
    finally:
        child.kill()
        child.wait()
    assert claims.is_stale(info)
    # Same pid number, another process (pid reuse): stale too.
    me = claims.owner()
    assert not claims.is_stale(me)
    assert claims.is_stale({**me, "pid_start": "1"})
    # A dead owner's claim is broken by the next claimer, who learns whose it was.
    path.mkdir(parents=True)
    (path / CLAIM).write_text(json.dumps(info))
    claim, broken = claims.try_claim(path)
    assert claim is not None and broken is not None and broken["pid"] == child.pid


def test_a_claim_from_another_host_is_stale_only_without_heartbeat(tmp_path):
    path = tmp_path / "runs" / "r"
    path.mkdir(parents=True)
    other = {"host": "not-" + socket.gethostname(), "pid": 1, "token": "x"}
    (path / CLAIM).write_text(json.dumps(other))
    assert claims.try_claim(path, stale_after=60)[0] is None  # fresh: held
    old = time.time() - 600
    os.utime(path / CLAIM, (old, old))
    claim, broken = claims.try_claim(path, stale_after=60)
    assert claim is not None and broken["host"] == other["host"]
    # The heartbeat keeps our own claim fresh.
    os.utime(path / CLAIM, (old, old))
    beat = claims.Heartbeat(interval=0.05)
    beat.add(claim)
    time.sleep(0.3)
    beat.close()
    assert claims.read_claim(path)["age_s"] < 60
    claim.release()
    assert claims.read_claim(path) is None


def test_retries_are_counted_per_launch():
    assert runnable(RunStatus.from_json({"state": "pending"}), 0)
    assert not runnable(RunStatus.from_json({"state": "done"}), 5)
    assert not runnable(RunStatus.from_json({"state": "diverged"}), 5)
    # max_retries=1: two attempts in all.
    assert runnable(RunStatus.from_json({"state": "failed", "attempts": 1}), 1)
    assert not runnable(RunStatus.from_json({"state": "failed", "attempts": 2}), 1)
    # A new launch (retry_base = attempts so far) gives a fresh budget.
    assert runnable(RunStatus.from_json({"state": "failed", "attempts": 2, "retry_base": 2}), 1)


@pytest.mark.slow
def test_a_run_whose_worker_died_is_recorded_and_runs_again(tmp_path):
    config = compose(SMALL)
    spec = prepare(tmp_path, config)[0]
    path = paths.run_dir(tmp_path, spec.run_id)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    store.write_status(path, "running", attempts=1, pid=child.pid)
    (path / CLAIM).write_text(json.dumps({"host": socket.gethostname(),
                                                 "pid": child.pid, "token": "t"}))
    assert [s.run_id for s in remaining(tmp_path, [spec], include_held=False)] == [spec.run_id]
    outcome = execute_run(open_folder(tmp_path), spec.run_id, max_retries=1)
    assert outcome.ran and outcome.state == "done"
    events = [json.loads(line)["event"] for line in (path / "attempts.jsonl").open()]
    assert events == ["died", "start", "end"]
    assert store.read_status(path)["attempts"] == 2
    assert not (path / CLAIM).exists()
    # Finished: nobody takes it again.
    assert take_run(tmp_path, spec.run_id, 5) == (None, "done")


@pytest.mark.slow
def test_a_live_claim_keeps_other_executors_off_the_run(tmp_path):
    config = compose(SMALL)
    spec = prepare(tmp_path, config)[0]
    path = paths.run_dir(tmp_path, spec.run_id)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (path / CLAIM).write_text(json.dumps(
            {"host": socket.gethostname(), "pid": holder.pid, "token": "t",
             "pid_start": claims._pid_start(holder.pid)}))
        assert execute_run(open_folder(tmp_path), spec.run_id).state == "held"
        assert remaining(tmp_path, [spec], include_held=False) == []
    finally:
        holder.kill()
        holder.wait()
    assert store.read_status(path)["state"] == "pending"


def test_relaunch_with_other_training_settings_is_refused_but_a_larger_grid_is_not(tmp_path):
    prepare(tmp_path, compose(SMALL))
    with pytest.raises(ConfigError) as err:
        prepare(tmp_path, compose([*SMALL, "task.hidden=32", "sweep.max_steps=50"]))
    assert "task.options.hidden: 64 -> 32" in str(err.value)
    assert "sweep.max_steps: 200 -> 50" in str(err.value)
    assert "relaunch with the folder's settings (see its config.yaml)" in str(err.value)
    # The advice, followed: the folder's settings (a larger grid may come with them).
    specs = prepare(tmp_path, compose([*SMALL, "sweep.batch_sizes=[8,128]", "executor.workers=1"]))
    assert [s.batch_size for s in specs] == [8, 128]
    assert len(store.run_ids(tmp_path)) == 3
    assert "- 32" in (tmp_path / paths.SWEEP_CONFIG).read_text()  # the folder's grid: the union


def test_same_config_and_seed_give_identical_metrics_on_cpu(tmp_path):
    config = compose(SMALL)
    spec = prepare(tmp_path, config)[0]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    cfg, spec = parse_run_record(store.read_json(paths.run_dir(tmp_path, spec.run_id) /
                                                 paths.RUN_CONFIG))
    train(cfg, spec, a)
    train(cfg, spec, b)
    ta, tb = (pq.read_table(p / paths.METRICS).drop(["wall_time"]) for p in (a, b))
    assert ta.num_rows > 10
    # Bit for bit (NaN where both are NaN: columns never measured).
    assert ta.to_pandas().equals(tb.to_pandas())


@pytest.mark.parametrize(("overrides", "expected"), [
    (["noise.method=ddp"], "noise.method=ddp needs DDP"),
    (["executor=torchrun", "noise.method=microbatch"], "noise.method=microbatch with 2 DDP"),
])
def test_a_noise_method_that_cannot_work_with_the_executor_is_refused(tmp_path, overrides,
                                                                       expected):
    from gnsweep.sweep import launch

    with pytest.raises(ConfigError, match=expected):
        launch(compose([*SMALL, *overrides]), tmp_path, show_progress=False)
    assert not tmp_path.joinpath("runs").exists()


@pytest.mark.process
def test_status_lists_runs_by_state_and_marks_dead_owners(tmp_path):
    from typer.testing import CliRunner

    from gnsweep.cli import app

    specs = prepare(tmp_path, compose(SMALL))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = paths.run_dir(tmp_path, specs[0].run_id)
    store.write_status(path, "running", attempts=1, pid=dead.pid, slurm_job_id="77_3")
    (path / CLAIM).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                                 "token": "t", "slurm_job_id": "77_3"}))
    result = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith(specs[0].run_id))
    assert line.split()[1:4] == ["died", "1", "77_3"]
    assert result.output.splitlines()[-1] == "2 runs: 1 pending, 1 died"
    result = CliRunner().invoke(app, ["status", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no such folder" in result.stderr


def test_the_heartbeat_lets_the_claim_of_a_stalled_run_go_stale(tmp_path):
    """A run that makes no progress no longer keeps its claim fresh: another host's launch
    sees a heartbeat older than the bound and takes the run over."""
    path = tmp_path / "runs" / "r"
    claim, _ = claims.try_claim(path)
    assert claim is not None
    old = time.time() - 600
    progress = {"alive": True}
    beat = claims.Heartbeat(interval=0.05)
    beat.add(claim, alive=lambda: progress["alive"])
    os.utime(path / CLAIM, (old, old))
    time.sleep(0.3)
    assert claims.read_claim(path)["age_s"] < 60  # progressing: touched
    progress["alive"] = False
    os.utime(path / CLAIM, (old, old))
    time.sleep(0.3)
    beat.close()
    held = claims.read_claim(path)
    assert held["age_s"] > 500
    # Its owner (this very process) lives, but its heartbeat is older than the bound: the
    # next launch takes the run over.
    assert claims.is_stale(held, stale_after=60)
    taken, broken = claims.try_claim(path, stale_after=60)
    assert taken is not None and broken["token"] == held["token"]
    taken.release()


def test_the_watchdog_fires_once_after_the_bound_and_never_after_stop():
    from gnsweep.executors.watchdog import Watchdog

    fired: list[float] = []
    dog = Watchdog(0.2, fired.append, exit_process=False)
    deadline = time.monotonic() + 30
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(fired) == 1 and fired[0] >= 0.2 and not dog.alive()
    quiet: list[float] = []
    dog = Watchdog(0.2, quiet.append, exit_process=False)
    dog.stop()
    time.sleep(0.5)
    assert quiet == []


def test_a_worker_parses_the_sweep_config_once_for_all_its_runs(tmp_path, monkeypatch):
    import gnsweep.config as config_module
    from gnsweep import runs
    from gnsweep.folder import SweepFolder

    specs = prepare(tmp_path, compose(["sweep=tiny", "sweep.batch_sizes=[8,16,32]",
                                       "sweep.learning_rates=[0.3]", "sweep.max_steps=5",
                                       "executor.workers=1"]))
    runs._TYPED.clear()
    parsed, typed = [], []
    real_read, real_from_dict = store.read_sweep_config, config_module.Config.from_dict.__func__
    monkeypatch.setattr(store, "read_sweep_config", lambda d: parsed.append(d) or real_read(d))
    monkeypatch.setattr(config_module.Config, "from_dict", classmethod(
        lambda cls, data: typed.append(1) or real_from_dict(cls, data)))
    folder = SweepFolder.of_config(tmp_path)  # the worker's start: the folder opened once
    for spec in specs:
        assert execute_run(folder, spec.run_id).state == "done"
    # Three runs, one parse of config.yaml and one validation of each distinct config (the
    # sweep's and the run records' shared one), however many times the runs read them.
    assert len(parsed) == 1
    assert len(typed) <= 2
