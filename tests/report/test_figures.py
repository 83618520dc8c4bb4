"""Every figure from a synthetic sweep with known answers: drawn, not blank, labelled, log-scaled,
and where the figure shows mathematics (eq. 2.11, 2.12, 2.7, the B_crit(L) power law) the drawn
lines satisfy it."""

from __future__ import annotations

import builtins
import io
import math
import subprocess
import sys

import matplotlib.image as mpimg
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PathCollection
from sweep_tables import BATCHES, TARGETS, b_crit, best_lr, e_min, make_tables, s_min

from gnsweep.figure_files import save
from gnsweep.report import figures as plots

# name -> (x label words, y label words, x scale, y scale) of the first data axes.
EXPECTED = {
    "pareto_fronts": ("examples", "steps", "log", "log"),
    "bcrit_vs_bsimple": ("B_simple", "B_crit", "log", "log"),
    "noise_over_training": ("step", "B_simple", "log", "log"),
    "steps_grid": ("batch size", "learning rate", "linear", "linear"),
    "best_lr": ("batch size", "learning rate", "log", "log"),
    "bcrit_vs_loss": ("target loss", "B_crit", "log", "log"),
    "loss_curves": ("step", "loss", "log", "log"),
    "noise_scale_vs_temperature": ("temperature", "B_simple", "log", "log"),
}


@pytest.fixture(scope="module")
def drawn():
    figures = plots.draw_all(make_tables())
    yield figures
    plt.close("all")


def first_axes(fig):
    return plots.axes_of(fig)[0]


def test_every_figure_is_drawn(drawn):
    assert list(drawn) == [spec.name for spec in plots.FIGURES]
    skipped = {k: v for k, v in drawn.items() if isinstance(v, str)}
    assert not skipped


@pytest.mark.parametrize("name", list(EXPECTED))
def test_figure_labels_scales_and_title(drawn, name):
    fig = drawn[name]
    ax = first_axes(fig)
    xword, yword, xscale, yscale = EXPECTED[name]
    assert xword in ax.get_xlabel()
    assert yword in ax.get_ylabel()
    assert ax.get_xscale() == xscale and ax.get_yscale() == yscale
    assert ax.get_title() or fig.get_suptitle()
    # Every data axes has both labels, with units in parentheses on the x axis.
    for axes in plots.axes_of(fig):
        assert axes.get_xlabel()
        assert "(" in axes.get_xlabel()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_figure_files_exist_and_are_not_blank(drawn, name, tmp_path):
    paths = save(drawn[name], name, tmp_path, formats=("png", "pdf", "svg"))
    assert [p.suffix for p in paths] == [".png", ".pdf", ".svg"]
    for path in paths:
        assert path.stat().st_size > 2000
    assert paths[1].read_bytes()[:5] == b"%PDF-"
    image = mpimg.imread(paths[0])[..., :3]
    not_white = (image < 0.95).any(axis=-1).mean()
    assert not_white > 0.03, f"{name}: only {not_white:.1%} of the pixels are drawn"
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 20  # colours, not one flat tone
    # Readable at paper-column size: never wider than a page.
    assert drawn[name].get_size_inches()[0] <= plots.PAGE + 1e-9


def test_pareto_lines_are_the_hyperbola_of_eq_2_11(drawn):
    ax = first_axes(drawn["pareto_fronts"])
    curves = [line for line in ax.get_lines() if len(line.get_xdata()) == 300]
    assert len(curves) == len(TARGETS)
    for line in curves:
        e, s = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
        # Which target: the curve's asymptote S -> S_min at large E.
        target = min(TARGETS, key=lambda t: abs(s.min() - s_min(t)))
        product = (s / s_min(target) - 1) * (e / e_min(target) - 1)
        np.testing.assert_allclose(product, 1.0, rtol=1e-9)
    # B_crit points at (2 E_min, 2 S_min) (eq. 2.12) and every batch size's point is shown.
    offsets = np.concatenate([c.get_offsets() for c in ax.collections
                              if isinstance(c, PathCollection)])
    for target in TARGETS:
        assert np.isclose(offsets, [2 * e_min(target), 2 * s_min(target)]).all(axis=1).any()
        for batch in BATCHES:
            s = s_min(target) + e_min(target) / batch
            assert np.isclose(offsets, [batch * s, s]).all(axis=1).any()
    labels = {text.get_text() for text in ax.texts}
    assert {str(b) for b in BATCHES} <= labels


