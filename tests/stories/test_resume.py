"""Relaunching the same `gnsweep launch` after kill -9 continues the run from its checkpoint: its
final rows equal an uninterrupted run's with the same seed (every logged number but the wall
time), no step missing or twice. Real processes: the launcher and its worker are killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gnsweep import paths, store
from gnsweep.folder import read_run
from gnsweep.paths import CHECKPOINTS
from gnsweep.training import train

pytestmark = pytest.mark.slow
GNSWEEP = str(Path(sys.executable).parent / "gnsweep")
RUN = "b00016_lr0.05_s0"
STEPS = 300


def _command(sweep_dir: Path, *extra: str) -> list[str]:
    return [GNSWEEP, "launch", "task=linreg", "sweep=linreg", "sweep.batch_sizes=[16]",
            "sweep.learning_rates=[0.05]", "sweep.targets=[1e-9]", f"sweep.max_steps={STEPS}",
            "train.checkpoint_every=10", *extra, "--sweep-dir", str(sweep_dir), "--quiet"]


def _wait_for_checkpoint(path: Path, process: subprocess.Popen, timeout: float = 120,
                         step: int | None = None) -> None:
    """Until the run has a checkpoint (`step`: the one at that step)."""
    deadline = time.monotonic() + timeout
    pattern = "*.json" if step is None else f"{step:012d}.json"
    while not list((path / CHECKPOINTS).glob(pattern)):
        assert process.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.02)


def _rows(path: Path) -> dict[str, np.ndarray]:
    table = store.read_table(path / paths.METRICS).to_pandas()
    return {c: table[c].to_numpy() for c in table.columns if c != "wall_time"}


def _uninterrupted(sweep_dir: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    """The same run (its own config.json) trained in one go, in this process."""
    torch.set_num_threads(1)
    config, spec = read_run(sweep_dir, RUN)
    path = tmp_path / "whole" / "runs" / RUN
    path.mkdir(parents=True)
    train(config, spec, path)
    return _rows(path)


def _assert_resumed(sweep_dir: Path, whole: dict[str, np.ndarray]) -> None:
    path = paths.run_dir(sweep_dir, RUN)
    assert store.read_status(path)["state"] == "done"
    history = (path / "attempts.jsonl").read_text()
    assert history.count('"event": "start"') == 2  # killed once, resumed once
    rows = _rows(path)
    assert list(rows["step"]) == list(range(1, STEPS + 1))  # contiguous, none twice
    for name, values in whole.items():
        assert np.array_equal(rows[name], values, equal_nan=True), name


def test_kill_9_of_the_launcher_and_its_worker_then_the_same_command_resumes(tmp_path):
    sweep_dir = tmp_path / "sweep"
    command = _command(sweep_dir, "executor.workers=1")
    launcher = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
    _wait_for_checkpoint(paths.run_dir(sweep_dir, RUN), launcher)
    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and its forked worker, at once
    launcher.wait()
    assert store.read_status(paths.run_dir(sweep_dir, RUN))["state"] == "running"
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    _assert_resumed(sweep_dir, _uninterrupted(sweep_dir, tmp_path))


def _rank_pids(launcher_pid: int) -> list[int]:
    """The worker processes torchrun started under the launcher (its grandchildren)."""
    def children(pid: int) -> list[int]:
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

    return [rank for agent in children(launcher_pid) for rank in children(agent)]


@pytest.mark.distributed
def test_kill_9_of_one_of_two_torchrun_ranks_resumes_from_the_checkpoint(tmp_path):
    reference, sweep_dir = tmp_path / "reference", tmp_path / "sweep"
    ddp = ("executor=torchrun", "executor.nproc_per_node=2", "executor.workers=1")
    done = subprocess.run(_command(reference, *ddp), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    # torchrun restarts its job once (elastic), which takes the run on from its checkpoint.
    launcher = subprocess.Popen(_command(sweep_dir, *ddp, "executor.max_restarts=1"),
                                start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Killed past its second checkpoint, always: the restarted processes' first step (21, a
    # measured one) has DDP's first bucket layout, where the uninterrupted run's has the layout
    # DDP rebuilt after its own first step. Its noise measurement must not depend on that
    # (a kill that landed past the first checkpoint by chance once found that it did).
    _wait_for_checkpoint(paths.run_dir(sweep_dir, RUN), launcher, step=20)
    ranks = _rank_pids(launcher.pid)
    assert len(ranks) == 2, ranks
    os.kill(max(ranks), signal.SIGKILL)  # one rank: torchrun stops the other and restarts both
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err
    _assert_resumed(sweep_dir, _rows(paths.run_dir(reference, RUN)))
    # The job itself recovered (a job that failed would be named here, and started again).
    assert b"torchrun job exited" not in err

