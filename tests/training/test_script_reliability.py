"""A script run's command, its output and its log file can never hang or outlive the sweep
(docs/scripts.md): a pattern that backtracks, a command that ignores SIGTERM or leaves a
helper behind, a FIFO for a log file, an endless line, numbers beyond range.

The commands are real processes (small Python scripts written to the test's folder), run by
`run_script` as a worker runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from locations import ROOT

from gnsweep import store
from gnsweep.config import Config, ConfigError
from gnsweep.errors import ScriptFailed
from gnsweep.runs import RunSpec
from gnsweep.tasks.script import ScriptOptions
from gnsweep.training import process_tree

PY = sys.executable
PATTERN = r"step (?P<step>\d+) loss (?P<loss>\S+)"


def _config(tmp_path: Path, script: str, **task) -> tuple[Config, Path]:
    (tmp_path / "train.py").write_text(textwrap.dedent(script))
    config = Config.from_dict({
        "task": {"name": "script", "command": f"{PY} train.py --out={{run_dir}}",
                 "cwd": str(tmp_path), "stop_seconds": 0.5, **task},
        "sweep": {"batch_sizes": [8], "learning_rates": [0.1], "targets": [0.001],
                  "max_steps": 1000}})
    run = tmp_path / "sweep" / "runs" / "b00008_lr0.1_s0"
    run.mkdir(parents=True)
    return config, run


def _run(config: Config, run: Path):
    from gnsweep.training.script import run_script

    return run_script(config, RunSpec(8, 0.1), run)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _wait_gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


# ---- settings refused at launch ------------------------------------------------------------


@pytest.mark.parametrize(("options", "named"), [
    ({"log_pattern": r"step (?P<step>\d{4294967296}) loss (?P<loss>\S+)"}, "task.log_pattern"),
    ({"log_pattern": r"step (?P<step>\d{1,200000}) loss (?P<loss>\S+)"}, "repetition count"),
    ({"command": "python t.py --seed={seed:>1000000000}"}, "{seed:>1000000000}"),
    ({"command": "python t.py --lr={learning_rate:.100000f}"}, "format spec"),
    ({"log_file": "{run_dir}/{run_id:<999999}.csv"}, "task.log_file"),
])
def test_settings_that_cannot_work_are_refused_in_one_line(options, named):
    with pytest.raises(ConfigError, match=None) as raised:
        ScriptOptions(**{"command": "python t.py", **options})
    message = str(raised.value)
    assert named in message and "\n" not in message and len(message) < 400


def test_a_modest_format_spec_and_repetition_still_work():
    from gnsweep.tasks.script import command_args, example_values, pattern_columns

    assert command_args("t --seed={seed:>04}", "task.command", example_values())[1] == \
        "--seed=0000"
    assert pattern_columns(r"step (?P<step>\d{1,12}) loss (?P<loss>\S+)").search(
        "step 12 loss 0.5")


# ---- a pattern that backtracks --------------------------------------------------------------


@pytest.mark.process
def test_a_pattern_that_backtracks_fails_the_run_naming_the_line(tmp_path):
    """`(a|aa)+$` against a line of 40 a's and a '!' takes about 2**28 steps with Python's
    re (minutes, holding the GIL, so no watchdog runs): the match is time-boxed instead."""
    config, run = _config(tmp_path, """
        print("step 1 loss 0.5", flush=True)
        print("step 2 loss 0.4 " + "a" * 40 + "!", flush=True)
        import time; time.sleep(30)
    """, log_pattern=r"step (?P<step>\d+) loss (?P<loss>[\d.]+)(?: (a|aa)+$)?")
    started = time.monotonic()
    with pytest.raises(ScriptFailed, match=r"stdout line 2: task.log_pattern did not finish "
                                           r"matching this line"):
        _run(config, run)
    assert time.monotonic() - started < 25  # the command was stopped, not waited for


# ---- the process tree -----------------------------------------------------------------------


HELPER = """
    import os, subprocess, sys, time
    out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")][0]
    helper = subprocess.Popen([sys.executable, "-c",
        "import time, pathlib, sys; time.sleep(2); pathlib.Path(sys.argv[1]).write_text('x')",
        os.path.join(out, "helper-survived")])
    open(os.path.join(out, "pids"), "w").write(f"{os.getpid()} {helper.pid}")
    print("step 1 loss 0.5", flush=True)
