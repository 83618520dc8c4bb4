"""Multi-workload tables: `gnsweep analyze --table FILE --group-by COLUMN`.

The table has the shape of published multi-workload measurements (MLPerf-style
`workload,batch_size,steps`, one row per workload x batch size, as in Shallue et al. 2018): each
workload's steps follow a known hyperbola S = S_min + E_min/B (eq. 2.11), rounded to whole
steps, so every fit is checked against the truth B_crit = E_min/S_min (eq. 2.12).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from gnsweep import store
from gnsweep.cli import app

# workload -> (S_min, E_min, batch sizes measured); the last one's B_crit = 40 lies below its
# smallest batch size, so its fit only bounds B_crit and must be flagged.
TRUTH = {
    "resnet50_imagenet": (2000.0, 2.0e6, [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]),
    "transformer_lm1b": (5000.0, 1.5e6, [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]),
    "simple_cnn_mnist": (500.0, 2.0e4, [256, 512, 1024, 2048, 4096, 8192]),
}


def _table(path, with_target: bool = False):
    rows = [{"workload": w, "batch_size": b, "steps": round(s + e / b)}
            for w, (s, e, sizes) in TRUTH.items() for b in sizes]
    frame = pd.DataFrame(rows)
    if with_target:  # two quality targets per workload: the second needs 1.5x the steps
        harder = frame.assign(steps=(frame["steps"] * 1.5).round(), target=0.5)
        frame = pd.concat([frame.assign(target=1.0), harder], ignore_index=True)
    frame.to_csv(path, index=False)
    return path


def _invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("groups")
    out = tmp / "out"
    result = _invoke("analyze", "--table", _table(tmp / "workloads.csv"), "--group-by",
                     "workload", "--out", out)
    return out, result.output


def test_one_fit_per_workload_recovers_each_hyperbola(analyzed):
    out, printed = analyzed
    fits = store.read_table(out / "fits.parquet").to_pandas().set_index("workload")
    assert list(fits.index) == list(TRUTH)
    for workload, (s_min, e_min, sizes) in TRUTH.items():
        row = fits.loc[workload]
        assert row["refused"] == ""
        assert row["n_batch_sizes"] == len(sizes)
        # Whole-step rounding is the only error: under 0.5%.
        assert row["s_min"] == pytest.approx(s_min, rel=5e-3)
        assert row["e_min"] == pytest.approx(e_min, rel=5e-3)
        assert row["b_crit"] == pytest.approx(e_min / s_min, rel=1e-2)
    # B_crit = 40 outside 256..8192: flagged; the others are inside their ranges.
    assert "below the smallest batch size (256..8192)" in fits.loc["simple_cnn_mnist", "quality"]
    assert fits.loc["resnet50_imagenet", "quality"] == ""
    assert fits.loc["transformer_lm1b", "quality"] == ""
    # Printed: one block per workload, under its name.
    for workload in TRUTH:
        assert f"workload {workload}:" in printed
    assert "warning: workload simple_cnn_mnist: target 1: B_crit" in printed


def test_every_output_table_carries_the_group_column(analyzed):
    out, _ = analyzed
    for name in ("steps", "front", "fits", "lr_fits", "loss_scaling"):
        frame = store.read_table(out / f"{name}.parquet").to_pandas()
        assert frame.columns[0] == "workload", name
        assert set(frame["workload"]) == set(TRUTH), name
    steps = store.read_table(out / "steps.parquet").to_pandas()
    assert len(steps) == sum(len(sizes) for *_, sizes in TRUTH.values())
    saved = json.loads((out / "fits.json").read_text())
    assert saved["meta"]["group_by"] == "workload"
    assert {f["workload"] for f in saved["fits"]} == set(TRUTH)


def test_plot_and_report_draw_each_workload(analyzed):
    out, _ = analyzed
    plotted = _invoke("plot", out)
    for workload in TRUTH:
        assert (out / "figures" / workload / "pareto_fronts.png").is_file()
    assert "skipped resnet50_imagenet/steps_grid: the steps table has no learning rates" in \
        plotted.output
    reported = _invoke("report", out)
    assert "report: file://" in reported.output
    html = (out / "report.html").read_text()
    for workload in TRUTH:
        assert f"workload {workload}</h1>" in html
    assert html.count("<img ") == len(TRUTH)  # one Pareto front per workload


def test_baseline_and_check_per_workload(analyzed, tmp_path):
    out, _ = analyzed
    baseline = tmp_path / "base.json"
    _invoke("baseline", out, "-o", baseline)
    record = json.loads(baseline.read_text())
    assert record["group_by"] == "workload"
    assert {(t["group"], t["target"]) for t in record["targets"]} == {(w, 1.0) for w in TRUTH}
    checked = _invoke("check", out, "--baseline", baseline)
    assert "all 9 figure(s) within tolerance" in checked.output
    # One workload's B_crit moves by 10%: only its case fails, named by workload.
    moved = dict(record, targets=[dict(t, b_crit=t["b_crit"] * 1.1)
                                  if t["group"] == "transformer_lm1b" else t
                                  for t in record["targets"]])
    baseline.write_text(json.dumps(moved))
    result = CliRunner().invoke(app, ["check", str(out), "--baseline", str(baseline)])
    assert result.exit_code == 1
    failed = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1 and "transformer_lm1b target 1" in failed[0] and "b_crit" in failed[0]


def test_targets_stay_numeric_and_optional(tmp_path):
    """With a target column each workload gets one fit per target; the harder target needs
    1.5x the steps at every batch size, so S_min and E_min scale by 1.5 and B_crit stays."""
    out = tmp_path / "out"
    _invoke("analyze", "--table", _table(tmp_path / "t.csv", with_target=True), "--group-by",
            "workload", "--out", out)
    fits = store.read_table(out / "fits.parquet").to_pandas()
    assert len(fits) == 2 * len(TRUTH)
    for workload, (s_min, _e_min, _) in TRUTH.items():
        rows = fits[fits["workload"] == workload].set_index("target")
        assert rows.loc[0.5, "s_min"] == pytest.approx(1.5 * s_min, rel=2e-3)
        assert rows.loc[0.5, "b_crit"] == pytest.approx(rows.loc[1.0, "b_crit"], rel=1e-2)


def test_group_by_mistakes_are_one_line(tmp_path):
    table = _table(tmp_path / "t.csv")
    runner = CliRunner()
    cases = [
        (["--group-by", "model"], "--group-by model: no such column (columns: workload, "),
        (["--group-by", "batch_size"], "that column is a measurement"),
    ]
    for extra, message in cases:
        result = runner.invoke(app, ["analyze", "--table", str(table), "--out",
                                     str(tmp_path / "o"), *extra])
        assert result.exit_code == 2 and message in result.output, result.output
    result = runner.invoke(app, ["analyze", str(tmp_path), "--group-by", "workload"])
    assert result.exit_code == 2 and "--group-by groups the rows of a --table" in result.output
    # Without --group-by a table lacking `target` is refused as before, naming the column.
    result = runner.invoke(app, ["analyze", "--table", str(table), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "missing column(s) target" in result.output
    # A bad value is reported at its row in the file, also inside a group.
    frame = pd.read_csv(table)
    frame.loc[12, "steps"] = np.nan
    frame.to_csv(table, index=False)
    result = runner.invoke(app, ["analyze", "--table", str(table), "--out", str(tmp_path / "o"),
                                 "--group-by", "workload"])
    assert result.exit_code == 2
    assert "column 'steps': nan is missing or not finite (row(s) 14)" in result.output
