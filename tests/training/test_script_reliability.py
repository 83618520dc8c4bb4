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

from gnsweep import paths, store
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
                  "max_steps": 10**6}})
    run = tmp_path / "sweep" / "runs" / "b00008_lr0.1_s0"
    run.mkdir(parents=True)
    return config, run


def _run(config: Config, run: Path):
    from gnsweep.training.script_runner import run_script

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
    with pytest.raises(ScriptFailed, match=r"stdout line 2: task.log_pattern did not finish "
                                           r"matching this line"):
        _run(config, run)  # and the command, asleep for 30 s, stopped rather than waited for


# ---- the process tree -----------------------------------------------------------------------


HELPER = """
    import os, subprocess, sys, time
    out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")][0]
    code = ("import time, pathlib, signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "time.sleep(2); pathlib.Path(sys.argv[1]).write_text('x')")
    helper = subprocess.Popen([sys.executable, "-c", code, os.path.join(out, "helper-survived")])
    quiet = subprocess.Popen([sys.executable, "-c", code, os.path.join(out, "quiet-survived")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    open(os.path.join(out, "pids"), "w").write(f"{os.getpid()} {helper.pid} {quiet.pid}")
    print("step 1 loss 0.5", flush=True)
"""


@pytest.mark.process
def test_helpers_left_behind_neither_keep_the_run_open_nor_outlive_it(tmp_path):
    """One helper holds the command's stdout, one does not; both ignore SIGTERM."""
    config, run = _config(tmp_path, HELPER, log_pattern=PATTERN)
    result = _run(config, run)
    assert result.state == "done" and result.reason == "script ended"
    _, helper, quiet = map(int, (run / "pids").read_text().split())
    assert _wait_gone(helper, 1) and _wait_gone(quiet, 1)  # SIGTERM ignored: killed
    time.sleep(2.5)
    assert not (run / "helper-survived").exists() and not (run / "quiet-survived").exists()
    assert not (run / paths.SCRIPT_PROCESS).exists()


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
from gnsweep.training.script_runner import run_script
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
        process_tree.record(run / paths.SCRIPT_PROCESS, earlier.pid)
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
    path = tmp_path / paths.SCRIPT_PROCESS
    path.write_text(json.dumps({"pid": os.getpid(), "start": 1}))
    assert not process_tree.end_earlier(path, 0.1)
    path.write_text("{not json")
    assert not process_tree.end_earlier(path, 0.1)


# ---- the log file and the lines ---------------------------------------------------------------


def test_a_log_file_that_is_a_fifo_fails_at_once_in_one_line(tmp_path):
    from gnsweep.training.script_rows import TableLog

    path = tmp_path / "log.csv"
    os.mkfifo(path)
    with pytest.raises(ScriptFailed, match=r"log\.csv: the log file is a FIFO"):
        TableLog(path, "csv", {}, skip_existing=True)
    log = TableLog(tmp_path / "later.csv", "csv", {}, skip_existing=True)
    os.mkfifo(tmp_path / "later.csv")  # made by the command after the run started
    with pytest.raises(ScriptFailed, match="is a FIFO"):
        list(log.rows())


@pytest.mark.process
def test_a_command_whose_log_file_is_a_fifo_fails_at_once(tmp_path):
    config, run = _config(tmp_path, """
        import os, sys, time
        out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")][0]
        os.mkfifo(os.path.join(out, "log.csv"))
        time.sleep(60)
    """, log_file="{run_dir}/log.csv")
    with pytest.raises(ScriptFailed, match="the log file is a FIFO"):
        _run(config, run)


