"""A trained sweep folder with one file turned against its reader, third round: a FIFO where a
run's status, metrics, attempt log or record belongs; a run folder without a readable record;
analyze before any run has finished, and while runs train; steps rewritten; metrics columns of
another type; a relaunch whose grid point shares a run id; folders of a sweep given to compare
and plan; a NaN task option; a KeyboardInterrupt raised inside a task. Every case ends in one
line (exit 2) or names the run it leaves out; none hangs, none prints a traceback."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from locations import HELPERS
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app

# One worker takes the module whole: the module's trained sweep is then trained once, not
# once by each worker that comes to one of its tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("folder_integrity_sweeps")]

RUN = "b00008_lr0.3_s0"
GRID = ["sweep=tiny", "sweep.batch_sizes=[8,16]", "sweep.learning_rates=[0.3]",
        "sweep.max_steps=20", "sweep.targets=[0.9,0.8]", "executor.workers=1"]


def _cli(*args: str):
    """The command in a thread (CliRunner), failing the test if it is still running after two
    minutes: a reader waiting on a FIFO would never return."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=CliRunner().invoke(app, list(args))),
                              daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), f"gnsweep {' '.join(args)} blocked"
    return out["r"]


def _clean(result, code: int = 0) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    assert result.exit_code == code and "Traceback" not in result.output, result.output