def test_bcrit_vs_bsimple_has_error_bars_and_the_identity(drawn):
    ax = first_axes(drawn["bcrit_vs_bsimple"])
    identity = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert identity and np.allclose(identity[0].get_xdata(), identity[0].get_ydata())
    assert len(ax.containers) >= len(TARGETS)  # one errorbar container per target
    points = {(round(c.lines[0].get_xdata()[0], 6), round(c.lines[0].get_ydata()[0], 6))
              for c in ax.containers}
    for target in TARGETS:
        assert (round(0.8 * b_crit(target), 6), round(b_crit(target), 6)) in points


def test_bcrit_vs_loss_draws_the_power_law(drawn):
    ax = first_axes(drawn["bcrit_vs_loss"])
    (law,) = [line for line in ax.get_lines() if len(line.get_xdata()) == 100]
    loss = np.asarray(law.get_xdata())
    np.testing.assert_allclose(law.get_ydata(), 50.0 / loss ** 0.5, rtol=1e-12)
    assert ax.xaxis_inverted()  # lower loss, further into training, to the right


def test_best_lr_curve_is_eq_2_7():
    b = np.array([5.0, 20.0, 80.0])
    row = pd.Series({"eps_max": 1.2, "b_noise_lr": 20.0, "lr_alpha": 1.0})
    np.testing.assert_allclose(plots.lr_fit_curve(row, b), [0.24, 0.6, 0.96])
    assert plots.lr_fit_curve(pd.Series({"eps_max": math.nan}), b) is None
    assert plots.lr_fit_curve(None, b) is None


def test_steps_grid_marks_best_unreached_and_diverged(drawn):
    fig = drawn["steps_grid"]
    axes = plots.axes_of(fig)
    assert len(axes) == len(TARGETS)
    hardest = axes[-1]  # targets highest loss first
    assert "loss 0.25" in hardest.get_title()
    marks = [t.get_text() for t in hardest.texts]
    # lr 3.0 diverged at B = 8, 16; lr 0.1 never reached the lowest target at any batch size.
    assert marks.count("div") == 2
    assert marks.count("x") == len(BATCHES)
    boxes = [p for p in hardest.patches if p.get_edgecolor()[:3] != (1, 1, 1)
             and not p.get_fill() and p.get_linewidth() > 1]
    assert len(boxes) == len(BATCHES)  # one best learning rate per batch size
    assert "div: diverged" in fig.get_suptitle() and "x: not reached" in fig.get_suptitle()


def test_best_runs_are_the_best_tuned_and_never_diverged():
    tables = make_tables()
    chosen = plots.best_runs(tables.runs, tables.metrics, tables.front)
    assert list(chosen["batch_size"]) == BATCHES
    for row in chosen.itertuples(index=False):
        assert row.learning_rate == best_lr(row.batch_size) and row.reached
    # Without a front (nothing reached) it falls back to the lowest final loss, never diverged.
    empty = tables.front.iloc[:0]
    fallback = plots.best_runs(tables.runs, tables.metrics, empty)
    diverged = set(tables.runs.loc[tables.runs["state"] == "diverged", "run_id"])
    assert not set(fallback["run_id"]) & diverged
    assert not fallback["reached"].any()


