"""The analysis's fast paths give the same numbers as the plain ones: the smoother of every run at
once against `centred_fit` run by run, and the loader that leaves all-NaN columns unread against
the values in the file."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gnsweep.analysis.load import _read_metrics
from gnsweep.analysis.smoothing import RunSmoother, centred_fit


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
