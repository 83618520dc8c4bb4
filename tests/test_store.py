"""The run status contract (status.json as `store.RunStatus`) and the metrics table's columns."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from gnsweep import paths, store, tables
from gnsweep.errors import StoreError
from gnsweep.noise import NoiseEstimate


def test_status_round_trips_and_keeps_unknown_keys(tmp_path):
    store.write_status(tmp_path, "running", attempts=2, host="h", pid=7)
    (tmp_path / paths.STATUS).write_text(json.dumps(
        {**json.loads((tmp_path / paths.STATUS).read_text()), "from_a_newer_version": [1]}))
    status = store.write_status(tmp_path, "done", steps=30, rows=4, examples=120)
    saved = json.loads((tmp_path / paths.STATUS).read_text())
    assert saved["state"] == "done" and saved["attempts"] == 2 and saved["steps"] == 30
    assert saved["from_a_newer_version"] == [1]
    assert "error" not in saved and "traceback" not in saved  # never written: absent, not null
    assert status.state is store.RunState.DONE and status["state"] == "done"
    assert store.read_status(tmp_path) == status


def test_a_new_attempt_drops_the_previous_error(tmp_path):
    store.write_status(tmp_path, "failed", attempts=1, error="ValueError: boom")
    assert store.read_status(tmp_path).error == "ValueError: boom"
    assert store.write_status(tmp_path, "running", attempts=2).error is None


def test_a_run_never_started_is_pending(tmp_path):
    status = store.read_status(tmp_path)
    assert status.state is store.RunState.PENDING and status.attempts == 0


@pytest.mark.parametrize("content", ['[1, 2]', '{"state": "done", "attempts": "x"}',
                                     '{"state": "exploded"}', '{"attempts": -1}',
                                     '{"attempts": true}'])
def test_a_status_no_gnsweep_writes_is_one_line(tmp_path, content):
    (tmp_path / paths.STATUS).write_text(content)
    with pytest.raises(StoreError) as err:
        store.read_status(tmp_path)
    assert "\n" not in str(err.value) and paths.STATUS in str(err.value)


def test_writing_an_unknown_field_is_a_programming_error(tmp_path):
    with pytest.raises(TypeError):
        store.write_status(tmp_path, "done", stpes=3)


def test_metrics_columns_have_one_home():
    schema = tables.METRICS_SCHEMA
    assert store.METRICS_SCHEMA is schema  # the store writes with the table's own schema
    names = set(schema.names)
    # Every reader's and writer's columns are columns of the one schema.
    for group in (tables.CORE_METRICS, tables.CURVE_COLUMNS, tables.TRACKED_METRICS,
                  tables.PROBE_COLUMNS, tables.TRUTH_COLUMNS, tables.OPTIONAL_METRICS):
        assert set(group) <= names, set(group) - names
    # The monitor's estimate is logged field by field into the same table.
    assert {f.name for f in fields(NoiseEstimate)} <= names
