"""The runs of a sweep and their logged rows, as the analysis computes on them: the folder's
reader (`gnsweep.folder.SweepFolder.run_tables`) hands over each run's row (grid point, state)
and its metrics table; this module checks the rows and lays them out (`Curves`, or the
(runs, metrics) frames), in memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from gnsweep.analysis.steps import Curves
from gnsweep.tables import CORE_METRICS, CURVE_COLUMNS

METRIC_COLUMNS = list(CORE_METRICS)
OPTIONAL_COLUMNS = [c for c in CURVE_COLUMNS if c not in METRIC_COLUMNS]
"""Columns newer than some sweeps on disk (drift, probes, exact truth): NaN where absent."""
ANALYSIS_COLUMNS = frozenset(METRIC_COLUMNS + OPTIONAL_COLUMNS)


@dataclass
class RunTables:
    """Every run of a sweep and its metrics: `runs` one row per run (run_id, batch_size,
    learning_rate, seed, state, exchange_rate, at_examples, along, problem, samples), `tables`
    each run's metrics table in the same order (None: no rows to analyse)."""

    runs: pd.DataFrame
    tables: list[pa.Table | None]

    def __post_init__(self) -> None:
        # B in the task's unit (examples per step from the metrics), once, here.
        self.runs["batch_size"] = batch_in_examples(self.runs["batch_size"].to_numpy(),
                                                    self.tables)

def rows_problem(table: pa.Table) -> str | None:
    """How a run's rows break what every analysis assumes, None when they do not: steps
    positive and strictly increasing, one row per logged optimizer step. Steps rewritten
    (repeated, negative, out of order) with the row count and the last row kept would move S,
    E and B_crit with no word; such a run is named and left out."""
    steps = table.column("step").to_numpy(zero_copy_only=False).astype(float)
    if not len(steps):
        return None
    bad = ~np.isfinite(steps) | (steps <= 0)
    if bad.any():
        i = int(np.argmax(bad))
        return (f"rewritten: step {_shown(steps[i])} at row {i + 1}; steps must be positive "
                "and strictly increasing")
    back = np.diff(steps) <= 0
    if back.any():
        i = int(np.argmax(back)) + 1
        return (f"rewritten: step {_shown(steps[i])} after step {_shown(steps[i - 1])} at row "
                f"{i + 1}; steps must be positive and strictly increasing")
    return None


def _shown(value: float) -> str:
    return str(int(value)) if np.isfinite(value) and value == int(value) else str(value)


def numeric_problem(table: pa.Table) -> str | None:
    """What breaks a metrics table's columns holding numbers (integers or floats, as
    METRICS_SCHEMA writes them): the first column that does not (a step or loss stored as
    text, say); None when every column does."""
    for field in table.schema:
        kind = field.type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)
                or pa.types.is_null(kind)):
            return f"its {field.name} column holds {kind}, not numbers"
    return None


def batch_in_examples(samples: np.ndarray, tables: list[pa.Table | None]) -> np.ndarray:
    """Each run's batch size in the task's example unit: examples per step from its metrics.

    A run's spec gives samples per step (`task.sample`'s argument); a task may count more
    examples in each (a language model's tokens). The metrics' `examples / step` is the
    examples per step of a fixed-batch run, so B, E = S B and B_crit share the unit of the
    examples column. Runs without metrics take the sweep's ratio (one task, one ratio); a
    sweep written before examples were counted per step has examples = step x B: unchanged.
    """
    out = samples.astype(np.int64).copy()
    ratios = []
    for i, table in enumerate(tables):
        if table is None or table.num_rows == 0:
            continue
        step = float(table.column("step")[-1].as_py() or 0)
        examples = float(table.column("examples")[-1].as_py() or 0)
        if step > 0 and examples > 0:
            out[i] = round(examples / step)
            if samples[i] > 0:  # an adaptive run (0 samples: its batch size varies) has its mean
                ratios.append(examples / step / samples[i])
    if ratios:
        ratio = float(np.median(ratios))
        missing = [i for i, t in enumerate(tables) if t is None or t.num_rows == 0]
        out[missing] = np.round(samples[missing] * ratio).astype(np.int64)
    return out


def _with_every_column(table: pa.Table) -> pa.Table:
    """A metrics table with every column the analysis knows (NaN where not logged)."""
    for name in METRIC_COLUMNS + OPTIONAL_COLUMNS:
        if name not in table.column_names:
            table = table.append_column(name, pa.array(np.full(table.num_rows, np.nan)))
    return table.select(METRIC_COLUMNS + OPTIONAL_COLUMNS)  # one order: the tables concatenate


def curves_of(read: RunTables) -> Curves:
    """Every run of a sweep and its logged rows as flat arrays (see `Curves`)."""
    runs, tables = read.runs, read.tables
    lengths = np.array([t.num_rows if t is not None else 0 for t in tables], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n_rows = int(offsets[-1])
    present = [t for t in tables if t is not None and t.num_rows]
    names = [set(t.column_names) for t in present]
    columns: dict[str, np.ndarray] = {}
    for name in CURVE_COLUMNS:
        # One chunk per file without nulls: to_numpy copies nothing.
        found = [t.column(name).to_numpy() if name in have else None
                 for t, have in zip(present, names, strict=True)]
        if any(part is not None and np.isfinite(part).any() for part in found):
            columns[name] = np.concatenate(
                [np.full(t.num_rows, np.nan) if part is None else part
                 for t, part in zip(present, found, strict=True)]).astype(float, copy=False)
        else:
            # A column no run logged (probes, exact truth, B_noise in most sweeps): one
            # read-only NaN view instead of n_rows fresh floats (allocating them cost as much
            # as reading the files).
            columns[name] = np.broadcast_to(np.float64(np.nan), (n_rows,))
    return Curves(runs, offsets, columns)


def run_curves(run_id: str, spec: dict[str, Any], state: str, table: pa.Table) -> Curves:
    """One run's logged rows (a branch sweep's base run) as `Curves`: `spec` its record's grid
    point (batch_size, learning_rate, seed), `table` its metrics (rows checked)."""
    table = _with_every_column(table)
    runs = pd.DataFrame([{"run_id": run_id,
                          "batch_size": int(spec.get("batch_size", 0)),
                          "learning_rate": float(spec.get("learning_rate", 0.0)),
                          "seed": int(spec.get("seed", 0)),
                          "state": state,
                          "samples": int(spec.get("batch_size", 0))}])
    runs["batch_size"] = batch_in_examples(runs["batch_size"].to_numpy(), [table])
    columns = {name: table.column(name).to_numpy().astype(float, copy=False)
               for name in CURVE_COLUMNS}
    return Curves(runs, np.array([0, table.num_rows], np.int64), columns)


def sweep_frames(read: RunTables) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, metrics) of a sweep. Runs without metrics (pending, failed) are in `runs` only."""
    runs, tables = read.runs, read.tables
    parts = [_with_every_column(t).append_column("run_id",
                                                 pa.array([run_id] * t.num_rows, pa.string()))
             for run_id, t in zip(runs["run_id"], tables, strict=True) if t is not None]
    metrics = (pa.concat_tables(parts).to_pandas() if parts
               else pd.DataFrame(columns=[*METRIC_COLUMNS, *OPTIONAL_COLUMNS, "run_id"]))
    return runs, metrics