def _one_line(result) -> str:
    _clean(result, 2)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Two runs of the tiny task, trained once for the module, then analysed."""
    sweep = tmp_path_factory.mktemp("integrity") / "sweep"
    _clean(_cli("launch", "-q", "--sweep-dir", str(sweep), *GRID))
    _clean(_cli("analyze", str(sweep), "--targets", "0.9,0.8"))
    return sweep


@pytest.fixture
def sweep(trained, tmp_path) -> Path:
    copy = tmp_path / "sweep"
    shutil.copytree(trained, copy)
    return copy


LAUNCH = ("launch", "-q", *GRID)


@pytest.mark.parametrize("name", [paths.STATUS, paths.METRICS, paths.HISTORY, paths.RUN_CONFIG])
@pytest.mark.parametrize("command", ["status", "analyze", "launch"])
def test_a_fifo_in_a_run_folder_is_named_never_waited_on(sweep, name, command):
    path = sweep / paths.RUNS / RUN / name
    path.unlink()
    os.mkfifo(path)
    if name == paths.RUN_CONFIG and command != "launch":
        # Not a run record: the run folder is named, not read (below).
        return
    if name == paths.HISTORY and command == "analyze":
        return  # analyze never reads the attempt log
    if command == "launch":
        result = _cli(*LAUNCH, "sweep.batch_sizes=[8,16,32]", "--sweep-dir", str(sweep))
    else:
        result = _cli(command, str(sweep))
    line = _one_line(result)
    assert str(path) in line and "named pipe (FIFO)" in line


@pytest.mark.parametrize("command", ["status", "analyze", "report"])
def test_a_fifo_in_place_of_the_sweeps_config_is_named(sweep, command):
    (sweep / paths.SWEEP_CONFIG).unlink()
    os.mkfifo(sweep / paths.SWEEP_CONFIG)
    line = _one_line(_cli(command, str(sweep)))
    assert f"{sweep / paths.SWEEP_CONFIG}: a named pipe (FIFO)" in line


@pytest.mark.parametrize("make", ["missing", "folder", "fifo"])
def test_a_run_folder_without_a_readable_record_is_named_by_status_and_analyze(sweep, make):
    record = sweep / paths.RUNS / RUN / paths.RUN_CONFIG
    record.unlink()
    if make == "folder":
        record.mkdir()
    elif make == "fifo":
        os.mkfifo(record)
    status = _cli("status", str(sweep))
    _clean(status)
    row = next(x for x in status.stdout.splitlines() if x.startswith(RUN))
    assert "unreadable" in row and paths.RUN_CONFIG in row
    assert "2 runs: 1 done, 1 unreadable" in status.stdout
    analysis = _cli("analyze", str(sweep), "--targets", "0.9")
    _clean(analysis)
    assert f"run folder runs/{RUN}: " in analysis.stderr and "left out" in analysis.stderr


def test_analyze_before_any_run_has_finished_says_so_in_one_line(sweep):
    for run in (sweep / paths.RUNS).iterdir():
        (run / paths.STATUS).unlink()
        (run / paths.METRICS).unlink()
    line = _one_line(_cli("analyze", str(sweep)))
    assert "no run has logged a row to analyse yet (2 pending)" in line


def test_a_live_analysis_while_the_first_runs_train_uses_their_rows_and_says_so(sweep):
    for run in (sweep / paths.RUNS).iterdir():
        (run / paths.STATUS).write_text(json.dumps({"state": "running", "attempts": 1}))
        (run / paths.METRIC_PARTS).mkdir()
        (run / paths.METRICS).rename(run / paths.METRIC_PARTS / "000000000001-000000000020.parquet")
    result = _cli("analyze", str(sweep), "--targets", "0.9")
    _clean(result)
    assert "2 runs still running" in result.stderr
    assert "no run has finished yet: a partial analysis of the rows logged so far" in \
        result.stderr
    steps = pq.read_table(sweep / "steps.parquet").to_pandas()
    assert steps["reached"].all()  # the target both have passed is used


def _set_column(path: Path, name: str, values) -> None:
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.schema.get_field_index(name), name, values), path)


@pytest.mark.parametrize("rewrite", [
    lambda s: pa.array([1] * (len(s) - 1) + [s[-1]]),  # duplicated, row count and last row kept
    lambda s: pa.array([-x for x in s[:-1]] + [s[-1]]),  # negative
    lambda s: pa.array([float("nan")] * len(s)),  # no step at all (statistics: all NaN)
])
def test_steps_rewritten_with_the_last_row_kept_name_the_run_it_leaves_out(sweep, rewrite):
    path = sweep / paths.RUNS / RUN / paths.METRICS
    steps = pq.read_table(path, columns=["step"]).column("step").to_pylist()
    _set_column(path, "step", rewrite(steps))
    result = _cli("analyze", str(sweep), "--targets", "0.9")
    _clean(result)
    assert f"run {RUN} recorded done, but its metrics.parquet is rewritten" in result.stderr
    assert "strictly increasing" in result.stderr
    assert RUN not in set(pq.read_table(sweep / "front.parquet").to_pandas().get(
        "run_id", []))
    outcome = pq.read_table(sweep / "steps.parquet").to_pandas().set_index("run_id")
    assert (outcome.loc[RUN, "reached"] == False).all()  # noqa: E712


@pytest.mark.parametrize("column", ["step", "loss"])
def test_metrics_columns_stored_as_text_are_named_in_one_line(sweep, column):
    path = sweep / paths.RUNS / RUN / paths.METRICS
    _set_column(path, column, pc.cast(pq.read_table(path).column(column), pa.string()))
    line = _one_line(_cli("analyze", str(sweep)))
    assert str(path) in line and f"its {column} column holds string, not numbers" in line
    status = _cli("status", str(sweep))
    _clean(status)


@pytest.mark.parametrize("content,said", [
    ('{"state": "done", "attempts": "x"}', "attempts is 'x', not a count"),
    ("[1, 2]", "not a run status"),
    ("[" * 5000 + "]" * 5000, "nested 5000 deep"),
])
@pytest.mark.parametrize("command", ["status", "analyze"])
def test_a_status_json_of_another_shape_is_one_line(sweep, content, said, command):
    (sweep / paths.RUNS / RUN / paths.STATUS).write_text(content)
    line = _one_line(_cli(command, str(sweep)))
    assert str(sweep / paths.RUNS / RUN / paths.STATUS) in line and said in line


def test_an_attempt_log_with_a_byte_that_is_not_utf8_is_read_around(sweep):
    with open(sweep / paths.RUNS / RUN / paths.HISTORY, "ab") as log:
        log.write(b"\xff\xfe not utf-8\n")
    result = _cli("status", str(sweep))
    _clean(result)
    assert "2 runs: 2 done" in result.stdout


def test_a_relaunch_whose_grid_point_shares_a_run_id_is_refused_before_anything_changes(sweep):
    before = (sweep / paths.SWEEP_CONFIG).read_bytes()
    line = _one_line(_cli(*LAUNCH, "sweep.learning_rates=[0.30001]", "--sweep-dir", str(sweep)))
    assert f"make one run id '{RUN}'" in line
    assert (sweep / paths.SWEEP_CONFIG).read_bytes() == before


def test_compare_and_plan_refuse_the_folders_of_a_sweep(sweep, tmp_path):
    for out in (sweep / paths.RUNS, sweep, sweep / paths.RUNS / RUN / "cmp"):
        line = _one_line(_cli("compare", str(sweep), "--out", str(out)))
        assert "a comparison gets a folder of its own" in line
    assert not list(sweep.rglob(paths.COMPARE))
    _clean(_cli("compare", str(sweep), "--out", str(tmp_path / "cmp")))
    runs = sorted(p.name for p in (sweep / paths.RUNS).iterdir())
    line = _one_line(_cli("plan", "--sweep-dir", str(sweep), "sweep=tiny"))
    assert "a plan would add its runs to that grid" in line
    assert sorted(p.name for p in (sweep / paths.RUNS).iterdir()) == runs


def test_a_folder_with_a_nan_task_option_accepts_its_own_files(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HELPERS))
    args = ("launch", "-q", "--sweep-dir", str(tmp_path / "nan"), "task=custom",
            "task._target_=options_task.make", "+task.scale=nan", "sweep.batch_sizes=[8]",
            "sweep.learning_rates=[0.1]", "sweep.max_steps=5", "sweep.targets=[0.5]",
            "executor.workers=1")
    _clean(_cli(*args))
    _clean(_cli(*args))  # the relaunch reads the folder's NaN as its own
    _clean(_cli("status", str(tmp_path / "nan")))


def test_a_keyboard_interrupt_raised_inside_a_task_is_a_failure_with_counted_attempts(
        tmp_path, monkeypatch):
    from gnsweep import tasks
    from gnsweep.compose import compose
    from gnsweep.config import TaskConfig
    from gnsweep.sweep import launch

    monkeypatch.syspath_prepend(str(HELPERS))
    entry = tasks.TaskEntry(tasks.options.DigitsOptions, "interrupting_task:make", "interrupts")
    monkeypatch.setitem(tasks.REGISTRY, "interrupting", entry)  # forked workers see it
    config = compose(["sweep.batch_sizes=[8]", "sweep.learning_rates=[0.1]",
                      "sweep.max_retries=1", "executor.workers=1"])
    config.task = TaskConfig(name="interrupting")
    summary = launch(config, tmp_path, show_progress=False)
    (run_id,) = store.run_ids(tmp_path)
    assert summary.failed == [run_id]
    status = store.read_status(paths.run_dir(tmp_path, run_id))
    assert status["state"] == "failed" and status["attempts"] == 2
    assert "KeyboardInterrupt raised inside the task" in status["error"]
    events = [json.loads(line) for line in
              (paths.run_dir(tmp_path, run_id) / paths.HISTORY).read_text().splitlines()]
    assert [e["attempt"] for e in events if e["event"] == "start"] == [1, 2]


# ---- every file of the folder, fuzzed: no command prints a traceback ----------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

RUN_FILES = (paths.STATUS, paths.RUN_CONFIG, paths.HISTORY, paths.METRICS)
RESULT_FILES = ("fits.json", "steps.parquet", "front.parquet", "fits.parquet")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)


def _json_content(original: bytes) -> st.SearchStrategy[bytes]:
    """A JSON file fuzzed in type, shape, encoding and depth: raw bytes, any JSON value, a deep
    nest, or the original object with one entry's value of another type."""
    data = json.loads(original) if original.strip().startswith(b"{") else None
    options = [st.binary(max_size=48),
               json_values.map(lambda v: json.dumps(v).encode()),
               st.integers(40, 3000).map(lambda n: b"[" * n + b"]" * n)]
    if isinstance(data, dict) and data:
        options.append(st.tuples(st.sampled_from(sorted(data)), json_values).map(
            lambda kv: json.dumps({**data, kv[0]: kv[1]}).encode()))
    return st.one_of(options)