def test_lines_that_cannot_be_read_are_named(tmp_path):
    from gnsweep.training.script_rows import TableLog

    path = tmp_path / "log.csv"
    path.write_text("step,loss\n1,0.5\n2," + "9" * 140_000 + "\n")
    rows = TableLog(path, "csv", {}, skip_existing=False).rows()
    assert next(rows)[1] == {"step": "1", "loss": "0.5"}
    with pytest.raises(ScriptFailed, match=r"log\.csv:3: not a CSV row \(field larger"):
        next(rows)
    deep = tmp_path / "log.jsonl"
    deep.write_text('{"step": 1, "loss": 0.5}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    rows = TableLog(deep, "jsonl", {}, skip_existing=False).rows()
    next(rows)
    with pytest.raises(ScriptFailed, match=r"log\.jsonl:2: a JSON value nested too deep"):
        next(rows)


def test_a_line_over_the_limit_is_named_and_skipped(tmp_path, capsys):
    from gnsweep.training.log_reader import MAX_LINE_BYTES, LineReader

    path = tmp_path / "log.csv"
    path.write_bytes(b"a\n" + b"x" * (MAX_LINE_BYTES + 10) + b"\nb\n" + b"y" * 10)
    reader = LineReader(path, skip_existing=False)
    assert [(n, text) for n, text, _ in reader.lines()] == [(1, "a"), (3, "b")]
    assert f"{path}:2: a line over {MAX_LINE_BYTES} bytes, skipped" in capsys.readouterr().err
    with path.open("ab") as handle:
        handle.write(b"y\nc\n")
    assert [(n, text) for n, text, _ in reader.lines()] == [(4, "y" * 11), (5, "c")]
    again = LineReader(path, skip_existing=True)  # a later attempt: from the end, counted
    with path.open("ab") as handle:
        handle.write(b"d\n")
    assert [(n, text) for n, text, _ in again.lines()] == [(6, "d")]


@pytest.mark.process
def test_a_long_unterminated_tail_is_read_in_bounded_memory(tmp_path):
    """A log whose rows end in a 256 MiB sparse tail without a newline (a preallocated file;
    the same holds for 1 GB, slower to read): the rows are read and the tail is named and
    skipped, in a process whose peak memory stays far below the tail's size."""
    path = tmp_path / "log.csv"
    path.write_text("step,loss\n" + "".join(f"{s},{1 / s}\n" for s in range(1, 21)))
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size + (1 << 28))
    code = textwrap.dedent(f"""
        import resource, sys
        from pathlib import Path
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        from gnsweep.training.log_reader import LineReader
        lines = list(LineReader(Path({str(path)!r}), skip_existing=False).lines())
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(len(lines), grown)
    """)
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    lines, grown_kib = map(int, done.stdout.split())
    assert lines == 21
    assert grown_kib < 64 * 1024  # KiB: under 64 MiB for a 256 MiB tail
    assert f"{path}:22: a line over" in done.stderr


def test_a_step_beyond_range_is_a_named_error_of_its_line(tmp_path):
    config, run = _config(tmp_path, "")
    from gnsweep.training.script_rows import RowLog

    rows = RowLog(config, RunSpec(8, 0.1), run, store.clear_metrics(run, 0),
                  ScriptOptions(**config.task.options))
    rows.add("log.csv:2", {"step": "1", "loss": "0.5"})
    for step in ("1e30", "1e400"):
        with pytest.raises(ScriptFailed, match=r"log\.csv:3: step .* (beyond range|not a whole)"):
            rows.add("log.csv:3", {"step": step, "loss": "0.4"})


@pytest.mark.process
def test_a_relaunch_after_the_script_is_fixed_runs_it(tmp_path):
    """An attempt that printed a step beyond range fails naming the line; the fixed script's
    attempt is not failed again by the old line in the run's stdout.log."""
    config, run = _config(tmp_path, """
        print("step 1 loss 0.5", flush=True)
        print("step 1e30 loss 0.4", flush=True)
    """, log_pattern=r"step (?P<step>\S+) loss (?P<loss>\S+)")
    with pytest.raises(ScriptFailed, match=r"stdout line 2: step 1e30 is beyond range"):
        _run(config, run)
    (tmp_path / "train.py").write_text("".join(f"print('step {s} loss {1 / s}')\n"
                                               for s in range(1, 6)))
    result = _run(config, run)
    assert result.state == "done" and result.rows == 5
    table = store.read_metrics(run)
    assert table is not None and table.column("step").to_pylist() == [1, 2, 3, 4, 5]


