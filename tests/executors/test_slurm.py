"""The Slurm executor for real, through submitit, on the single-node Slurm of `make slurm-up`."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from executor_sweeps import assert_all_finished_once, assert_same_fits_up_to_noise, run_sweep
from locations import HELPERS, ROOT
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app
from gnsweep.paths import HISTORY

# One Slurm node and one rendezvous port: its tests run one after another, on one xdist worker.
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("slurm")]
GNSWEEP = str(Path(sys.executable).parent / "gnsweep")
SLURM = ["executor=slurm", "executor.partition=debug", "executor.time_min=10"]


@pytest.fixture(scope="module", autouse=True)
def slurm_up():
    if shutil.which("sinfo") is None and not os.environ.get("CI"):
        pytest.skip("no Slurm here: `make slurm-up` (root, Debian) starts one")
    probe = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%a %T"], capture_output=True,
                           text=True, timeout=30)
    if probe.returncode != 0 or not probe.stdout.strip():
        pytest.fail(f"Slurm is not up ({probe.stderr.strip()}): run `make slurm-up` first")


def _events(sweep_dir: Path, run_id: str) -> list[dict]:
    path = paths.run_dir(sweep_dir, run_id) / HISTORY
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_tiny_sweep_through_slurm_and_torchrun_matches_the_local_one(
        tmp_path, local_executor_sweep):
    local, slurm = local_executor_sweep, tmp_path / "slurm"
    # One job taking the ten runs in turn, torchrun over 2 DDP processes (the other test
    # submits a job array).
    summary = run_sweep(slurm, *SLURM, "executor.nproc_per_node=2", "executor.runs_per_job=10")
    assert len(summary.submitted) == 1
    assert_all_finished_once(slurm)
    jobs = {store.read_status(paths.run_dir(slurm, r))["slurm_job_id"]
            for r in store.run_ids(slurm)}
    assert jobs == set(summary.submitted)
    result = CliRunner().invoke(app, ["status", str(slurm), "--all"])
    assert result.exit_code == 0
    assert all(job in result.output for job in jobs)
    assert_same_fits_up_to_noise(local, slurm)
    metrics = pq.read_table(paths.run_dir(slurm, store.run_ids(slurm)[0]) / paths.METRICS)
    # b00008 over 2 ranks: the DDP hook compares 4 examples with 8.
    assert set(metrics.to_pandas()["b_small"].dropna()) == {4.0}


def test_relaunch_while_jobs_run_and_a_killed_job_lose_and_repeat_nothing(tmp_path):
    # Runs of at least 16 s on any machine (each step's loss waits 20 ms): still running once
    # the second launch has started and the loop below looks (a quick machine finished 800
    # linreg steps in under 2 s, before anyone looked).
    slow = [*SLURM, "task=custom", "task._target_=protocol_tasks.slow", "+task.pause=0.02",
            "sweep.batch_sizes=[8,16]", "sweep.learning_rates=[0.05,0.1]",
            "sweep.targets=[0.001]", "sweep.max_steps=800", "executor.runs_per_job=2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(  # jobs import the task from HELPERS
        [str(ROOT), str(HELPERS)])}
    detach = [GNSWEEP, "launch", "-q", "--detach", "--sweep-dir", str(tmp_path), *slow]
    first = subprocess.run(detach, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stderr
    # A second launch while the first one's jobs are queued or running: more jobs, same runs.
    second = subprocess.run(detach, capture_output=True, text=True, timeout=120, env=env)
    assert second.returncode == 0, second.stderr
    deadline = time.monotonic() + 180
    while True:
        running = [store.read_status(paths.run_dir(tmp_path, r)) for r in store.run_ids(tmp_path)]
        running = [s for s in running if s["state"] == "running"]
        if running:
            break
        assert time.monotonic() < deadline, "no run started"
        time.sleep(0.2)
    # The worker inside a Slurm job is lost: SIGKILL, no chance to clean up (Slurm itself
    # would send SIGTERM first, which stops the run cleanly).
    os.kill(running[0]["pid"], signal.SIGKILL)
    assert any("_" in job for job in json.loads((tmp_path / "slurm" / "jobs.json").read_text())
               .values())  # array tasks: <array job>_<task>
    final = subprocess.run([GNSWEEP, "launch", "-q", "--sweep-dir", str(tmp_path), *slow],
                           capture_output=True, text=True, timeout=600, env=env)
    assert final.returncode == 0, final.stderr
    died = 0
    for run_id in store.run_ids(tmp_path):
        events = _events(tmp_path, run_id)
        assert store.read_status(paths.run_dir(tmp_path, run_id))["state"] == "done"
        assert [e.get("state") for e in events if e["event"] == "end"] == ["done"], events
        died += sum(e["event"] == "died" for e in events)
    assert died >= 1
    assert not list(tmp_path.rglob("claim.json"))
    status = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert "4 runs: 4 done" in status.output


def test_a_training_script_sweeps_through_slurm(tmp_path):
    """task=script under executor=slurm: each job's worker runs the user's command, its printed
    lines are the rows, and the run records the job it ran in."""
    script = HELPERS / "script_sgd.py"
    sweep_dir = tmp_path / "script"
    command = (f"{sys.executable} {script} --bs={{batch_size}} --lr={{learning_rate}} "
               "--seed={seed} --out={run_dir} --steps=200")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [GNSWEEP, "launch", "--sweep-dir", str(sweep_dir), "-q", "task=script",
         f"task.command={command}", r"task.log_pattern=step (?P<step>\d+) \| loss (?P<loss>\S+)",
         "sweep.batch_sizes=[8,32]", "sweep.learning_rates=[0.2]", "sweep.targets=[0.3]",
         *SLURM, "executor.runs_per_job=1"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    for run_id in store.run_ids(sweep_dir):
        path = paths.run_dir(sweep_dir, run_id)
        status = store.read_status(path)
        assert status.state == "done" and status.reason == "target", status
        assert status.slurm_job_id
        printed = [float(line.split("loss ")[1].split(" ")[0])
                   for line in (path / "stdout.log").read_text().splitlines()
                   if line.startswith("step ")]
        rows = pq.read_table(path / paths.METRICS).column("loss").to_pylist()
        assert rows == printed[:len(rows)] and 0 < len(rows) < 200