def _lines_content(original: bytes) -> st.SearchStrategy[bytes]:
    line = st.one_of(json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=24))
    return st.lists(line, max_size=4).map(lambda lines: original + b"\n".join(lines) + b"\n")


def _parquet_content(original: bytes) -> st.SearchStrategy[bytes]:
    """A parquet file fuzzed: raw bytes, its rows cut or reordered, or one column replaced by
    values of another type (text, nulls, NaN, negative integers, booleans)."""
    import io

    table = pq.read_table(io.BytesIO(original))
    n = table.num_rows

    def written(t: pa.Table) -> bytes:
        out = io.BytesIO()
        pq.write_table(t.replace_schema_metadata(table.schema.metadata), out)
        return out.getvalue()

    columns = {"text": pa.array(["x"] * n), "nulls": pa.nulls(n, pa.float64()),
               "nan": pa.array([float("nan")] * n), "negative": pa.array([-1] * n),
               "bools": pa.array([True] * n)}
    replaced = st.tuples(st.sampled_from(table.column_names), st.sampled_from(sorted(columns)))
    return st.one_of(
        st.binary(max_size=48), st.just(original[: len(original) // 2]),
        st.just(written(table.slice(0, 0))), st.just(written(table.take(list(range(n))[::-1]))),
        replaced.map(lambda c: written(table.set_column(table.schema.get_field_index(c[0]),
                                                        c[0], columns[c[1]]))))


def _yaml_content(original: bytes) -> st.SearchStrategy[bytes]:
    import yaml

    data = yaml.safe_load(original)
    section = st.sampled_from(sorted(k for k, v in data.items() if isinstance(v, dict)))
    changed = st.tuples(section, st.text(max_size=6), json_values).map(
        lambda c: yaml.safe_dump({**data, c[0]: {**data[c[0]], c[1] or "x": c[2]}}).encode())
    bomb = b'a: &a ["x","x"]\nb: &b [*a,*a]\n' + original
    return st.one_of(st.binary(max_size=48), changed, st.just(bomb),
                     st.integers(40, 500).map(lambda n: b"a: " + b"[" * n + b"]" * n))


def _content(trained: Path, relative: str) -> st.SearchStrategy[bytes | None]:
    """What a file of the folder is replaced by (None: a FIFO in its place)."""
    original = (trained / relative).read_bytes()
    if relative.endswith(".parquet"):
        made = _parquet_content(original)
    elif relative.endswith(".yaml"):
        made = _yaml_content(original)
    elif relative.endswith(".jsonl"):
        made = _lines_content(original)
    else:
        made = _json_content(original)
    return st.one_of(made, st.just(None), st.just(b""))


FUZZED = {  # command -> the files fuzzed for it and the examples it gets (a bounded budget)
    "status": ([paths.SWEEP_CONFIG, *(f"{paths.RUNS}/{RUN}/{f}" for f in RUN_FILES)], 10),
    "analyze": ([paths.SWEEP_CONFIG, *(f"{paths.RUNS}/{RUN}/{f}" for f in RUN_FILES)], 6),
    "check": (["baseline.json"], 4),
    "compare": (RESULT_FILES, 3),
    "branch": ([paths.SWEEP_CONFIG, *(f"{paths.RUNS}/{RUN}/{f}" for f in RUN_FILES)], 4),
    "plot": (RESULT_FILES, 1),
    "report": (RESULT_FILES, 2),
}


def _args(command: str, sweep: Path, out: Path) -> list[str]:
    if command == "check":
        return ["check", str(sweep), "--baseline", str(sweep / "baseline.json")]
    if command == "compare":
        return ["compare", str(sweep), "--out", str(out)]
    if command == "branch":
        return ["branch", str(sweep / paths.RUNS / RUN), "--at", "64", "--dry-run",
                "--sweep-dir", str(out), "sweep=tiny", "sweep.batch_sizes=[8]"]
    return [command, str(sweep)]


@pytest.fixture(scope="module")
def fuzz_base(trained, tmp_path_factory) -> Path:
    """The trained sweep with a baseline of its own fits (what `check` compares with)."""
    base = tmp_path_factory.mktemp("fuzz") / "sweep"
    shutil.copytree(trained, base)
    _clean(_cli("baseline", str(base), "--output", str(base / "baseline.json")))
    return base


@pytest.mark.parametrize("command", sorted(FUZZED))
def test_no_content_of_a_folder_file_makes_a_command_print_a_traceback(fuzz_base, command,
                                                                      tmp_path):
    import tempfile

    files, examples = FUZZED[command]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(files).flatmap(
        lambda f: st.tuples(st.just(f), _content(fuzz_base, f))))
    def one(case: tuple[str, bytes | None]) -> None:
        relative, content = case
        with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
            sweep = Path(folder) / "sweep"
            shutil.copytree(fuzz_base, sweep)
            path = sweep / relative
            path.unlink()
            if content is None:
                os.mkfifo(path)
            else:
                path.write_bytes(content)
            result = _cli(*_args(command, sweep, Path(folder) / "out"))
            assert result.exception is None or isinstance(result.exception, SystemExit), (
                relative, content, result.exception)
            allowed = (0, 1, 2) if command == "check" else (0, 2)
            assert result.exit_code in allowed and "Traceback" not in result.output, (
                relative, content, result.output)
            if result.exit_code == 2:
                assert len(result.stderr.strip().splitlines()) == 1, (relative, result.stderr)

    one()
