"""The torchrun executor for real: 2 DDP processes (gloo on CPU), runs taken in turn."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from executor_sweeps import (
    assert_all_finished_once,
    assert_same_fits_up_to_noise,
    run_sweep,
    terminal_signals,
)
from locations import HELPERS, ROOT

from gnsweep import paths, store
from gnsweep.config import ConfigError
from gnsweep.paths import HISTORY

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
GNSWEEP = str(Path(sys.executable).parent / "gnsweep")


def test_a_tiny_sweep_through_torchrun_matches_the_local_one(tmp_path, local_executor_sweep):
    local, ddp = local_executor_sweep, tmp_path / "ddp"
    summary = run_sweep(ddp, "executor=torchrun", "executor.nproc_per_node=2")
    assert len(summary.done) + len(summary.diverged) == len(store.run_ids(ddp))
    assert_all_finished_once(ddp)
    pids = set()
    for run_id in store.run_ids(ddp):
        path = paths.run_dir(ddp, run_id)
        metrics = pq.read_table(path / paths.METRICS).to_pandas()
        batch = int(run_id[1:6])
        # The DDP hook: a worker's gradient over B/2 examples against the all-reduced one.
        assert set(metrics["b_small"].dropna()) == {batch / 2}
        assert set(metrics["b_big"].dropna()) == {batch}
        pids |= {json.loads(line)["pid"] for line in (path / HISTORY).open()}
    assert len(pids) == 1  # one torchrun job (its rank 0) trained every run in turn
    assert_same_fits_up_to_noise(local, ddp)


def test_torchrun_leaves_no_scratch_files_outside_the_sweep_folder(tmp_path, monkeypatch):
    from gnsweep.compose import compose
    from gnsweep.sweep import launch

    scratch, sweep = tmp_path / "tmp", tmp_path / "sweep"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # where torchrun's agent would write
    summary = launch(compose(["sweep=tiny", "sweep.batch_sizes=[8]", "sweep.learning_rates=[0.3]",
                              "sweep.max_steps=5", "executor=torchrun",
                              "executor.nproc_per_node=2"]), sweep, show_progress=False)
    assert len(summary.done) == 1
    assert list(scratch.iterdir()) == []  # no torchelastic_*/.../attempt_0/{0,1}
    assert list((sweep / "queue").iterdir()) == []  # its own scratch folder removed too


def test_batch_sizes_that_do_not_split_over_the_workers_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="multiples of 2"):
        run_sweep(tmp_path, "executor=torchrun", "sweep.batch_sizes=[8,33]")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def test_kill_9_of_one_ddp_worker_reruns_its_run(tmp_path):
    proc = subprocess.Popen(
        [GNSWEEP, "launch", "-q", "--sweep-dir", str(tmp_path), "executor=torchrun",
         "sweep.batch_sizes=[8]", "sweep.learning_rates=[0.1]", "sweep.targets=[0.001]",
         "sweep.max_steps=400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=terminal_signals)
    try:
        deadline = time.monotonic() + 120
        while True:
            running = [s for s in (store.read_status(paths.run_dir(tmp_path, r))
                                   for r in store.run_ids(tmp_path)) if s["state"] == "running"]
            if running:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        rank0 = running[0]["pid"]
        agent = int(Path(f"/proc/{rank0}/stat").read_text().split(")")[1].split()[1])
        rank1 = next(p for p in _children(agent) if p != rank0)
        os.kill(rank1, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    for run_id in store.run_ids(tmp_path):
        path = paths.run_dir(tmp_path, run_id)
        assert store.read_status(path)["state"] == "done"
        events = [json.loads(line) for line in (path / HISTORY).open()]
        assert [e.get("state") for e in events if e["event"] == "end"][-1] == "done"
        assert sum(e.get("state") == "done" for e in events) == 1
        pq.read_table(path / paths.METRICS)
    assert not list(tmp_path.rglob("claim.json"))


def test_ctrl_c_stops_the_ddp_runs_cleanly(tmp_path):
    proc = subprocess.Popen(
        [GNSWEEP, "launch", "-q", "--sweep-dir", str(tmp_path), "executor=torchrun",
         "sweep.batch_sizes=[8]", "sweep.learning_rates=[0.1]", "sweep.targets=[0.001]",
         "sweep.max_steps=5000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=terminal_signals)
    try:
        deadline = time.monotonic() + 120
        while not any(store.read_status(paths.run_dir(tmp_path, r))["state"] == "running"
                      for r in store.run_ids(tmp_path)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches the launcher
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1].endswith("interrupted; relaunch the same command to "
                                                 "continue")
    for run_id in store.run_ids(tmp_path):
        path = paths.run_dir(tmp_path, run_id)
        assert store.read_status(path)["state"] == "pending"
        assert not (path / paths.METRICS).exists()
    assert not list(tmp_path.rglob("claim.json"))
    workers = subprocess.run(["pgrep", "-f", f"gnsweep.executors.worker {tmp_path}"],
                             capture_output=True, text=True).stdout
    assert workers == ""


def test_a_users_task_from_the_working_directory_trains_under_torchrun(tmp_path):
    """The module sits in the launch folder only (not on PYTHONPATH): the torchrun workers find
    it too, and its dict batches go through DDP and the Hessian."""
    (tmp_path / "cwd_ddp_task.py").write_text(
        (HELPERS / "protocol_tasks.py").read_text())
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "gnsweep", "launch", "task=custom",
         "task._target_=cwd_ddp_task.make", "+task.per_sample=2", "executor=torchrun",
         "executor.nproc_per_node=2", "sweep.batch_sizes=[16]", "sweep.learning_rates=[0.05]",
         "sweep.targets=[1e-9]", "sweep.max_steps=12", "noise.hessian_every=4", "--workers", "1",
         "-q",
         "--sweep-dir", "s"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr
    metrics = pq.read_table(tmp_path / "s" / "runs" / "b00016_lr0.05_s0" / paths.METRICS
                            ).to_pandas()
    # 16 samples of 2 examples a step, split over 2 workers (the DDP hook's b_small).
    assert metrics["examples"].tolist() == [32 * s for s in range(1, 13)]
    assert set(metrics["b_small"].dropna()) == {16} and set(metrics["b_big"].dropna()) == {32}
    assert metrics["b_noise"].notna().any()


def test_a_dataset_over_two_ranks_draws_each_index_once_an_epoch(tmp_path):
    """A 1,000-item Dataset over 2 DDP processes, 32 items a rank a step for 32 steps: in each
    of the first two epochs the ranks' indices are disjoint and together every index once."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS)]),
           "OMP_NUM_THREADS": "1", "GNSWEEP_TEST_RECORD": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "gnsweep", "launch", "task=custom",
         "task._target_=protocol_tasks.recording_table", "executor=torchrun",
         "executor.nproc_per_node=2", "sweep.batch_sizes=[64]", "sweep.learning_rates=[0.05]",
         "sweep.targets=[1e-9]", "sweep.max_steps=32", "--workers", "1", "-q",
         "--sweep-dir", str(tmp_path / "s")], env=env, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr
    drawn = []
    for rank in range(2):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert len(lines) == 32  # one batch a step
        drawn.append([int(i) for line in lines for i in line.split()])
    for epoch in range(2):
        zero, one = (d[epoch * 500:(epoch + 1) * 500] for d in drawn)
        assert len(set(zero)) == len(set(one)) == 500 and not set(zero) & set(one)
        assert sorted(zero + one) == list(range(1000))
    metrics = pq.read_table(tmp_path / "s" / "runs" / "b00064_lr0.05_s0" / paths.METRICS
                            ).to_pandas()
    assert metrics["epoch"].iloc[-1] == pytest.approx(32 * 32 / 500)
