"""The analysis's fast paths give the same numbers as the plain ones: the smoother of every run at
once against `centred_fit` run by run, and the loader that leaves all-NaN columns unread against
the values in the file."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gnsweep.analysis.smoothing import RunSmoother, centred_fit, first_reach
from gnsweep.analysis.steps import CURVE_COLUMNS, MIN_REACH_UPDATES, Curves, steps_to_target
from gnsweep.folder import read_metrics_file as _read_metrics


def test_every_run_at_once_equals_run_by_run() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 200, size=120)
    lengths[:4] = [0, 1, 2, 40_000]  # empty, single-point and a run longer than a chunk
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    x = np.concatenate([np.sort(rng.choice(np.arange(5e4), size=n, replace=False)) if i % 2
                        else np.sort(rng.uniform(0, 30, n)) for i, n in enumerate(lengths)])
    y = rng.normal(size=len(x))
    y[rng.random(len(x)) < 0.1] = np.nan
    x[offsets[10] + 3] = np.nan  # runs the shared prefix sums cannot take: NaN x,
    x[offsets[12] + 5] = x[offsets[12] + 6] + 1.0  # x going back
    min_half = rng.uniform(0, 8, len(lengths))
    smoother = RunSmoother(x, y, offsets)
    for fraction in (0.0, 0.1, 0.2, 0.4):
        expected = np.concatenate([
            centred_fit(x[a:b], y[a:b], fraction, min_half[i])
            for i, (a, b) in enumerate(itertools.pairwise(offsets))])
        assert np.array_equal(smoother.fit(fraction, min_half), expected, equal_nan=True)


def test_runs_of_one_length_with_and_without_nan_equal_run_by_run() -> None:
    """Chunks whose runs share one length take one cumsum per sum, and chunks without a NaN
    loss count each window by its edges: the same numbers as `centred_fit` run by run."""
    rng = np.random.default_rng(1)
    length, n_runs = 300, 150  # several chunks of equal runs
    offsets = np.arange(n_runs + 1) * length
    x = np.tile(np.arange(length, dtype=float), n_runs)
    y = rng.normal(size=len(x))
    y[offsets[100]:offsets[120]][rng.random(20 * length) < 0.2] = np.nan  # some chunks not dense
    min_half = np.repeat([1.0, 3.0], n_runs // 2)
    smoother = RunSmoother(x, y, offsets)
    for fraction in (0.1, 0.2, 0.4):
        expected = np.concatenate([
            centred_fit(x[a:b], y[a:b], fraction, min_half[i])
            for i, (a, b) in enumerate(itertools.pairwise(offsets))])
        assert np.array_equal(smoother.fit(fraction, min_half), expected, equal_nan=True)


def test_first_crossings_of_all_runs_equal_first_reach_run_by_run() -> None:
    """Steps-to-target of every run at once, for runs of one length (one search over a grid)
    and of different lengths (a search per run), against `first_reach` on each run's curve."""
    rng = np.random.default_rng(2)
    for lengths in (np.full(40, 50), rng.integers(0, 80, 40)):
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        step = np.concatenate([np.arange(1, n + 1, dtype=float) for n in lengths])
        loss = np.exp(-step / rng.uniform(5, 40, len(step))) + rng.normal(0, 0.05, len(step))
        runs = pd.DataFrame({"run_id": [f"r{i}" for i in range(len(lengths))],
                             "batch_size": 8, "learning_rate": 0.1, "seed": 0, "state": "done"})
        columns = {name: np.full(len(step), np.nan) for name in CURVE_COLUMNS}
        columns.update(step=step, loss=loss)
        targets = [0.8, 0.5, 0.2]
        steps = steps_to_target(Curves(runs, offsets, columns), None, targets, loss="raw")
        for target in targets:
            found = steps[steps["target"] == target]["steps"].to_numpy()
            # Never inside the first step: a crossing counts at least one update.
            expected = [max(first_reach(step[a:b] - 1.0, loss[a:b], target), MIN_REACH_UPDATES)
                        for a, b in itertools.pairwise(offsets)]
            assert np.array_equal(found, expected, equal_nan=True), target


def test_all_nan_columns_are_skipped_and_sparse_ones_read(tmp_path) -> None:
    n = 6
    nan = np.full(n, np.nan)
    sparse = nan.copy()
    sparse[-1] = 3.5  # a number in the last row group only
    columns = {"step": np.arange(1, n + 1), "examples": 8 * np.arange(1, n + 1),
               "loss": np.linspace(2, 1, n), "loss_smooth": nan, "eval_loss": nan,
               "b_simple": sparse, "b_noise": nan, "probe_g2": nan}
    path = tmp_path / "metrics.parquet"
    pq.write_table(pa.table(columns), path, row_group_size=2)  # three row groups
    table = _read_metrics(path)
    assert set(table.column_names) == {"step", "examples", "loss", "b_simple"}
    assert np.array_equal(table.column("b_simple").to_numpy(), sparse, equal_nan=True)
    assert np.array_equal(table.column("loss").to_numpy(), columns["loss"])
