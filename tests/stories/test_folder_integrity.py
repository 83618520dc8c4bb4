"""A sweep folder's files, third round, at the reader: only regular files are opened (a FIFO or
socket is refused in one line, never waited on), JSON nesting and YAML aliases are bounded, a
status.json is checked for its shape, a run's steps must rise, results tables of two analyses
are never read as one, and the smaller cases (NaN settings, repeated seeds, run ids shared by
two grid points, pieces of secrets, out-of-space retries, stale torchrun scratch). Fast: no
sweep is trained here (tests/stories/test_folder_integrity_sweeps.py trains one)."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sweep_tables import make_tables
from typer.testing import CliRunner

from gnsweep import paths, redact, store
from gnsweep.branching import parse_points
from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.config import ConfigError
from gnsweep.errors import StoreError
from gnsweep.runs import RunSpec, config_differences, expand_grid, needs_running


def _returns(call, *args):
    """`call(*args)`'s outcome (value or exception) from a thread, failing the test when the call
    is still blocked after a minute (a reader that waits on a FIFO never returns at all)."""
    out: dict = {}

    def target():
        try:
            out["value"] = call(*args)
        except BaseException as err:
            out["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"{call.__name__} blocked on {args}"
    return out


def _one_line(result) -> str:
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.stderr, \
        result.stderr
    return lines[0]


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


# ---- only regular files ------------------------------------------------------------------


@pytest.fixture
def short_dir():
    """A folder with a short path (a unix socket's path must stay under 108 bytes)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        yield Path(folder)


def _special(path: Path, kind: str):
    if kind == "fifo":
        os.mkfifo(path)
        return None
    if kind == "socket":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        return sock
    path.mkdir()
    return None


@pytest.mark.parametrize("kind,said", [("fifo", "named pipe (FIFO)"), ("socket", "socket"),
                                       ("folder", "folder")])
@pytest.mark.parametrize("reader", ["read_json", "read_table", "read_text", "read_status"])
def test_a_special_file_is_refused_by_every_reader_never_opened_to_wait(short_dir, kind, said,
                                                                         reader):
    name = paths.STATUS if reader == "read_status" else "file"
    sock = _special(short_dir / name, kind)
    try:
        out = _returns(getattr(store, reader),
                       short_dir if reader == "read_status" else short_dir / name)
    finally:
        if sock is not None:
            sock.close()
    assert isinstance(out.get("error"), StoreError), out
    message = str(out["error"])
    assert str(short_dir / name) in message and said in message


def test_a_fifo_is_refused_where_gnsweep_appends_too(short_dir):
    os.mkfifo(short_dir / paths.HISTORY)
    out = _returns(store.append_line, short_dir / paths.HISTORY, "{}\n")
    assert isinstance(out.get("error"), StoreError) and "named pipe" in str(out["error"])


def test_json_nested_deeper_than_the_bound_is_refused_in_one_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(StoreError, match=r"nested 100000 deep, more than the 64"):
        store.read_json(deep)
    shallow = tmp_path / "shallow.json"
    shallow.write_text(json.dumps({"a": [[[{"b": "[[[[[[["}]]]}))  # brackets in strings
    assert store.read_json(shallow) == {"a": [[[{"b": "[[[[[[["}]]]}
    assert store.json_depth('{"a": [[[{"b": "[[[[[[["}]]]}') == 5


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    (tmp_path / paths.RUNS).mkdir()
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [{','.join([f'*{prev}'] * 9)}]")
    (tmp_path / paths.SWEEP_CONFIG).write_text("\n".join(lines) + "\ntask: {name: digits}\n")
    with pytest.raises(StoreError, match=r"line 1: a YAML anchor or alias \(&a\)"):
        store.read_sweep_config(tmp_path)
    result = _cli("status", str(tmp_path))
    assert "anchor or alias" in _one_line(result)


def test_yaml_nested_deeper_than_the_bound_is_refused():
    with pytest.raises(StoreError, match="nested deeper than 64"):
        store.load_yaml("a: " + "[" * 200 + "]" * 200, "x.yaml")
    assert store.load_yaml("a: [[1]]\nb: {c: d}\n", "x.yaml") == {"a": [[1]], "b": {"c": "d"}}


# ---- status.json --------------------------------------------------------------------------


@pytest.mark.parametrize("content,said", [
    ('{"state": "done", "attempts": "x"}', "attempts is 'x', not a count"),
    ('{"state": "done", "attempts": -1}', "attempts is '-1', not a count"),
    ('{"state": "done", "attempts": null}', "attempts is 'None', not a count"),
    ("[1, 2]", "not a run status (a JSON object)"),
    ('{"state": "finished"}', "unknown state 'finished'"),
    ('{"state": "failed", "retry_base": true}', "retry_base is 'True', not a count"),
])
def test_a_status_json_of_another_shape_is_named_with_its_field(tmp_path, content, said):
    (tmp_path / paths.STATUS).write_text(content)
    with pytest.raises(StoreError, match=re.escape(said)):
        store.read_status(tmp_path)


# ---- a run's rows -------------------------------------------------------------------------


@pytest.mark.parametrize("steps,said", [
    ([1, 2, 3], None), ([5], None), ([], None),
    ([1, 1, 3], "step 1 after step 1 at row 2"),
    ([-1, -2, 3], "step -1 at row 1"),
    ([0, 1, 2], "step 0 at row 1"),
    ([1, 3, 2], "step 2 after step 3 at row 3"),
    ([1.0, math.nan, 3.0], "step nan at row 2"),
])
def test_steps_must_be_positive_and_strictly_increasing(steps, said):
    from gnsweep.analysis.load import rows_problem

    table = pa.table({"step": pa.array(steps, pa.float64() if any(
        isinstance(s, float) for s in steps) else pa.int64())})
    problem = rows_problem(table)
    if said is None:
        assert problem is None
    else:
        assert said in problem and "strictly increasing" in problem


# ---- the grid -----------------------------------------------------------------------------


def test_repeated_seeds_are_refused_like_repeated_batch_sizes():
    with pytest.raises(ConfigError, match=r"sweep.seeds: \[0, 0\] has repeated values"):
        compose(["sweep=tiny", "sweep.seeds=[0,0]"])
    line = _one_line(_cli("launch", "--dry-run", "sweep=tiny", "sweep.seeds=[1,2,1]"))
    assert "sweep.seeds: [1, 2, 1] has repeated values" in line


def test_grid_points_that_would_share_a_run_id_are_refused():
    from gnsweep.runs import distinct_ids

    config = compose(["sweep=tiny", "sweep.learning_rates=[0.3,0.3000000000001]"])
    with pytest.raises(ConfigError, match=re.escape("make one run id 'b00008_lr0.3_s0'")):
        expand_grid(config)
    line = _one_line(_cli("launch", "--dry-run", "sweep=tiny",
                          "sweep.learning_rates=[0.3,0.3000000000001]"))
    assert "learning_rate 0.3 and 0.3000000000001" in line
    # Values that differ in the id's 4 digits are distinct runs.
    specs = expand_grid(compose(["sweep=tiny", "sweep.learning_rates=[0.3,0.3001]"]))
    assert len({s.run_id for s in specs}) == len(specs)
    assert distinct_ids([RunSpec(8, 0.1), RunSpec(8, 0.1)]) == [RunSpec(8, 0.1)] * 2


def test_nan_settings_compare_equal():
    nan = float("nan")
    assert config_differences({"task": {"options": {"scale": nan, "l": [nan, 1.0]}}},
                              {"task": {"options": {"scale": nan, "l": [nan, 1.0]}}}) == []
    assert config_differences({"a": nan}, {"a": 1.0}) == ["a: nan -> 1.0"]


def test_branch_points_beyond_a_float_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="1e400 is not a positive whole number"):
        parse_points("1e400")
    with pytest.raises(ConfigError, match="inf is not a positive whole number"):
        parse_points("1000,inf")
    assert parse_points("1e3,2000") == [1000, 2000]


