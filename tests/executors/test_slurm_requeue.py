"""A run longer than its Slurm job's time limit finishes: warned ahead of the limit (SIGUSR2) it
checkpoints, the job is requeued, and the requeued job continues the run. On the real Slurm of
`make slurm-up`, with the shortest limit Slurm has (one minute)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from locations import HELPERS, ROOT
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app

# One Slurm node and one rendezvous port: its tests run one after another, on one xdist worker.
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("slurm")]
GNSWEEP = str(Path(sys.executable).parent / "gnsweep")
STEPS, LOG_EVERY, PAUSE = 4_000, 20, 0.01
"""40 s of training at least (each step's loss waits PAUSE seconds), on any machine: more than
a one-minute job trains (about 30 s, between its start-up and its warning a quarter of the limit
ahead), so the job is requeued at least once (a requeued job waits cred_expire + 1 = 21 s in
`make slurm-up`'s Slurm before it starts again)."""


@pytest.fixture(scope="module", autouse=True)
def slurm_up():
    if shutil.which("sinfo") is None and not os.environ.get("CI"):
        pytest.skip("no Slurm here: `make slurm-up` (root, Debian) starts one")
    probe = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%a %T"], capture_output=True,
                           text=True, timeout=30)
    if probe.returncode != 0 or not probe.stdout.strip():
        pytest.fail(f"Slurm is not up ({probe.stderr.strip()}): run `make slurm-up` first")


def test_a_run_longer_than_the_time_limit_is_requeued_and_ends_done(tmp_path):
    launch = [GNSWEEP, "launch", "-q", "--sweep-dir", str(tmp_path), "task=custom",
              "task._target_=protocol_tasks.slow", f"+task.pause={PAUSE}",
              "sweep.batch_sizes=[16]", "sweep.learning_rates=[0.05]",
              "sweep.targets=[1e-9]", f"sweep.max_steps={STEPS}", f"sweep.log_every={LOG_EVERY}",
              "executor=slurm", "executor.partition=debug", "executor.time_min=1",
              "executor.nproc_per_node=1", "executor.workers=1"]
    # The job imports the task from tests/helpers/ (on PYTHONPATH, as a user's module would be).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(HELPERS)])}
    done = subprocess.run(launch, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr
    (run_id,) = store.run_ids(tmp_path)
    path = paths.run_dir(tmp_path, run_id)
    status = store.read_status(path)
    assert status["state"] == "done" and status["steps"] == STEPS
    events = [json.loads(line) for line in (path / "attempts.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) >= 2 and len({e["slurm_job_id"] for e in starts}) == 1  # one job, requeued
    assert [e["event"] for e in events].count("stopped") == len(starts) - 1
    steps = store.read_table(path / paths.METRICS).column("step").to_pylist()
    assert steps == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))  # contiguous, none twice
    shown = CliRunner().invoke(app, ["status", str(tmp_path), "--all"])
    assert shown.exit_code == 0
    assert f"requeued {len(starts) - 1}x" in shown.output
    assert f"Slurm requeued runs {len(starts) - 1} times" in shown.output