def test_rows_are_kept_packed_and_written_in_bounded_batches(tmp_path, monkeypatch):
    """A run's rows take 8 bytes a value in the worker, and a metrics column the script never
    fills takes none (about 50 bytes a row, where a Python list a column took about 480),
    measured by tracemalloc over 20,000 rows; they reach the disk in parts as they come, and
    the parts are compacted table to table."""
    import tracemalloc

    from gnsweep.training import script_rows as script
    from gnsweep.training.script_rows import RowLog

    monkeypatch.setattr(script, "FLUSH_S", 0.0)
    config, run = _config(tmp_path, "")
    rows = RowLog(config, RunSpec(8, 0.1), run, store.clear_metrics(run, 0),
                  ScriptOptions(**config.task.options))
    n = 20_000
    for step in range(1, 1001):  # warm: the first parts and a compaction
        rows.add("x", {"step": step, "loss": 2.0})
    rows.flush(force=True)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for step in range(1001, n + 1):
        rows.add("x", {"step": step, "loss": 2.0 + 1 / step})
        if step % 500 == 0:
            rows.flush()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown / (n - 1000) < 100  # bytes a row
    rows.flush(force=True)
    assert len(store.metric_parts(run)) < script.COMPACT_PARTS
    table = store.read_metrics(run)
    assert table is not None and table.column("step").to_pylist() == list(range(1, n + 1))


# ---- fuzzing: any bytes a script prints or writes --------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PIECES = st.sampled_from(["step", "loss", ",", "\n", "\r\n", "1", "-1", "0", "1e30", "1e400",
                           "nan", "inf", "-inf", '"', "{", "}", "[", "]", ":", " ", "\x00",
                           "\xff", "é", "9" * 40, "step,loss\n", '{"step": 1, "loss": 2}\n',
                           "2,0.5\n", "true", "null"])
_TEXT = st.lists(st.one_of(_PIECES, st.text(max_size=8)), max_size=40).map("".join)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(content=_TEXT, fmt=st.sampled_from(["csv", "jsonl"]))
def test_no_content_of_a_log_file_fails_other_than_in_one_named_line(tmp_path_factory, content,
                                                                      fmt):
    """A log file's bytes, whatever they are: rows, or one ScriptFailed naming the file."""
    from gnsweep.training.script_rows import RowLog, TableLog

    folder = tmp_path_factory.mktemp("fuzz")
    config, run = _config(folder, "")
    path = folder / f"log.{fmt}"
    path.write_bytes(content.encode("utf-8", "surrogatepass"))
    rows = RowLog(config, RunSpec(8, 0.1), run, store.clear_metrics(run, 0),
                  ScriptOptions(**config.task.options))
    try:
        for where, raw, _ in TableLog(path, fmt, {}, skip_existing=False).rows():
            rows.add(where, raw)
        rows.flush(force=True)
    except ScriptFailed as err:
        assert "\n" not in str(err) and str(path) in str(err)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(_TEXT, max_size=10))
def test_no_printed_line_fails_other_than_in_one_named_line(tmp_path_factory, lines):
    """Printed lines, whatever they hold, matched by a loose pattern: rows, or one
    ScriptFailed naming the line."""
    from gnsweep.tasks.script import match_row, pattern_columns
    from gnsweep.training.script_rows import RowLog

    config, run = _config(tmp_path_factory.mktemp("fuzz"), "")
    rows = RowLog(config, RunSpec(8, 0.1), run, store.clear_metrics(run, 0),
                  ScriptOptions(**config.task.options))
    pattern = pattern_columns(r"(?P<step>\S+)\s*[,:]?\s*(?P<loss>\S+)")
    try:
        for number, line in enumerate(lines, 1):
            found = match_row(pattern, line, f"stdout line {number}")
            if found is not None:
                rows.add(f"stdout line {number}", found)
        rows.flush(force=True)
    except ScriptFailed as err:
        assert "\n" not in str(err) and str(err).startswith("stdout line ")


def test_printed_lines_end_at_any_newline_and_a_long_one_is_cut():
    """A progress bar's carriage returns end lines (as Python's text mode reads them); a line
    over the limit is handed on cut, the rest of it dropped, without holding it whole."""
    import io

    from gnsweep.training.log_reader import MAX_LINE_BYTES, read_lines

    printed = b"step 1 loss 2\r\n 10%|#\r 20%|##\rstep 2 loss 1\n"
    assert list(read_lines(io.BytesIO(printed))) == [
        ("step 1 loss 2", False), (" 10%|#", False), (" 20%|##", False),
        ("step 2 loss 1", False)]
    long = b"x" * (3 * MAX_LINE_BYTES) + b"\nstep 3 loss 0.5"
    assert [(len(text), cut) for text, cut in read_lines(io.BytesIO(long))] == \
        [(MAX_LINE_BYTES, True), (len("step 3 loss 0.5"), False)]