# ---- results: one analysis, one generation ------------------------------------------------


def test_the_results_of_two_analyses_are_never_read_as_one(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    store.write_results(first, make_tables())
    store.write_results(second, make_tables(targets=[1.0, 0.5]))
    assert len(store.read_result_tables(second)["fits"]) == 2
    (second / "fits.parquet").write_bytes((first / "fits.parquet").read_bytes())
    with pytest.raises(StoreError, match=r"come from 2 different analyses \(.*; fits.parquet\)"):
        store.read_result_tables(second)
    for command in ("report", "plot"):
        line = _one_line(_cli(command, str(second)))
        assert "different analyses" in line and "gnsweep analyze" in line


def test_a_crash_between_the_results_files_leaves_the_previous_set_whole(tmp_path,
                                                                         monkeypatch):
    store.write_results(tmp_path, make_tables())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real, calls = pq.write_table, []

    def full_disk(table, where, **kwargs):
        calls.append(where)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(where))
        return real(table, where, **kwargs)

    monkeypatch.setattr(pq, "write_table", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        store.write_results(tmp_path, make_tables(targets=[1.0, 0.5]))
    monkeypatch.setattr(pq, "write_table", real)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp left
    assert len(store.read_result_tables(tmp_path)["fits"]) == 3


def test_an_optional_table_of_the_previous_analysis_does_not_outlive_it(tmp_path):
    tables = make_tables()
    tables.along_base = tables.metrics[["step", "examples", "loss"]].head(3)
    store.write_results(tmp_path, tables)
    assert (tmp_path / "along_base.parquet").exists()
    store.write_results(tmp_path, make_tables())
    assert not (tmp_path / "along_base.parquet").exists()
    store.read_result_tables(tmp_path)


def _rewrite(path: Path, change) -> None:
    table = pq.read_table(path)
    pq.write_table(change(table).replace_schema_metadata(table.schema.metadata), path)


def _all_nan_floats(table: pa.Table) -> pa.Table:
    for i, f in enumerate(table.schema):
        if pa.types.is_floating(f.type):
            table = table.set_column(i, f.name, pa.array(np.full(table.num_rows, np.nan)))
    return table


@pytest.mark.parametrize("name,change,said", [
    ("steps.parquet", lambda t: pa.table({"x": [1, 2]}), "no run_id column"),
    ("front.parquet", _all_nan_floats, "a target that is not a finite number"),
    ("fits.parquet", lambda t: t.set_column(0, "target", pa.array(["a"] * t.num_rows)),
     "its target column holds text, not numbers"),
])
def test_a_results_table_of_another_schema_is_named_by_report_and_plot(tmp_path, name, change,
                                                                      said):
    store.write_results(tmp_path, make_tables())
    _rewrite(tmp_path / name, change)
    for command in ("report", "plot"):
        line = _one_line(_cli(command, str(tmp_path)))
        assert name in line and said in line


def test_fits_json_warnings_of_another_type_are_named(tmp_path):
    store.write_results(tmp_path, make_tables())
    saved = json.loads((tmp_path / paths.FITS_JSON).read_text())
    (tmp_path / paths.FITS_JSON).write_text(json.dumps({**saved, "warnings": 5}))
    assert "its warnings are not a list" in _one_line(_cli("report", str(tmp_path)))


def test_a_dollar_in_the_tasks_unit_is_drawn_as_written():
    import io

    import matplotlib.pyplot as plt

    from gnsweep.report.figures import FIGURES

    tables = make_tables()
    tables.meta.update(unit="a$^$b", metric="loss")
    spec = next(s for s in FIGURES if s.name == "pareto_fronts")
    figure = spec.draw(tables)
    figure.savefig(io.BytesIO(), format="png")  # mathtext would stop here on "$^$"
    labels = [ax.get_xlabel() for ax in figure.axes]
    plt.close(figure)
    assert any("a$^$b" in label.replace("\\$", "$") for label in labels), labels


def test_a_baseline_nested_too_deep_is_refused_in_one_line(tmp_path):
    store.write_results(tmp_path, make_tables())
    deep = tmp_path / "baseline.json"
    deep.write_text("{\"a\": " * 5000 + "1" + "}" * 5000)
    line = _one_line(_cli("check", str(tmp_path), "--baseline", str(deep)))
    assert str(deep) in line and "nested 5000 deep" in line


# ---- smaller ones -------------------------------------------------------------------------


def test_pieces_of_a_secret_are_masked_wherever_an_error_is_written(monkeypatch):
    secret = "sk-live-0123456789abcdefXYZ"
    monkeypatch.setenv(redact.SECRETS_ENV, json.dumps({"logger.api_key": secret}))
    for quoted in (secret[:10] + "...", "..." + secret[8:], secret[3:17], secret):
        text = redact.text(f"server refused {quoted} (401)")
        assert secret[:6] not in text and secret[8:20] not in text, text
        assert "***" in text and text.startswith("server refused ")
    assert redact.text("server refused sk-li (401)") == "server refused sk-li (401)"


def test_an_out_of_space_failure_is_not_retried_in_the_launch_it_failed_in(tmp_path):
    from gnsweep.executors import _failed

    store.write_status(tmp_path, "running", attempts=1)
    status = _failed(tmp_path, 1, True, OSError(errno.ENOSPC, "No space left on device"))
    assert status["reason"] == "out_of_space" and "not retried" in status["error"]
    assert not needs_running(store.read_status(tmp_path), max_retries=3)
    # A relaunch gives it its try again (fresh retries); another error is retried as ever.
    assert needs_running(dataclasses.replace(store.read_status(tmp_path), retry_base=1),
                         max_retries=3)
    status = _failed(tmp_path, 2, True, RuntimeError("boom"))
    assert status.get("reason") is None and needs_running(store.read_status(tmp_path), 3)


def test_an_end_that_could_not_be_written_is_shown_with_the_died_run(tmp_path):
    from gnsweep.executors import log_event, unrecorded_end, unrecorded_error

    log_event(tmp_path, "start", attempt=1)
    with pytest.raises(OSError), unrecorded_end(tmp_path, 1):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / paths.STATUS))
    assert "No space left on device" in unrecorded_error(tmp_path)
    log_event(tmp_path, "start", attempt=2)  # a new attempt: the old reason is not its
    assert unrecorded_error(tmp_path) is None