"""


@pytest.mark.process
def test_a_helper_holding_stdout_neither_keeps_the_run_open_nor_outlives_it(tmp_path):
    config, run = _config(tmp_path, HELPER, log_pattern=PATTERN)
    result = _run(config, run)
    assert result.state == "done" and result.reason == "script ended"
    helper = int((run / "pids").read_text().split()[1])
    assert _wait_gone(helper, 1)
    time.sleep(2.5)
    assert not (run / "helper-survived").exists()
    assert not (run / store.SCRIPT_PROCESS).exists()


STUBBORN = """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")][0]
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(os.path.join(out, "pids"), "a").write(f"{os.getpid()} {helper.pid}\\n")
    for step in range(1, 100000):
        try:
            print(f"step {step} loss {1 / step}", flush=True)
        except OSError:  # its reader is gone; it trains on
            pass
        time.sleep(0.05)
"""
WORKER = """
import sys
from pathlib import Path
from gnsweep.config import Config
from gnsweep.runs import RunSpec
from gnsweep.training.script import run_script
run_script(Config.from_dict(__import__("json").loads(sys.argv[1])), RunSpec(8, 0.1),
           Path(sys.argv[2]))
"""


def _worker(config: Config, run: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([PY, "-c", WORKER, json.dumps(config.to_dict()), str(run)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _pids(run: Path, worker: subprocess.Popen, lines: int = 1) -> list[list[int]]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (run / "pids").exists() and \
                len(found := (run / "pids").read_text().splitlines()) >= lines:
            return [[int(p) for p in line.split()] for line in found]
        assert worker.poll() is None
        time.sleep(0.05)
    raise AssertionError("the command did not start")


@pytest.mark.process
def test_a_worker_killed_with_9_takes_a_stubborn_script_and_its_children_with_it(tmp_path):
    """The script ignores SIGTERM and starts a child: both end within the grace once the
    worker is killed with -9."""
    config, run = _config(tmp_path, STUBBORN, log_pattern=PATTERN)
    worker = _worker(config, run)
    ((script, helper),) = _pids(run, worker)
    worker.kill()
    worker.wait()
    assert _wait_gone(script) and _wait_gone(helper)


@pytest.mark.process
def test_a_relaunch_ends_an_earlier_attempt_still_running_before_it_starts(tmp_path):
    """An earlier attempt's command left running with no one to end it (its worker and guard
    killed with -9; here started by hand in a session of its own, ignoring SIGTERM, with a
    child): the next attempt of the run finds the recorded group and ends it first."""
    config, run = _config(tmp_path, STUBBORN, log_pattern=PATTERN)
    earlier = subprocess.Popen([PY, "train.py", f"--out={run}"], cwd=tmp_path,
                               start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        ((_, helper),) = _pids(run, earlier)
        process_tree.record(run / store.SCRIPT_PROCESS, earlier.pid)
        (tmp_path / "train.py").write_text("print('step 1 loss 0.5')\n")  # the fixed script
        result = _run(config, run)
        assert result.state == "done" and result.rows == 1
        assert earlier.poll() is not None and _wait_gone(helper, 1)
    finally:
        for pid in (earlier.pid, helper):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        earlier.wait()


def test_a_record_of_another_process_is_left_alone(tmp_path):
    """A recorded pid that is another process now (its start time differs): nothing ended."""
    path = tmp_path / store.SCRIPT_PROCESS
    path.write_text(json.dumps({"pid": os.getpid(), "start": 1}))
    assert not process_tree.end_earlier(path, 0.1)
    path.write_text("{not json")
    assert not process_tree.end_earlier(path, 0.1)
