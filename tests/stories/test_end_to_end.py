"""launch -> analyze on a tiny grid, through the CLI, with real worker processes (plot and report
of the same sweep: tests/report/test_report.py)."""

import math

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app

runner = CliRunner()
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep_dir(tiny_sweep):
    return tiny_sweep  # launched through the CLI with 2 workers (conftest.py)


def test_every_run_finished_with_a_readable_metrics_file(sweep_dir):
    ids = store.run_ids(sweep_dir)
    assert len(ids) == 6
    for run_id in ids:
        path = paths.run_dir(sweep_dir, run_id)
        status = store.read_status(path)
        assert status["state"] in ("done", "diverged"), status
        table = pq.read_table(path / paths.METRICS)
        assert table.schema.equals(store.METRICS_SCHEMA)
        rows = table.to_pandas()
        assert (rows["step"].diff().dropna() > 0).all()
        assert (rows["examples"] == rows["step"] * rows["examples"].iloc[0]
                // rows["step"].iloc[0]).all()
        if status["state"] == "done":
            # B_simple is measured while training: a positive, finite ratio of EMAs.
            b_simple = rows["b_simple"].iloc[-1]
            assert math.isfinite(b_simple) and b_simple > 0


def test_analyze_writes_tables_and_prints_the_fit(sweep_dir):
    result = runner.invoke(app, ["analyze", str(sweep_dir)])
    assert result.exit_code == 0, result.output
    assert "B_crit" in result.output
    assert "noise scale measured on" in result.output  # and on what share of the steps
    steps = pq.read_table(sweep_dir / "steps.parquet").to_pandas()
    fits = pq.read_table(sweep_dir / "fits.parquet").to_pandas()
    targets = sorted(fits["target"])
    assert len(steps) == 6 * len(targets)
    # S = S_min + E_min/B: steps never grow with batch size at the best learning rate.
    front = pq.read_table(sweep_dir / "front.parquet").to_pandas()
    for _, group in front.groupby("target"):
        group = group.sort_values("batch_size")
        assert (group["steps"].diff().dropna() <= 0).all()
        assert (group["examples"].diff().dropna() >= 0).all()
    fitted = fits[fits["refused"] == ""]
    assert len(fitted) >= 1
    assert (fitted["b_crit"] > 0).all()
    assert ((fitted["b_crit"] - fitted["e_min"] / fitted["s_min"]).abs()
            < 1e-9 * fitted["b_crit"]).all()


def test_relaunch_runs_nothing_again(sweep_dir):
    before = {r: store.read_status(paths.run_dir(sweep_dir, r))["updated"]
              for r in store.run_ids(sweep_dir)}
    result = runner.invoke(app, ["launch", "sweep=tiny", "--sweep-dir", str(sweep_dir), "--quiet"])
    assert result.exit_code == 0, result.output
    after = {r: store.read_status(paths.run_dir(sweep_dir, r))["updated"]
             for r in store.run_ids(sweep_dir)}
    assert before == after
