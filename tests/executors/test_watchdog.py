"""No run hangs a sweep: a run whose task blocks is stopped by the stall watchdog and retried
like any failure; a launcher stopped by SIGTERM or SIGHUP takes its workers down, so that the
next launch takes their runs over. Real worker processes, a task that really blocks."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from locations import HELPERS

from gnsweep import paths, store
from gnsweep.compose import compose
from gnsweep.config import TaskConfig
from gnsweep.executors import claims
from gnsweep.paths import CLAIM, HISTORY
from gnsweep.sweep import launch

pytestmark = pytest.mark.slow

GNSWEEP = str(Path(sys.executable).parent / "gnsweep")
ONE_RUN = ["sweep=tiny", "sweep.batch_sizes=[8]", "sweep.learning_rates=[0.3]",
           "sweep.max_steps=50", "executor.workers=1"]


def _events(run_path: Path) -> list[dict]:
    return [json.loads(line) for line in (run_path / HISTORY).read_text().splitlines()]


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def test_a_stalled_run_is_stopped_recorded_and_retried(tmp_path, monkeypatch):
    from gnsweep import tasks

    blocking = tasks.TaskEntry(tasks.options.DigitsOptions, "blocking_task:make", "blocks")
    monkeypatch.setitem(tasks.REGISTRY, "blocking", blocking)  # forked workers see it
    monkeypatch.syspath_prepend(str(HELPERS))
    config = compose([*ONE_RUN, "sweep.max_retries=1", "sweep.stall_seconds=1"])
    config.task = TaskConfig(name="blocking")
    summary = launch(config, tmp_path, show_progress=False)
    (run_id,) = store.run_ids(tmp_path)
    assert summary.failed == [run_id]
    path = paths.run_dir(tmp_path, run_id)
    status = store.read_status(path)
    assert status["state"] == "failed" and status["reason"] == "stalled"
    assert status["attempts"] == 2  # the first try and max_retries=1 retry
    assert "no step logged" in status["error"]
    ends = [e for e in _events(path) if e["event"] == "end"]
    assert [(e["state"], e.get("reason")) for e in ends] == [("failed", "stalled")] * 2
    assert not (path / CLAIM).exists()


def test_a_task_that_blocks_as_a_worker_builds_it_ends_the_worker(tmp_path, monkeypatch):
    # executor=torchrun with one process a run: the worker process without torchrun, which
    # builds the task once before its first run (no run, hence no watchdog, yet).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(HELPERS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    config = compose([*ONE_RUN, "sweep.max_retries=0", "sweep.stall_seconds=2",
                      "executor=torchrun", "executor.nproc_per_node=1", "task=custom",
                      "task._target_=blocking_task.make_build_blocks"])
    summary = launch(config, tmp_path, show_progress=False)  # returns: no job hangs
    (run_id,) = store.run_ids(tmp_path)
    assert summary.failed == [run_id]
    logs = "".join(p.read_text() for p in (tmp_path / "queue").glob("*.log"))
    assert "building it in a worker before its first run: no answer after 2 s" in logs
    assert store.read_status(paths.run_dir(tmp_path, run_id))["state"] == "pending"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_launcher_stopped_by_a_signal_takes_its_workers_down(tmp_path, signum):
    sweep = tmp_path / "sweep"
    command = [GNSWEEP, "launch", "-q", "--sweep-dir", str(sweep), *ONE_RUN,
               "sweep.stall_seconds=0", "task=custom",
               "task._target_=blocking_task.make_custom"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HELPERS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("GNSWEEP_LAUNCH", None)  # set by in-process launches of other tests
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        run_path = None

        def running() -> bool:
            nonlocal run_path
            ids = store.run_ids(sweep) if (sweep / paths.RUNS).is_dir() else []
            for run_id in ids:
                path = paths.run_dir(sweep, run_id)
                if store.read_status(path)["state"] == "running":
                    run_path = path
                    return True
            return False

        _wait_for(running)
        assert run_path is not None
        worker = store.read_status(run_path)["pid"]
        time.sleep(1.0)  # the worker is now blocked inside its task's sample()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    assert "relaunch the same command" in err and "Traceback" not in err
    _wait_for(lambda: claims._pid_start(worker) is None, timeout=30)  # the worker is gone
    # The worker did not stop (blocked) and was killed: its run went back to pending all the
    # same, as the launcher says, and `gnsweep status` agrees.
    assert "went back to pending" in err
    assert store.read_status(run_path)["state"] == "pending"
    assert not (run_path / CLAIM).exists()
    # Its claim is free or stale: the next launch takes the run over.
    claim = claims.read_claim(run_path)
    assert claim is None or claims.is_stale(claim)
    taken, _ = claims.try_claim(run_path)
    assert taken is not None
    taken.release()