def test_noise_figures_show_b_noise_when_measured(drawn):
    tables = make_tables(b_noise=True)
    ax = first_axes(plots.noise_over_training(tables.runs, tables.metrics, tables.front))
    assert "B_noise" in ax.get_ylabel()
    assert any(line.get_linestyle() == "--" for line in ax.get_lines())
    fig = plots.bcrit_vs_bsimple(tables.fits, tables.front)
    labels = [text.get_text() for legend in fig.legends for text in legend.get_texts()]
    assert "B_noise (eq. 2.8)" in labels
    # B_noise = 1.2 B_crit in the synthetic fits: hollow squares at (1.2 B_crit, B_crit).
    points = {(round(c.lines[0].get_xdata()[0], 6), round(c.lines[0].get_ydata()[0], 6))
              for c in first_axes(fig).containers}
    assert all((round(1.2 * b_crit(t), 6), round(b_crit(t), 6)) in points for t in TARGETS)
    assert not any("B_noise" in note for note in plots.notes(tables))
    assert any("B_noise not measured" in note for note in plots.notes(make_tables()))
    assert "B_noise" not in first_axes(drawn["noise_over_training"]).get_ylabel()
    plt.close("all")


def test_figures_a_sweep_cannot_support_are_skipped_with_a_reason():
    one = plots.draw_all(make_tables(targets=[0.5]))
    assert isinstance(one["bcrit_vs_loss"], str) and "at least 2" in one["bcrit_vs_loss"]
    assert not isinstance(one["pareto_fronts"], str)

    tables = make_tables()
    tables.fits = tables.fits.assign(b_crit=math.nan, s_min=math.nan, e_min=math.nan,
                                     refused="only 2 batch size(s) reached the target")
    no_fit = plots.draw_all(tables)
    assert "fit" in no_fit["bcrit_vs_bsimple"] and "fit" in no_fit["bcrit_vs_loss"]
    assert not isinstance(no_fit["pareto_fronts"], str)  # the points alone still tell

    tables.front = tables.front.iloc[:0]
    nothing = plots.draw_all(tables)
    assert "no batch size reached" in nothing["pareto_fronts"]
    for reason in (r for r in nothing.values() if isinstance(r, str)):
        assert "\n" not in reason
    plt.close("all")


def test_missing_optional_columns_draw_without_the_fit_and_say_so():
    tables = make_tables()
    tables.fits = tables.fits.drop(columns=["eps_max", "b_noise_lr", "lr_alpha", "lr_model",
                                            "lr_refused"])
    tables.front = tables.front.drop(columns=["lr_opt"])
    tables.steps = tables.steps.drop(columns=["outcome"])
    tables.bcrit_law = None
    drawn = plots.draw_all(tables)
    assert not any(isinstance(v, str) for v in drawn.values())
    assert "no fit" in first_axes(drawn["best_lr"]).get_title()
    notes = plots.notes(tables)
    assert any(n.startswith("best_lr drawn without") for n in notes)
    assert any(n.startswith("bcrit_vs_loss drawn without") for n in notes)
    plt.close("all")


def test_plotting_reads_no_files(monkeypatch):
    tables = make_tables()
    plots.draw_all(tables)  # warm up matplotlib's font cache first
    plt.close("all")

    def refuse(*args, **kwargs):
        raise AssertionError(f"plots opened a file: {args[:1]}")

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(io, "open", refuse)
    drawn = plots.draw_all(tables)
    monkeypatch.undo()
    assert not any(isinstance(v, str) for v in drawn.values())
    plt.close("all")


