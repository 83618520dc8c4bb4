"""A recommendation that agrees with itself: the batch size lies inside its own interval, units
are singular for one, each preference's costs are eq. 2.11's at the batch that runs, the
tradeoff table never repeats a clipped row, no grid is advised that cannot run, and a B_crit
below the smallest batch a run can take is said in words with the measured rate there.

Ground truth is eq. 2.11 itself: the steps tables are exact hyperbolas S = S_min (1 + B_crit/B)
times a bowl in log learning rate whose bottom is known, so every number has a closed form.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from typer.testing import CliRunner

from gnsweep.analysis.decision import PREFERENCES, recommend
from gnsweep.analysis.setting import Setting, counted
from gnsweep.cli import app
from gnsweep.folder import read_results
from gnsweep.report.answers import answers
from gnsweep.report.recommendation import lines, summary

LRS = (0.5, 1.0, 2.0, 4.0, 8.0)
BEST_LR = 2.0
"""The bottom of every batch size's bowl (inside the grid: the rate is placed)."""


def steps_table(path, b_crit: float, batch_sizes, s_min: float = 100.0, best=BEST_LR):
    rows = []
    for b in batch_sizes:
        for lr in LRS:
            bowl = 1 + 0.3 * math.log2(lr / best) ** 2
            rows.append((b, lr, 1.0, s_min * (1 + b_crit / b) * bowl))
    pd.DataFrame(rows, columns=["batch_size", "learning_rate", "target", "steps"]).to_csv(
        path, index=False)
    return path


