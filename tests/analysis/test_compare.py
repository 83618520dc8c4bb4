"""`gnsweep compare` on two real tiny sweeps (digits and linreg), and the pure comparison."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from gnsweep import store
from gnsweep.analysis.crit_vs_simple import (
    COMPARE_COLUMNS,
    SweepFits,
    compare_rows,
    log_error_bars,
    within_factor,
)
from gnsweep.cli import app

runner = CliRunner()
LINREG_TINY = ["task=linreg", "sweep=linreg", "sweep.name=linreg_tiny",
               "sweep.batch_sizes=[8,32,128]", "sweep.learning_rates=[0.4,1.6]",
               "sweep.max_steps=800"]


@pytest.fixture(scope="module")
def linreg_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("linreg") / "linreg"
    result = runner.invoke(app, ["launch", *LINREG_TINY, "--sweep-dir", str(out),
                                 "--workers", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def analysed(tiny_sweep, linreg_sweep):
    for folder in (tiny_sweep, linreg_sweep):
        result = runner.invoke(app, ["analyze", str(folder)])
        assert result.exit_code == 0, result.output
    return tiny_sweep, linreg_sweep


def test_compare_two_real_sweeps(analysed, tmp_path):
    digits, linreg = analysed
    out = tmp_path / "compare"
    result = runner.invoke(app, ["compare", str(digits), str(linreg), "--out", str(out)])
    assert result.exit_code == 0, result.output
    table = pq_read(out / "compare.parquet")
    assert table.schema.equals(store.COMPARE_SCHEMA)
    frame = table.to_pandas()
    assert list(frame.columns) == COMPARE_COLUMNS
    # One row per sweep x target, the sweeps' own targets (conf/sweep/tiny.yaml, linreg.yaml).
    assert sorted(frame.loc[frame["task"] == "digits", "target"]) == [0.2, 0.3, 0.5]
    assert sorted(frame.loc[frame["task"] == "linreg", "target"]) == [0.15, 0.2, 0.5]
    assert set(frame["sweep"]) == {digits.name, linreg.name}
    assert set(frame["unit"]) == {"examples"}
    assert set(frame["metric"]) == {"loss"} and not frame["higher_is_better"].any()
    # ratio is B_crit / B_simple_mean (eq. 2.12 over the S_min-weighted mean noise scale).
    fitted = frame[np.isfinite(frame["b_crit"])]
    assert len(fitted) >= 4
    np.testing.assert_allclose(fitted["ratio"], fitted["b_crit"] / fitted["b_simple_mean"],
                               rtol=1e-12)
    # Every B is a batch size in examples of these sweeps: positive, and B_simple is measured.
    assert (fitted["b_simple_mean"] > 0).all()
    # B_noise is not measured in these sweeps: NaN, not zero.
    assert frame["b_noise_mean"].isna().all()
    for name in ("bcrit_vs_noise_scale", "noise_scale_vs_target"):
        for fmt in ("png", "pdf"):
            assert (out / f"{name}.{fmt}").stat().st_size > 1000
    assert "digits" in result.output and "linreg" in result.output


def pq_read(path):
    import pyarrow.parquet as pq

    return pq.read_table(path)


def test_compare_refuses_a_folder_not_analysed(tiny_sweep, analysed, tmp_path):
    raw = tmp_path / "raw"
    shutil.copytree(tiny_sweep, raw)
    for name in ("fits.parquet", "steps.parquet", "front.parquet"):
        (raw / name).unlink(missing_ok=True)
    out = tmp_path / "out"
    result = runner.invoke(app, ["compare", str(analysed[0]), str(raw), "--out", str(out)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "not an analysed sweep" in lines[0]
    assert f"gnsweep analyze {raw}" in lines[0]
    assert not out.exists()  # nothing written when one folder is bad


@pytest.mark.parametrize("make", [lambda p: p, lambda p: (p.mkdir(), p)[1]])
def test_compare_refuses_a_folder_that_is_not_a_sweep(tmp_path, make):
    folder = make(tmp_path / "nothing")
    result = runner.invoke(app, ["compare", str(folder), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert "gnsweep launch" in result.output


def _fits(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows)


def test_compare_rows_keeps_refused_targets_and_missing_columns():
    a = SweepFits("digits", "a", "/x/a", "loss", False, "examples", _fits([
        {"target": 0.3, "b_crit": 100.0, "b_crit_se": 10.0, "b_simple_mean": 50.0,
         "b_simple_mean_se": 5.0, "ratio": 2.0, "ratio_se": 0.3, "refused": "",
         "n_batch_sizes": 5},
        {"target": 0.1, "b_crit": math.nan, "refused": "only 2 batch size(s) reached",
         "n_batch_sizes": 2}]))
    b = SweepFits("cartpole", "b", "/x/b", "return", True, "environment steps", _fits([
        {"target": 100.0, "b_crit": 800.0, "b_simple_mean": 400.0, "ratio": 2.0,
         "n_batch_sizes": 4}]))
    out = compare_rows([a, b])
    assert list(out.columns) == COMPARE_COLUMNS and len(out) == 3
    assert out["refused"].tolist() == ["", "only 2 batch size(s) reached", ""]
    assert math.isnan(out["b_crit"].iloc[1])
    assert out["unit"].tolist() == ["examples", "examples", "environment steps"]
    assert out["higher_is_better"].tolist() == [False, False, True]
    assert math.isnan(out["b_noise_mean"].iloc[2]) and out["quality"].iloc[2] == ""
    assert within_factor(out, 3).tolist() == [True, False, True]


def test_log_error_bars_stop_above_zero():
    bars = log_error_bars(np.array([10.0, 10.0, 10.0]), np.array([2.0, 50.0, math.nan]))
    np.testing.assert_allclose(bars, [[2.0, 9.0, 0.0], [2.0, 50.0, 0.0]])


def test_the_headline_figure_shows_an_adaptive_optimizers_b_simple_p_beside_b_simple():
    from gnsweep.report.compare_figures import bcrit_vs_noise_scale

    sgd = SweepFits("digits", "a", "/x/a", "loss", False, "examples", _fits([
        {"target": 0.3, "b_crit": 100.0, "b_simple_mean": 50.0, "n_batch_sizes": 5}]))
    adam = SweepFits("chars", "b", "/x/b", "loss", False, "tokens", _fits([
        {"target": 2.0, "b_crit": 900.0, "b_simple_mean": 200.0,
         "b_simple_precond_mean": 700.0, "n_batch_sizes": 5}]))
    fig = bcrit_vs_noise_scale(compare_rows([sgd, adam]))
    ax = fig.axes[0]
    hollow = [line for line in ax.get_lines()
              if line.get_markerfacecolor() == "white" and len(line.get_xdata())]
    # One hollow point, at chars' B_simple_P on its B_crit; none for the SGD sweep.
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in hollow] == [
        ([700.0], [900.0])]
    assert any("B_{simple,P}" in t.get_text() for t in ax.get_legend().get_texts())
    lo, hi = ax.get_xlim()
    assert lo < 50.0 and hi > 900.0
    fig.clf()


def test_the_printed_comparison_shows_bounds_as_bounds_in_aligned_columns():
    from gnsweep.report.console import format_compare

    lm = SweepFits("nanolm.make_task", "lm", "/x/lm", "loss", False, "tokens", _fits([
        {"target": 3.7, "b_crit": 4298.0, "b_crit_se": 330.0, "b_simple_mean": 5145.0,
         "ratio": 0.84, "refused": "", "bcrit_status": "fit", "n_batch_sizes": 7,
         "at_examples": 16384},
        {"target": 3.5, "b_crit": math.nan, "refused": "B_crit above 8192: add larger ones",
         "bcrit_status": "lower_bound", "b_crit_bound": 8192.0, "n_batch_sizes": 5},
        {"target": 3.3, "b_crit": math.nan, "refused": "only 2 batch size(s) reached",
         "bcrit_status": "refused", "n_batch_sizes": 2}]))
    table = compare_rows([lm])
    assert table["bcrit_status"].tolist() == ["fit", "lower_bound", "refused"]
    lines = format_compare(table).splitlines()
    assert "> 8192" in lines[2] and "no fit" not in lines[2]
    assert " lm @16,384 " in lines[1] and "@" not in lines[2]  # a branch sweep's point
    assert "(no fit: only 2 batch size(s) reached)" in lines[3]
    # Every column starts where its header does, however long the task's name.
    start = lines[0].index("B_crit")
    assert lines[1][start:].startswith("4298") and lines[2][start:].startswith("> 8192")


def test_sgds_b_simple_p_is_b_simple_and_is_not_shown_twice():
    """With SGD P is the identity: b_simple_precond_mean is b_simple_mean to the bit. The
    tables keep the column; the figure and the printed table do not repeat it."""
    from gnsweep.report.compare_figures import bcrit_vs_noise_scale
    from gnsweep.report.console import format_compare

    sgd = SweepFits("digits", "a", "/x/a", "loss", False, "examples", _fits([
        {"target": t, "b_crit": 100.0 * (i + 1), "b_simple_mean": 60.0 * (i + 1),
         "b_simple_precond_mean": 60.0 * (i + 1), "ratio": 1.67, "ratio_precond": 1.67,
         "n_batch_sizes": 5} for i, t in enumerate((0.3, 0.1))]))
    table = compare_rows([sgd])
    assert (table["b_simple_precond_mean"] == table["b_simple_mean"]).all()
    ax = bcrit_vs_noise_scale(table).axes[0]
    assert not [line for line in ax.get_lines() if line.get_markerfacecolor() == "white"]
    assert "ratio (P)" not in format_compare(table)
