"""`gnsweep analyze` never dies with a traceback on a table a sweep can produce: property-based
tests over degenerate and random steps tables and loss curves (two targets a hair apart, one
batch size, every run at one step, huge and tiny values, NaNs, one learning rate). Either the
analysis refuses the whole table with one line (AnalysisError), or every number it writes lies
where the grid supports it and every refusal or bound carries its reason."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gnsweep import store
from gnsweep.analysis.along import BranchPoint, analyze_along
from gnsweep.analysis.bounds import FIT, STATUSES, SUPPORT_FACTOR
from gnsweep.analysis.lr import ALPHA_RANGE
from gnsweep.analysis.pipeline import AnalysisError, analyze_steps, analyze_tables
from gnsweep.analysis.results import Results
from gnsweep.analysis.steps import curves_from_frames
from gnsweep.report.console import format_fits

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

batch_sizes = st.lists(st.sampled_from([1, 2, 8, 64, 128, 1000, 8192, 2**20]), min_size=1,
                       max_size=6, unique=True)
step_values = st.one_of(st.floats(1e-9, 1e12), st.just(math.nan), st.just(1.0),
                        st.sampled_from([0.5, 2.0, 100.0]))


def targets_strategy() -> st.SearchStrategy[list[float]]:
    close = st.floats(1e-6, 1e3).map(lambda t: [t, t * (1 - 1e-9)])
    spread = st.lists(st.floats(1e-6, 1e3), min_size=1, max_size=3, unique=True)
    return st.one_of(close, spread)


@st.composite
def steps_tables(draw) -> tuple[pd.DataFrame, list[float]]:
    batches = draw(batch_sizes)
    lrs = draw(st.one_of(st.just([math.nan]), st.just([0.1]),
                         st.lists(st.floats(1e-6, 10.0), min_size=1, max_size=3, unique=True)))
    targets = draw(targets_strategy())
    one_step = draw(st.booleans())  # every run at one step
    rows = []
    for target in targets:
        for b in batches:
            for lr in lrs:
                steps = 1.0 if one_step else draw(step_values)
                reached = math.isfinite(steps) and draw(st.booleans() | st.just(True))
                last = draw(st.one_of(st.just(math.nan), st.floats(1.0, 1e12)))
                rows.append(dict(
                    run_id=f"b{b}_lr{lr}", batch_size=b, learning_rate=lr, seed=0,
                    target=target, state=draw(st.sampled_from(["done", "done", "running"])),
                    reached=reached, steps=steps if reached else math.nan,
                    examples=steps * b if reached else math.nan,
                    b_simple_at_target=draw(st.one_of(st.just(math.nan), st.floats(-1e9, 1e9))),
                    b_simple_mean=math.nan, outcome="reached" if reached else "not_reached",
                    min_loss=target, last_step=last,
                    lr_share=draw(st.one_of(st.just(math.nan), st.floats(0.0, 1.0)))))
    return pd.DataFrame(rows), targets


def check(result: Results) -> None:
    """No absurd number: every fitted scale inside its grid's support, every other one NaN with
    its reason; the console, fits.json and the parquet tables all written without error."""
    for fit in result.fits.to_dict(orient="records"):
        assert fit["bcrit_status"] in STATUSES
        if fit["bcrit_status"] != FIT:
            assert fit["bcrit_reason"] and fit["refused"], fit
            assert math.isnan(fit["b_crit"]) and math.isnan(fit["b_crit_se"])
            continue
        used = result.front[(result.front["target"] == fit["target"])
                            & result.front["in_fit"].astype(bool)]["batch_size"]
        low, high = used.min() / SUPPORT_FACTOR, used.max() * SUPPORT_FACTOR
        assert low <= fit["b_crit"] <= high and not fit["b_crit_se"] > fit["b_crit"]
        for name in ("b_crit_window_lo", "b_crit_window_hi"):
            assert not fit[name] > high and not fit[name] < low
    for lr in result.lr_fits.to_dict(orient="records"):
        assert lr["status"] in STATUSES
        if lr["status"] != FIT:
            assert lr["refused"] and math.isnan(lr["b_noise"]) and math.isnan(lr["alpha"])
        else:
            assert ALPHA_RANGE[0] <= lr["alpha"] <= ALPHA_RANGE[1]
            assert not lr["b_noise_se"] > lr["b_noise"]
    law = result.loss_scaling.iloc[0]
    assert law["refused"] or (1e-30 <= law["b_star"] <= 1e30)
    format_fits(result.fits, result.loss_scaling)
    result.to_json()
    with tempfile.TemporaryDirectory() as out:
        store.write_results(Path(out), result)


@SETTINGS
@given(steps_tables())
def test_any_steps_table_is_analyzed_or_refused_in_one_line(table):
    steps, targets = table
    try:
        result = analyze_steps(steps, targets)
    except AnalysisError as err:
        assert str(err) and "\n" not in str(err)
        return
    check(result)


@st.composite
def loss_curves(draw) -> tuple[pd.DataFrame, pd.DataFrame, list[float]]:
    batches = draw(st.lists(st.sampled_from([1, 4, 32, 256, 4096]), min_size=1, max_size=4,
                            unique=True))
    lrs = draw(st.lists(st.sampled_from([1e-3, 1e-2, 0.1]), min_size=1, max_size=2, unique=True))
    level = draw(st.sampled_from([1e-12, 1e-3, 1.0, 1e6, 1e15]))
    runs, rows = [], []
    for b in batches:
        for lr in lrs:
            run_id = f"b{b}_lr{lr:g}"
            runs.append(dict(run_id=run_id, batch_size=b, learning_rate=lr, seed=0,
                             state="done", at_examples=1000))
            n = draw(st.integers(1, 8))
            losses = draw(st.lists(st.one_of(st.floats(0.0, 10.0).map(lambda x: x * level),
                                             st.just(math.nan)), min_size=n, max_size=n))
            decay = draw(st.sampled_from([None, 1.0, 0.01]))
            for i, loss in enumerate(losses):
                lr_now = lr if decay is None else lr * max(decay, 1 - i / n)
                rows.append(dict(run_id=run_id, step=i + 1, examples=(i + 1) * b, loss=loss,
                                 lr=lr_now))
    targets = draw(st.one_of(
        st.just([level * 5.0, level * 5.0 * (1 - 1e-9)]),
        st.lists(st.floats(0.1, 9.0).map(lambda x: x * level), min_size=1, max_size=2,
                 unique=True)))
    return pd.DataFrame(runs), pd.DataFrame(rows), targets


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(loss_curves())
def test_any_loss_curves_are_analyzed_or_refused_in_one_line(data):
    runs, metrics, targets = data
    try:
        result = analyze_tables(runs, metrics, targets)
    except AnalysisError as err:
        assert str(err) and "\n" not in str(err)
    else:
        check(result)
    # The same runs as branch runs from one point: along.parquet's rows all carry a reason.
    curves = curves_from_frames(runs, metrics)
    point = BranchPoint(1000, 10, float(np.nanmax([targets[0] * 1.1, 1e-300])))
    try:
        along = analyze_along(curves, [point], [0.97, 0.94, 0.9])
    except AnalysisError as err:
        assert str(err) and "\n" not in str(err)
        return
    for row in along.along.to_dict(orient="records"):
        assert row["bcrit_status"] in STATUSES
        if row["bcrit_status"] != FIT:
            assert row["bcrit_reason"] and row["refused"] and math.isnan(row["b_crit"])
