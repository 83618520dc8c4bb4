"""The answer never changes in silence: a run recorded done whose metrics are missing or
unreadable is shown as needing a rerun, named by the analysis, and run again by the next launch;
the advice of each message, followed as written, works."""

import json

import pytest
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app
from gnsweep.paths import HISTORY
from gnsweep.status_rows import sweep_status

pytestmark = pytest.mark.slow

LAUNCH = ["launch", "sweep=tiny", "--workers", "2", "--quiet"]


def _starts(sweep_dir, run_id) -> int:
    text = (paths.run_dir(sweep_dir, run_id) / HISTORY).read_text()
    return sum(json.loads(line)["event"] == "start" for line in text.splitlines())


def test_lost_and_corrupt_metrics_are_named_and_rerun(tiny_sweep):
    runner = CliRunner()
    run_ids = store.run_ids(tiny_sweep)
    lost, corrupt = run_ids[0], run_ids[1]
    (paths.run_dir(tiny_sweep, lost) / paths.METRICS).unlink()
    bad = paths.run_dir(tiny_sweep, corrupt) / paths.METRICS
    bad.write_bytes(bad.read_bytes()[: len(bad.read_bytes()) // 2])

    rows = {r["run_id"]: r for r in sweep_status(tiny_sweep)}
    assert rows[lost]["state"] == rows[corrupt]["state"] == "rerun"
    assert "metrics.parquet is missing" in rows[lost]["info"]
    assert "metrics.parquet is unreadable" in rows[corrupt]["info"]
    assert {r["state"] for i, r in rows.items() if i not in (lost, corrupt)} == {"done"}
    result = runner.invoke(app, ["status", str(tiny_sweep)])
    assert result.exit_code == 0 and "2 rerun" in result.output

    result = runner.invoke(app, ["analyze", str(tiny_sweep)])
    assert result.exit_code == 2
    assert str(bad) in result.stderr and "relaunch the sweep" in result.stderr
    result = runner.invoke(app, ["analyze", str(tiny_sweep), "--skip-corrupt"])
    assert result.exit_code == 0, result.output
    assert f"run {lost} recorded done, but its metrics.parquet is missing: left out" \
        in result.stderr
    assert f"run {corrupt} recorded done, but its metrics.parquet is unreadable: left out" \
        in result.stderr

    # The advice, followed: the same launch command runs exactly those two again.
    result = runner.invoke(app, [*LAUNCH, "--sweep-dir", str(tiny_sweep)])
    assert result.exit_code == 0, result.output
    assert "2 done, 0 diverged, 0 failed this launch" in result.output
    assert _starts(tiny_sweep, lost) == _starts(tiny_sweep, corrupt) == 2
    assert all(_starts(tiny_sweep, r) == 1 for r in run_ids[2:])
    result = runner.invoke(app, ["analyze", str(tiny_sweep)])
    assert result.exit_code == 0, result.output
    assert "left out" not in result.stderr


def test_a_corrupt_results_table_says_how_to_write_it_again(tiny_sweep, tmp_path):
    runner = CliRunner()
    out, baseline = tmp_path / "out", tmp_path / "baseline.json"
    analyze = ["analyze", str(tiny_sweep), "--out", str(out)]
    assert runner.invoke(app, analyze).exit_code == 0
    assert runner.invoke(app, ["baseline", str(out), "-o", str(baseline)]).exit_code == 0
    table = out / "steps.parquet"
    table.write_bytes(table.read_bytes()[:100])
    result = runner.invoke(app, ["check", str(out), "--baseline", str(baseline)])
    assert result.exit_code == 2
    assert str(table) in result.stderr and "run the `gnsweep analyze` that wrote it" \
        in result.stderr
    assert runner.invoke(app, analyze).exit_code == 0  # the advice, followed
    result = runner.invoke(app, ["check", str(out), "--baseline", str(baseline)])
    assert result.exit_code == 0, result.output