@pytest.mark.process
def test_plots_and_report_never_import_torch():
    code = ("import sys, gnsweep.report.figures, gnsweep.report.html, gnsweep.commands.plot; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_pareto_view_follows_the_points_when_the_fit_cannot_place_b_crit():
    tables = make_tables()
    # A degenerate fit: S_min -> 0, so B_crit = E_min/S_min is absurdly large.
    tables.fits.loc[0, ["s_min", "b_crit"]] = [1e-8, e_min(1.0) / 1e-8]
    fig = plots.pareto_fronts(tables.front, tables.fits)
    ax = first_axes(fig)
    labels = [text.get_text() for legend in fig.legends for text in legend.get_texts()]
    assert "loss 1: B_crit beyond 256" in labels
    assert "loss 0.5: B_crit ≈ 70.7" in labels  # 50 / sqrt(0.5)
    # Every measured point is in view, and the view is not stretched to S = 2e-8.
    low, high = ax.get_ylim()
    assert low <= tables.front["steps"].min() and high >= tables.front["steps"].max()
    assert low > tables.front["steps"].min() / 10
    plt.close(fig)


def test_long_runs_are_thinned_log_uniformly_keeping_both_ends():
    frame = pd.DataFrame({"step": np.arange(1, 100_001)})
    thin = plots._thin(frame)
    assert len(thin) <= plots.MAX_POINTS
    assert thin["step"].iloc[0] == 1 and thin["step"].iloc[-1] == 100_000
    # Log-uniform: 2000 points over 5 decades is 400 a decade, so every step below 100 stays
    # and the last decade keeps about 400 of its 90,000 steps.
    steps = thin["step"].to_numpy()
    assert ((steps >= 10) & (steps < 100)).sum() == 90
    assert 350 <= ((steps >= 10_000) & (steps < 100_000)).sum() <= 420


def test_axes_count_b_in_the_tasks_unit():
    """A language model's sweep (meta unit "tokens") labels every B, E and B_crit axis in tokens,
    and none in examples."""
    tables = make_tables()
    tables.meta["unit"] = "tokens"
    figures = plots.draw_all(tables)
    try:
        labels = [label for fig in figures.values() if not isinstance(fig, str)
                  for ax in plots.axes_of(fig) for label in (ax.get_xlabel(), ax.get_ylabel())]
        assert not [label for label in labels if "(examples)" in label]
        assert sum("(tokens)" in label for label in labels) >= 7
    finally:
        plt.close("all")


def test_log_axis_labels_of_large_counts_are_short():
    """Token counts in the hundreds of thousands labelled 300000400000600000 side by side."""
    from gnsweep.report.figures import plain_number

    assert [plain_number(x) for x in (0.6, 300.0, 8192.0, 40_000.0, 300_000.0, 1_200_000.0,
                                      3e9)] == ["0.6", "300", "8192", "40k", "300k", "1.2M",
                                                "3G"]


def test_a_planned_grid_of_21_learning_rates_stays_readable():
    """A grid `gnsweep plan` grew (rates 15% apart): short distinct labels, each number in its
    cell, and the report gives the page-wide figure the page's width."""
    from gnsweep.report.figures import png_bytes, steps_grid, tick_labels
    from gnsweep.report.html import PAGE_WIDE_PX, png_size

    lrs = [9.34 * 1.15**i for i in range(21)]
    labels = tick_labels(lrs)
    assert len(set(labels)) == 21 and max(map(len, labels)) <= 4  # 9.34, 10.7, ..., 153
    rows = [{"target": t, "batch_size": b, "learning_rate": lr, "seed": 0, "run_id": "r",
             "steps": 1000 / b + 50, "reached": True, "state": "done", "outcome": "reached"}
            for t in (2.3, 2.0) for b in (1, 4, 16, 64) for lr in lrs]
    steps = pd.DataFrame(rows)
    front = steps.groupby(["target", "batch_size"]).head(1)
    fig = steps_grid(steps, front)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == labels
    width, _ = png_size(png_bytes(fig))
    assert width >= PAGE_WIDE_PX
    many = pd.DataFrame([{**r, "batch_size": b} for r in rows if r["batch_size"] == 1
                         for b in [2**i for i in range(20)]])
    stacked = steps_grid(many, many.groupby(["target", "batch_size"]).head(1))
    first, second = (ax.get_position() for ax in stacked.axes[:2])
    # 20 batch sizes: one panel a row, the second target's below the first's.
    assert first.x0 == pytest.approx(second.x0) and second.y0 < first.y0
