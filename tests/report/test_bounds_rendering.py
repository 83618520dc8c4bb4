"""Bounds drawn and written as bounds: the console, the figures and the report never show the
value a fit ran off to, and never stretch an axis over it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gnsweep.analysis.pipeline import analyze_steps
from gnsweep.report.answers import answers
from gnsweep.report.figures import bcrit_vs_loss
from gnsweep.report.html import fit_table


def mixed_fits() -> tuple[pd.DataFrame, pd.DataFrame]:
    """One target on a known hyperbola (B_crit 400), two a hair apart where S = E/B exactly
    (B_crit far above the batch sizes, 64..1024): a fit and two lower bounds."""
    rng = np.random.default_rng(0)
    rows = []
    laws = {2.0: (50.0, 50.0 * 400.0), 1.0: (1e-9, 3000.0), 0.99: (1e-9, 9000.0)}
    for target, (s_min, e_min) in laws.items():
        for b in (64, 128, 256, 512, 1024):
            s = (s_min + e_min / b) * math.exp(0.02 * rng.standard_normal())
            rows.append(dict(run_id=f"b{b}", batch_size=b, learning_rate=0.1, seed=0,
                             target=target, state="done", reached=True, steps=s,
                             examples=s * b, b_simple_at_target=math.nan,
                             b_simple_mean=math.nan, outcome="reached"))
    result = analyze_steps(pd.DataFrame(rows), list(laws))
    return result.fits, result.front


def test_bounds_are_arrows_at_the_grid_edge_not_decades_of_axis():
    fits, front = mixed_fits()
    assert sorted(fits["bcrit_status"]) == ["fit", "lower_bound", "lower_bound"]
    fig = bcrit_vs_loss(fits, None, front)
    low, high = fig.axes[0].get_ylim()
    assert high / low < 1e3  # before: B_crit 1e13-1e15 beside 400
    # The bounds are drawn: an arrow (annotation) per bounded target.
    assert sum(1 for child in fig.axes[0].get_children()
               if type(child).__name__ == "Annotation") == 2


def test_the_report_says_a_bound_in_words_and_in_its_table():
    fits, front = mixed_fits()
    text = " ".join(answers(fits, front))
    assert text.count("only bounds the largest useful batch size") == 2
    assert "above the largest batch size measured (1024)" in text
    table = fit_table(fits)
    assert table.count("&gt; 1024") == 2 and "e+1" not in text + table
