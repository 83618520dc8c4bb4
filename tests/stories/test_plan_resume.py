"""`gnsweep plan DIR` killed with -9 and run again gives the runs of a plan never killed: each
round is recorded before its runs are written or start, a resumed plan first finishes what its
recorded rounds left, and a run that had finished is never trained again (real processes, the
fast linreg task, the whole process group killed as a lost node would lose it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app

pytestmark = pytest.mark.xdist_group("linreg_bound")  # one launch of conftest's sweep


@pytest.fixture
def bound_sweep(linreg_bound_sweep) -> Path:
    """B_crit above a grid of 2, 4, 8 (about 23 by linreg's exact dynamics): a bound (the
    session's launch, which each test copies before it changes anything)."""
    return linreg_bound_sweep


def plan_process(sweep: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gnsweep", "plan", str(sweep), "-q",
                             "--workers", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finished(sweep: Path) -> dict[str, int]:
    """Run id -> its attempts, for the runs done or diverged."""
    out = {}
    for run_id in store.run_ids(sweep):
        status = store.read_status(paths.run_dir(sweep, run_id))
        if status.state in store.FINISHED:
            out[run_id] = int(status.attempts or 0)
    return out


def recorded_round(sweep: Path) -> list[str]:
    path = sweep / paths.NEXT_GRIDS
    if not path.is_file():
        return []
    try:
        rounds = json.loads(path.read_text())["rounds"]
    except (ValueError, KeyError):
        return []
    return [run["run_id"] for run in rounds[0]["runs"]] if rounds else []


def kill_when(sweep: Path, ready, limit: float = 120.0) -> dict[str, int]:
    """Start the plan, kill its whole process group with SIGKILL once `ready(sweep)` holds;
    returns the finished runs at that moment."""
    proc = plan_process(sweep)
    deadline = time.monotonic() + limit
    try:
        while not ready(sweep):
            assert proc.poll() is None, f"the plan ended before the kill: {proc.stdout.read()}"
            assert time.monotonic() < deadline, "the plan never reached the kill point"
            time.sleep(0.02)
        done = finished(sweep)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return done


def resume(sweep: Path) -> str:
    result = subprocess.run([sys.executable, "-m", "gnsweep", "plan", str(sweep), "-q",
                             "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
def test_a_plan_killed_at_any_point_resumes_to_the_runs_of_one_never_killed(bound_sweep,
                                                                           tmp_path):
    reference = tmp_path / "never-killed"
    shutil.copytree(bound_sweep, reference)
    out = resume(reference)
    assert "plan stopped after" in out
    expected = set(store.run_ids(reference))
    planned = expected - set(store.run_ids(bound_sweep))
    assert planned and set(recorded_round(reference)) <= planned
    before = finished(bound_sweep)

    # One folder killed twice, then resumed: once the round is recorded (its runs not yet all
    # written: none may be lost), then, resumed, mid-round with two of its runs done (they must
    # not train again).
    sweep = tmp_path / "killed"
    shutil.copytree(bound_sweep, sweep)
    done_at_kill = kill_when(sweep, lambda d: bool(recorded_round(d)))
    assert recorded_round(sweep) == recorded_round(reference)
    done_at_kill.update(kill_when(sweep, lambda d: len(set(finished(d)) - set(before)) >= 2))
    assert len(set(done_at_kill) - set(before)) >= 2
    again = resume(sweep)
    assert "(recorded)" in again, again
    after = finished(sweep)
    assert set(store.run_ids(sweep)) == expected  # none lost, none extra
    assert set(after) == expected  # every run finished
    for run_id, attempts in done_at_kill.items():
        assert after[run_id] == attempts, run_id  # none trained twice
    # The answer of the plan never killed.
    assert json.loads(sweep.joinpath("fits.json").read_text())["recommendation"] == \
        json.loads(reference.joinpath("fits.json").read_text())["recommendation"]


@pytest.mark.slow
def test_a_plan_stops_at_its_budget_and_says_so(bound_sweep, tmp_path):
    """A recorded budget already spent by its recorded round: the plan runs nothing more, and
    its last line names the budget and how to raise it; a bad --budget is one line."""
    sweep = tmp_path / "spent"
    shutil.copytree(bound_sweep, sweep)
    run_id = sorted(store.run_ids(sweep))[0]
    run = json.loads((paths.run_dir(sweep, run_id) / paths.RUN_CONFIG).read_text())["run"]
    (sweep / paths.NEXT_GRIDS).write_text(json.dumps({"budget": 1, "rounds": [{"runs": [
        {"batch_size": run["batch_size"], "learning_rate": run["learning_rate"], "seed": 0,
         "run_id": run_id}]}]}))
    before = set(store.run_ids(sweep))
    result = CliRunner().invoke(app, ["plan", str(sweep), "-q"])
    assert result.exit_code == 0, result.output
    assert "plan stopped after 1 round(s): budget spent" in result.output
    assert "--budget 2" in result.output
    assert set(store.run_ids(sweep)) == before
    assert "budget spent" in json.loads((sweep / paths.NEXT_GRIDS).read_text())["stopped"]
    bad = CliRunner().invoke(app, ["plan", str(sweep), "--budget", "0"])
    assert bad.exit_code == 2 and bad.output.count("error") == 1, bad.output
