"""Faults for real: kill -9 of the launcher and of a worker, Ctrl-C, a task that raises, a
diverged run, a corrupted metrics file. Launches are real `gnsweep launch` processes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from executor_sweeps import terminal_signals
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.config import TaskConfig
from gnsweep.executors import claims
from gnsweep.paths import CLAIM, HISTORY
from gnsweep.sweep import launch

GNSWEEP = str(Path(sys.executable).parent / "gnsweep")
# Four runs of a second or two each (noise measured on every step) that never reach their
# target: kills land mid-run.
SLOW = ["sweep.batch_sizes=[8,16]", "sweep.learning_rates=[0.05,0.1]", "sweep.targets=[0.001]",
        "sweep.max_steps=400", "executor.workers=2"]

pytestmark = pytest.mark.slow


def _start(sweep_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([GNSWEEP, "launch", "-q", "--sweep-dir", str(sweep_dir), *SLOW,
                             *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=terminal_signals)


def _relaunch(sweep_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([GNSWEEP, "launch", "-q", "--sweep-dir", str(sweep_dir), *SLOW],
                          capture_output=True, text=True, timeout=300)


def _states(sweep_dir: Path) -> dict[str, dict]:
    return {r: store.read_status(paths.run_dir(sweep_dir, r)) for r in store.run_ids(sweep_dir)}


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def _events(sweep_dir: Path, run_id: str) -> list[dict]:
    path = paths.run_dir(sweep_dir, run_id) / HISTORY
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _alive(pid: int) -> bool:
    return claims._pid_start(pid) is not None


def assert_complete_once(sweep_dir: Path) -> None:
    """Every run finished exactly once, its attempts never overlapped, its metrics are whole,
    and nothing is left behind: no claims, no temporary files, no live workers."""
    for run_id, status in _states(sweep_dir).items():
        assert status["state"] in store.FINISHED, (run_id, status)
        events = _events(sweep_dir, run_id)
        ends = [e for e in events if e["event"] == "end"]
        assert [e["state"] for e in ends] == [status["state"]], (run_id, events)
        open_attempt = False
        for e in events:  # attempts one after another: start, then end/stopped/died
            if e["event"] == "start":
                assert not open_attempt, (run_id, events)
                open_attempt = True
            elif e["event"] in ("end", "stopped"):
                assert open_attempt, (run_id, events)
                open_attempt = False
            elif e["event"] == "died":
                open_attempt = False
        table = pq.read_table(paths.run_dir(sweep_dir, run_id) / paths.METRICS)
        assert table.num_rows == status["steps"]
    leftovers = [p for p in sweep_dir.rglob("*") if p.name == CLAIM or
                 p.name.endswith(".tmp")]
    assert leftovers == []
    pids = {e["pid"] for r in store.run_ids(sweep_dir) for e in _events(sweep_dir, r)}
    _wait_for(lambda: not any(_alive(p) for p in pids), timeout=30)


def test_kill_9_of_the_launcher_then_relaunch_loses_and_repeats_nothing(tmp_path):
    proc = _start(tmp_path)
    try:
        _wait_for(lambda: any(s["state"] == "running" for s in _states(tmp_path).values())
                  and any(s["state"] == "done" for s in _states(tmp_path).values()))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    done_before = {r for r, s in _states(tmp_path).items() if s["state"] == "done"}
    result = _relaunch(tmp_path)
    assert result.returncode == 0, result.stderr
    assert_complete_once(tmp_path)
    for run_id in done_before:  # finished runs were not touched again
        assert [e["event"] for e in _events(tmp_path, run_id)] == ["start", "end"]


def test_kill_9_of_one_worker_reruns_its_run(tmp_path):
    proc = _start(tmp_path)
    try:
        _wait_for(lambda: any(s["state"] == "running" for s in _states(tmp_path).values()))
        victim, status = next((r, s) for r, s in _states(tmp_path).items()
                              if s["state"] == "running")
        os.kill(status["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert_complete_once(tmp_path)
    events = [e["event"] for e in _events(tmp_path, victim)]
    assert events == ["start", "died", "start", "end"]
    assert _states(tmp_path)[victim]["attempts"] == 2


def test_ctrl_c_stops_cleanly_and_the_relaunch_continues(tmp_path):
    proc = _start(tmp_path)
    try:
        _wait_for(lambda: sum(s["state"] == "running" for s in _states(tmp_path).values()) == 2)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted; relaunch" in err and "Traceback" not in err
    states = _states(tmp_path)
    assert not any(s["state"] == "running" for s in states.values())
    stopped = [r for r in states if any(e["event"] == "stopped" for e in _events(tmp_path, r))]
    assert stopped and all(states[r]["state"] == "pending" for r in stopped)
    assert not any((paths.run_dir(tmp_path, r) / paths.METRICS).exists() for r in stopped)
    assert not list(tmp_path.rglob(CLAIM))
    result = _relaunch(tmp_path)
    assert result.returncode == 0, result.stderr
    assert_complete_once(tmp_path)


def test_a_task_that_raises_is_recorded_and_retried_up_to_max_retries(tmp_path, monkeypatch):
    from gnsweep import tasks

    raising = tasks.TaskEntry(tasks.options.DigitsOptions, "raising_task:make", "raises")
    monkeypatch.setitem(tasks.REGISTRY, "raising", raising)  # forked workers see it
    config = compose(["sweep.batch_sizes=[8,16]", "sweep.learning_rates=[0.1]",
                      "sweep.max_retries=2", "executor.workers=2"])
    config.task = TaskConfig(name="raising")
    summary = launch(config, tmp_path, show_progress=False)
    assert sorted(summary.failed) == store.run_ids(tmp_path)
    for status in _states(tmp_path).values():
        assert status["state"] == "failed"
        assert status["attempts"] == 3  # the first try and max_retries=2 retries
        assert status["error"] == "RuntimeError: boom: this task fails on purpose"
        assert "raising_task.py" in status["traceback"]
    # A relaunch tries them again (a fresh max_retries), not forever.
    launch(config, tmp_path, show_progress=False)
    assert {s["attempts"] for s in _states(tmp_path).values()} == {6}


def test_diverged_runs_are_final_and_a_corrupt_metrics_file_is_named(tmp_path):
    config = compose(["sweep=tiny", "sweep.batch_sizes=[8,32]", "sweep.learning_rates=[0.3,50]",
                      "executor.workers=2"])
    summary = launch(config, tmp_path, show_progress=False)
    diverged = [r for r in store.run_ids(tmp_path) if "lr50" in r]
    assert sorted(summary.diverged) == diverged
    for run_id in diverged:
        status = _states(tmp_path)[run_id]
        assert status["attempts"] == 1 and "loss" in status["reason"]
    launch(config, tmp_path, show_progress=False)  # nothing left to run: not retried
    assert all(len(_events(tmp_path, r)) == 2 for r in store.run_ids(tmp_path))

    runner = CliRunner()
    result = runner.invoke(app, ["analyze", str(tmp_path)])
    assert result.exit_code == 0, result.output
    steps = pq.read_table(tmp_path / "steps.parquet").to_pandas()
    assert not steps[steps["run_id"].isin(diverged)]["reached"].any()  # never reached

    bad = paths.run_dir(tmp_path, store.run_ids(tmp_path)[0]) / paths.METRICS
    bad.write_bytes(bad.read_bytes()[: len(bad.read_bytes()) // 2])
    result = runner.invoke(app, ["analyze", str(tmp_path)])
    assert result.exit_code == 2
    assert str(bad) in result.stderr and "--skip-corrupt" in result.stderr
    result = runner.invoke(app, ["analyze", str(tmp_path), "--skip-corrupt"])
    assert result.exit_code == 0, result.output
    assert f"run {bad.parent.name} recorded done, but its metrics.parquet is unreadable: " \
        "left out" in result.stderr
