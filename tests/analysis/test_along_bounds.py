"""A branch sweep's fit of eq. 2.11 whose B_crit lies outside the batch sizes it was fitted on
is one verdict everywhere: a bound in along.parquet, in the console and in the answers."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gnsweep.analysis.along import ALONG_COLUMNS, extrapolated_bound
from gnsweep.report.answers import along_answers
from gnsweep.report.console import format_along


def _row(b_crit: float) -> dict:
    row: dict = dict.fromkeys(ALONG_COLUMNS, math.nan)
    row.update(at_examples=4096, at_step=512, at_loss=0.3, target=0.9, target_value=0.27,
               n_runs=12, n_batch_sizes=4, s_min=20.0, s_min_se=2.0, e_min=306.0,
               e_min_se=30.0, b_crit=b_crit, b_crit_se=0.2 * b_crit, b_simple=30.0,
               b_noise=35.0, quality="", refused="", bcrit_status="fit", bcrit_reason="",
               tolerance=0.1, tol_refused="no window", target_source="set",
               ratio=b_crit / 30.0, ratio_se=1.0)
    return row


def _front(batch_sizes: list[int]) -> pd.DataFrame:
    return pd.DataFrame({"target": 0.27, "batch_size": batch_sizes, "in_fit": True})


def test_a_fit_above_the_batch_sizes_fitted_is_a_bound_everywhere():
    """B_crit 15.3 fitted on batch sizes 1..8: the table says lower_bound at 8 with no value,
    the console prints "> 8" and the answer "above 8", and none shows 15.3."""
    row = _row(15.3)
    extrapolated_bound(row, _front([1, 2, 4, 8]))
    assert row["bcrit_status"] == "lower_bound" and row["b_crit_bound"] == 8
    assert np.isnan(row["b_crit"]) and np.isnan(row["ratio"])
    assert "only a bound" in row["refused"]
    table = pd.DataFrame([row], columns=ALONG_COLUMNS)
    console = format_along(table)
    assert "> 8" in console and "15.3" not in console
    (answer,) = along_answers(table)
    assert "above 8" in answer and "15" not in answer.split("eq. 2.11")[1]


def test_a_fit_inside_the_batch_sizes_fitted_stays_a_fit():
    row = _row(5.0)
    extrapolated_bound(row, _front([1, 2, 4, 8]))
    assert row["bcrit_status"] == "fit" and row["b_crit"] == 5.0
    row = _row(0.5)
    extrapolated_bound(row, _front([1, 2, 4, 8]))
    assert row["bcrit_status"] == "upper_bound" and row["b_crit_bound"] == 1