@pytest.mark.process  # starts one short process, for a pid that is surely gone
def test_torchrun_scratch_of_a_killed_launcher_is_removed_by_the_next_launch(tmp_path):
    from gnsweep.executors.torchrun import remove_stale_scratch, scratch_name
    from gnsweep.paths import QUEUE

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    queue = tmp_path / QUEUE
    dead = queue / scratch_name("0123456789ab").replace(f".{os.getpid()}.", f".{gone.pid}.")
    live = queue / scratch_name("ba9876543210")
    other = queue / f"abcdef012345.some-other-host.{gone.pid}.tmp"
    for folder in (dead, live, other):
        (folder / "torchelastic_x").mkdir(parents=True)
    # The killed round's runs file and job logs; a live round's, and a finished round's
    # kept log of a failed job (no scratch left), stay.
    files = {name: queue / name for name in ("0123456789ab.txt", "0123456789ab.0.log",
                                             "0123456789ab.1.log", "ba9876543210.txt",
                                             "ba9876543210.0.log", "fedcba987654.0.log")}
    for path in files.values():
        path.write_text("x\n")
    assert remove_stale_scratch(tmp_path) == [dead, files["0123456789ab.txt"],
                                              files["0123456789ab.0.log"],
                                              files["0123456789ab.1.log"]]
    assert not dead.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in files.values() if p.exists()) == \
        ["ba9876543210.0.log", "ba9876543210.txt", "fedcba987654.0.log"]


