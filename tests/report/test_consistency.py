"""A report that agrees with itself: the answer, its caveats, the robustness label and the
figures' captions come from the same numbers (`gnsweep.report.answers`), batch sizes are in the
task's unit, and a branch sweep's answers name their branch point."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from sweep_tables import make_tables

from gnsweep.analysis.along import ALONG_COLUMNS
from gnsweep.config import Config, SweepConfig, TaskConfig
from gnsweep.report.answers import along_answers, answers, trend
from gnsweep.report.figures import ALONG_FIGURE, FIGURES
from gnsweep.report.html import along_section, grid_summary


def _bounded_tables():
    """Target 0.25 reached only by batch sizes 8..64; its fit puts B_crit at 100, above them
    (the analysis's quality says the sweep only bounds it), though inside the grid's 8..256."""
    tables = make_tables()
    late = (tables.front["target"] == 0.25) & (tables.front["batch_size"] > 64)
    tables.front.loc[late, ["steps", "examples"]] = math.nan
    row = tables.fits["target"] == 0.25
    tables.fits.loc[row, "quality"] = ("above the largest batch size (8..64); the sweep only "
                                       "bounds it, add batch sizes above")
    return tables


def test_a_bounded_b_crit_is_never_an_answer_without_its_caveat():
    tables = _bounded_tables()
    text = answers(tables.fits, tables.front)
    (bounded,) = [t for t in text if t.startswith("At loss 0.25")]
    assert "100" in bounded
    assert "extrapolated" in bounded and "only bounds it" in bounded
    assert "(8 to 64)" in bounded
    # Within the batch sizes that reached them, the others carry no such caveat.
    assert not any("extrapolat" in t for t in text if not t.startswith("At loss 0.25"))


@pytest.mark.parametrize(("se", "label"), [(0.1, "robust)"), (0.59, "not robust: its standard "
                                                                     "error is 59% of it")])
def test_robust_only_where_the_error_is_small_too(se, label):
    tables = make_tables()
    fits = tables.fits
    fits["b_crit_window_lo"], fits["b_crit_window_hi"] = fits["b_crit"] * 0.95, fits["b_crit"]
    fits["b_crit_window_spread"] = 0.05
    fits["b_crit_se"] = se * fits["b_crit"]
    text = answers(fits, tables.front)
    assert all(label in t for t in text), text


def test_an_extrapolated_b_crit_is_not_robust():
    tables = _bounded_tables()
    fits = tables.fits
    fits["b_crit_window_lo"], fits["b_crit_window_hi"] = fits["b_crit"] * 0.95, fits["b_crit"]
    fits["b_crit_window_spread"] = 0.05
    (bounded,) = [t for t in answers(fits, tables.front) if t.startswith("At loss 0.25")]
    assert "not robust: it lies outside the batch sizes that reached the target" in bounded


@pytest.mark.parametrize(("factors", "word"), [([1.0, 1.5, 2.0], "grows"),
                                               ([2.0, 1.5, 1.0], "falls"),
                                               ([1.0, 1.05, 0.98], "no clear trend")])
def test_captions_follow_the_datas_trend(factors, word):
    """B_crit against the target loss: the caption says what the fitted values do from the
    first target reached to the last, not what theory expects."""
    tables = make_tables()
    tables.fits["b_crit"] = [50.0 * f for f in factors]  # targets 1, 0.5, 0.25: training order
    spec = {s.name: s for s in FIGURES}["bcrit_vs_loss"]
    assert word in spec.caption_for(tables)
    assert "grows as training goes on" not in spec.caption_for(tables) or word == "grows"


def test_trend_needs_a_real_change():
    assert trend(np.array([1.0, 2.0, 4.0]), np.array([10.0, 20.0, 40.0])) == "grows"
    assert trend(np.array([1.0, 2.0, 4.0]), np.array([40.0, 20.0, 10.0])) == "falls"
    assert trend(np.array([1.0, 2.0]), np.array([10.0, 11.0])) == "flat"
    assert trend(np.array([1.0]), np.array([10.0])) == ""


def test_the_grid_lists_batch_sizes_in_the_tasks_unit():
    """An LM's sweep names windows per step; the report, like the analysis, counts tokens."""
    config = Config(task=TaskConfig(name="chars"),
                    sweep=SweepConfig(batch_sizes=[2, 4], learning_rates=[0.01], targets=[2.0]))
    runs = pd.DataFrame({"run_id": ["a", "b"], "batch_size": [128, 256], "state": "done"})
    html = grid_summary(config, runs)
    assert "128, 256 tokens (2, 4 samples per step)" in html


def _along() -> pd.DataFrame:
    rows = []
    for at, step, b_crit, tol in ((32_768, 64, 1_000.0, 3_000.0), (131_072, 256, 800.0, 900.0)):
        for k, target in enumerate((0.98, 0.96, 0.94)):
            row = dict.fromkeys(ALONG_COLUMNS, math.nan)
            row.update(at_examples=at, at_step=step, at_loss=2.5, target=target,
                       target_value=2.5 * target, n_runs=12, n_batch_sizes=5,
                       b_crit=b_crit * (1 + 0.1 * k), b_crit_se=0.1 * b_crit, s_min=10.0,
                       e_min=10.0 * b_crit, b_simple=700.0, quality="", refused="",
                       target_source="auto", window=65_536.0, b_crit_tol=tol,
                       b_crit_tol_lo=512.0, b_crit_tol_hi=4096.0, tolerance=0.5,
                       tol_refused="")
            rows.append(row)
    return pd.DataFrame(rows, columns=ALONG_COLUMNS)


def test_along_answers_name_their_branch_point():
    text = along_answers(_along(), "tokens")
    assert len(text) == 2
    assert text[0].startswith("At 32,768 tokens (step 64) of the base run, loss 2.5:")
    assert "by tolerance the local B_crit is about 3,000 tokens" in text[0]
    assert "1,000 tokens at loss 2.45" in text[0] and "B_simple there was about 700" in text[0]
    html = "\n".join(along_section(_along(), {}, "loss", "tokens"))
    assert "At 131,072 tokens (step 256)" in html and "branch point (tokens)" in html


def test_along_answers_give_bounds_at_the_grid_edge():
    """Every batch size within tolerance: the tolerance rule only bounds the local B_crit, at
    the largest batch size as it is (4,096, not "4,100"); so does an eq. 2.11 bound."""
    along = _along()
    along["bcrit_status"] = "fit"
    first = along["at_examples"] == 32_768
    along.loc[first, ["b_crit_tol", "b_crit_tol_hi"]] = math.nan
    along.loc[first, "b_crit_tol_lo"] = 4096.0
    along.loc[first, "tol_refused"] = "all batch sizes within tolerance: above 4096"
    along.loc[0, ["b_crit", "b_crit_se", "bcrit_status", "b_crit_bound"]] = [
        math.nan, math.nan, "upper_bound", 256.0]
    text = along_answers(along, "tokens")[0]
    assert "by tolerance the local B_crit is above 4,096 tokens (every batch size stayed" in text
    assert "below 256 tokens at loss 2.45" in text


def test_the_along_caption_follows_the_points():
    """Falling from the first point to the second: the caption says so (a fixed caption said
    the critical batch size grows as training goes on)."""
    tables = make_tables()
    tables.along = _along()
    caption = ALONG_FIGURE.caption_for(tables)
    assert "falls" in caption and "grows" not in caption


def test_the_best_lr_caption_names_the_grid_edge_instead_of_a_trend():
    """Best rates on the learning-rate grid's edge are bounds, which the analysis warns about:
    the caption says so rather than 'no clear trend' (nor any trend they cannot show)."""
    tables = make_tables()
    spec = {s.name: s for s in FIGURES}["best_lr"]
    front = tables.front
    front["lr_on_edge"] = False
    inside = spec.caption_for(tables)
    assert "edge" not in inside and "with B." in inside
    front.loc[front["batch_size"] >= 128, "lr_on_edge"] = True
    edged = spec.caption_for(tables)
    sizes = ", ".join(f"{b:g}" for b in sorted(front.loc[front["batch_size"] >= 128,
                                                         "batch_size"].unique()))
    assert f"at B = {sizes} the best rate sits on the learning-rate grid's edge" in edged
    front["lr_on_edge"] = True
    alone = spec.caption_for(tables)
    assert "no clear trend" not in alone and "shows no trend yet" in alone


def test_analyze_prints_the_reports_robustness_sentence():
    """`gnsweep analyze`'s table carries the robustness sentence of the report, word for word."""
    from gnsweep.report.console import format_fits
    from gnsweep.tables import RESULT_SCHEMAS

    tables = make_tables()
    fits = tables.fits
    for field in RESULT_SCHEMAS["fits"]:  # every column the printed table reads
        if field.name not in fits:
            fits[field.name] = "" if str(field.type) == "string" else \
                0 if "int" in str(field.type) else math.nan
    fits["b_crit_window_lo"], fits["b_crit_window_hi"] = fits["b_crit"] * 0.95, fits["b_crit"]
    fits["b_crit_window_spread"] = 0.05
    fits["b_crit_se"] = 0.59 * fits["b_crit"]
    printed = format_fits(fits, front=tables.front)
    for sentence in answers(fits, tables.front):
        note = sentence[sentence.index(" Smoothing the loss"):].strip()
        assert note in printed
    assert "not robust: its standard error is 59% of it" in printed