def analysed(tmp_path, b_crit, batch_sizes):
    tmp_path.mkdir(parents=True, exist_ok=True)
    table = steps_table(tmp_path / "steps.csv", b_crit, batch_sizes)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["analyze", "--table", str(table), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return read_results(out)


def test_one_is_singular():
    assert counted(1, "sequences") == "1 sequence"
    assert counted(1, "examples") == "1 example"
    assert counted(2, "sequences") == "2 sequences"
    assert Setting("tokens", 35.0).said(35.0) == "35 tokens (1 sequence)"


def test_every_preference_holds_its_batch_inside_its_interval_and_costs_eq_2_11(tmp_path):
    """B_crit 2.5 examples fitted on 1..32: compute's B_crit/4 = 0.625 lies below the smallest
    batch a run can take (1 example); the batch is 1, its interval rounded likewise holds it,
    its costs are eq. 2.11's at 1 (S/S_min = 1 + 2.5 = 3.5, E/E_min = 1 + 1/2.5 = 1.4), and the
    text says the preference was clipped rather than claiming 5 S_min and 1.25 E_min."""
    results = analysed(tmp_path, 2.5, (1, 2, 4, 8, 16, 32))
    setting = Setting()
    for prefer, multiple in PREFERENCES.items():
        rec = recommend(results, prefer, setting=setting)
        assert rec.status == "fit", rec.reason
        assert rec.b_crit == pytest.approx(2.5, rel=1e-3)
        assert rec.batch_size_low <= rec.batch_size <= rec.batch_size_high, prefer
        assert rec.steps_over_min == pytest.approx(1 + rec.b_crit / rec.batch_size)
        assert rec.examples_over_min == pytest.approx(1 + rec.batch_size / rec.b_crit)
        assert rec.clipped == (multiple * 2.5 < 1)
    compute = recommend(results, "compute", setting=setting)
    assert compute.batch_size == 1 and compute.steps_over_min == pytest.approx(3.5, rel=1e-3)
    text = summary(compute.to_json())
    assert "batch size 1 example " in text and "1 examples" not in text
    assert "below the smallest batch a run can take" in text and "3.5 S_min, 1.4 E_min" in text
    # The tradeoff: B_crit/4 and B_crit/2 both round to 1 example: one row, not two.
    sizes = [row["batch_size_samples"] for row in compute.tradeoff]
    assert len(sizes) == len(set(sizes)) and sizes[0] == 1
    table = lines(compute.to_json())
    assert sum(line.strip().startswith("0.4 ") for line in table) == 1  # 1/2.5, its own multiple


def test_a_bcrit_below_the_smallest_batch_is_said_in_words_with_the_measured_rate(tmp_path):
    """B_crit 0.1 example, grid 1..16 (1 is the smallest batch a run can take): no smaller batch
    exists, so the answer is 1 example at its measured best rate, never "add smaller batch
    sizes" and never a next grid of batch sizes below one example."""
    results = analysed(tmp_path, 0.1, (1, 2, 4, 8, 16))
    for prefer in PREFERENCES:
        rec = recommend(results, prefer, setting=Setting())
        assert rec.status == "fit", rec.reason
        assert rec.bcrit_status == "below_smallest"
        assert rec.batch_size == 1 and rec.learning_rate == pytest.approx(BEST_LR)
        assert "choose the batch size for throughput" in rec.reason
        assert rec.next_grid is None
        text = summary(rec.to_json())
        assert "smaller batch sizes" not in text and "learning rate 2" in text
    paragraphs = " ".join(answers(results.fits, results.front, smallest=1.0))
    assert "Add smaller" not in paragraphs and "throughput" in paragraphs
    assert not any("add batch sizes below" in w for w in results.warnings)
    assert any("no smaller batch can run" in w for w in results.warnings)


def test_no_next_grid_below_the_data_parallel_size(tmp_path):
    """Data parallel over 4 processes, grid 4..64, B_crit far below it: no batch smaller than
    4 can run, so nothing smaller is advised; with 8..64 the next grid adds 4 and nothing else
    below, every batch a multiple of 4."""
    results = analysed(tmp_path / "a", 0.2, (4, 8, 16, 32, 64))
    rec = recommend(results, setting=Setting(data_parallel=4))
    assert rec.status == "fit" and rec.bcrit_status == "below_smallest" and rec.batch_size == 4
    results = analysed(tmp_path / "b", 0.2, (8, 16, 32, 64))
    rec = recommend(results, setting=Setting(data_parallel=4, batch_sizes=(8, 16, 32, 64)))
    assert rec.status == "bound" and rec.next_grid is not None
    sizes = rec.next_grid.batch_sizes
    assert sizes and all(b >= 4 and b % 4 == 0 for b in sizes) and min(sizes) == 4


def test_recommend_cli_says_one_sequence(tmp_path):
    """In tokens (35 a sequence), a clipped compute preference prints '1 sequence a step'."""
    results = analysed(tmp_path, 2.5 * 35, tuple(35 * b for b in (1, 2, 4, 8, 16, 32)))
    rec = recommend(results, "compute", setting=Setting("tokens", 35.0))
    data = rec.to_json()
    assert data["batch_size_samples"] == 1
    assert data["batch_size_low"] <= data["batch_size"] <= data["batch_size_high"]
    text = " ".join(lines(json.loads(json.dumps(data))))
    assert "(1 sequence a step)" in text and "1 sequences" not in text


def test_an_edge_rate_moves_at_least_the_grid_factor(tmp_path):
    """Rates a factor 2 apart at each batch size, but centred 15% apart from one batch size to
    the next (as next grids leave them: their union is dense), and every best rate on the high
    edge: the run beyond each edge is a factor 2 up, not 15%."""
    rows = []
    for i, b in enumerate((4, 8, 16, 32, 64)):
        centre = 1.15 ** i
        for lr in (centre / 2, centre, 2 * centre):
            bowl = 1 + 0.3 * math.log2(lr / (4 * centre)) ** 2
            rows.append((b, round(lr, 4), 1.0, 100 * (1 + 500 / b) * bowl))
    table = tmp_path / "steps.csv"
    pd.DataFrame(rows, columns=["batch_size", "learning_rate", "target", "steps"]).to_csv(
        table, index=False)
    result = CliRunner().invoke(app, ["analyze", "--table", str(table), "--out",
                                      str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    rec = recommend(read_results(tmp_path / "out"), setting=Setting())
    assert rec.next_grid is not None
    edges = [r for r in rec.next_grid.runs if "high edge" in r.why]
    assert len(edges) == 5
    best = {b: round(2 * 1.15 ** i, 4) for i, b in enumerate((4, 8, 16, 32, 64))}
    for run in edges:
        assert run.learning_rate / best[run.batch_size] >= 2 * 0.99, run