def test_a_yaml_alias_in_the_conf_folder_is_refused_before_hydra_expands_it(tmp_path,
                                                                           monkeypatch):
    import shutil

    from gnsweep.compose import conf_dir

    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    bomb = ['# @package _global_', 'a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        bomb.append(f"{name}: &{name} [{','.join([f'*{prev}'] * 9)}]")
    (conf / "experiment" / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    monkeypatch.setenv("GNSWEEP_CONF", str(conf))
    with pytest.raises(StoreError, match=r"bomb.yaml: line 2: a YAML anchor or alias \(&a\)"):
        compose(["sweep=tiny"])
    line = _one_line(_cli("launch", "--dry-run", "sweep=tiny"))
    assert "bomb.yaml" in line


@pytest.mark.parametrize("record", [
    [], {"rounds": [1]}, {"rounds": [{"phase": "pilot"}]},
    {"rounds": [{"phase": "pilot", "runs": [{"batch_size": "8"}]}]}])
def test_a_plan_record_of_another_shape_is_refused_in_one_line(tmp_path, record):
    from gnsweep.commands.plan import plan

    folder = tmp_path / "plan"
    folder.mkdir()
    (folder / paths.PLAN).write_text(json.dumps(record))
    with pytest.raises(StoreError, match="not a plan's record"):
        plan(compose(["sweep=tiny"]), folder, show_progress=False, echo=lambda line: None)
    assert not (folder / paths.SWEEP_CONFIG).exists()  # refused before the folder changed


def test_a_line_break_quoted_from_a_file_stays_inside_the_one_line(tmp_path):
    import yaml

    data = compose(["sweep=tiny"]).to_dict()
    data["analysis"]["bad\r\nkey"] = None
    (tmp_path / paths.SWEEP_CONFIG).write_text(yaml.safe_dump(data))
    (tmp_path / paths.RUNS).mkdir()
    line = _one_line(_cli("status", str(tmp_path)))
    assert "analysis.bad\\r\\nkey: unknown option" in line
