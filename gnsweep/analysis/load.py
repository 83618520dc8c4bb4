"""Reading a sweep folder: runs (one row per run) and their logged metrics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gnsweep import store
from gnsweep.analysis.steps import Curves
from gnsweep.runs import verify_folder
from gnsweep.tables import CORE_METRICS, CURVE_COLUMNS

METRIC_COLUMNS = list(CORE_METRICS)
OPTIONAL_COLUMNS = [c for c in CURVE_COLUMNS if c not in METRIC_COLUMNS]
"""Columns newer than some sweeps on disk (drift, probes, exact truth): NaN where absent."""
ANALYSIS_COLUMNS = frozenset(METRIC_COLUMNS + OPTIONAL_COLUMNS)


def _read_runs(sweep_dir: Path, skip_corrupt: bool) -> tuple[pd.DataFrame, list[pa.Table | None]]:
    # Every run file checked against config.yaml first: a run of another task or recipe would
    # change the answer (refused, named).
    _, specs = verify_folder(sweep_dir)
    runs, tables = [], []
    for run_id, spec in specs.items():
        path = store.run_dir(sweep_dir, run_id)
        status = store.read_status(path)
        state = status.state.value
        row = {"run_id": run_id, "batch_size": spec.batch_size,
               "learning_rate": spec.learning_rate, "seed": spec.seed, "state": state,
               "exchange_rate": spec.exchange_rate, "at_examples": spec.at_examples,
               "along": spec.along, "problem": "", "samples": spec.batch_size}
        table = None
        if state in store.FINISHED:
            # A finished run without readable metrics, or whose rows disagree with what it
            # recorded, is named, never dropped or analysed in silence.
            if not (path / store.METRICS).exists() or (path / store.METRICS).is_symlink():
                row.update(state="corrupt", problem=f"recorded {state}, but its "
                           f"{store.METRICS} is missing")
            else:
                try:
                    table = _read_metrics(path / store.METRICS)
                    problem = _disagrees(path, table, status)
                    if problem is not None:
                        row.update(state="corrupt", problem=f"recorded {state}, but its "
                                   f"{store.METRICS} is {problem}")
                        table = None
                except store.StoreError as err:
                    if not skip_corrupt:
                        raise store.StoreError(
                            f"{err}; relaunch the sweep (the same `gnsweep launch ... "
                            f"--sweep-dir {sweep_dir}` command) to run that run again, or "
                            f"leave it out: gnsweep analyze {sweep_dir} --skip-corrupt"
                        ) from None
                    row.update(state="corrupt", problem=f"recorded {state}, but its "
                               f"{store.METRICS} is unreadable")
        elif state == store.RunState.RUNNING:
            table = _live_metrics(path)
        runs.append(row)
        tables.append(table)
    if not runs:
        raise store.StoreError(f"{sweep_dir}: the sweep has no runs")
    frame = pd.DataFrame(runs)
    frame["batch_size"] = batch_in_examples(frame["batch_size"].to_numpy(), tables)
    return frame, tables


def _disagrees(path: Path, table: pa.Table, status: store.RunStatus) -> str | None:
    """How a finished run's rows disagree with its status.json (`store.rows_disagree`)."""
    def last() -> dict:
        return {name: table.column(name)[-1].as_py() for name in ("step", "examples")}

    return store.rows_disagree(status, table.num_rows, last,
                               lambda: store.log_every(path))


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


def _read_metrics(path: Path) -> pa.Table:
    """The analysis' columns of one metrics file that hold a number: a float column that the
    file's own statistics say is all NaN (probes, exact truth, B_noise in most runs) is left
    out, unread; the callers take a missing column as NaN.

    `ParquetFile.read` is about twice as fast per small file as `read_table` (no dataset
    discovery) but skips a missing column silently; anything unexpected goes through
    `store.read_table`, which raises StoreError naming the file. One thread: handing a few
    columns of a few thousand rows to pyarrow's pool costs more than decoding them (half the
    read time on `gnsweep bench analysis`'s 2,000-row files, more on a busy machine).
    """
    try:
        file = pq.ParquetFile(path)
        names = set(file.schema_arrow.names)
        if not names.issuperset(METRIC_COLUMNS):
            raise ValueError("core columns missing")
        empty = _all_nan(file)
        table = file.read(columns=[c for c in METRIC_COLUMNS + OPTIONAL_COLUMNS
                                   if c in names and c not in empty], use_threads=False)
    except (pa.ArrowException, OSError, ValueError):
        table = store.read_table(path, columns=METRIC_COLUMNS)
    return table


def _all_nan(file: pq.ParquetFile) -> set[str]:
    """Float columns with no number in any row group, by the statistics of the Arrow C++ writer
    (the store's; it leaves NaN out of min/max, so a column of NaN has none). Files from other
    writers: nothing is assumed (every column is read)."""
    meta = file.metadata
    if not str(meta.created_by).startswith("parquet-cpp-arrow") or meta.num_row_groups == 0:
        return set()
    schema = file.schema_arrow
    # The analysis' float columns only, by position (a flat schema: arrow field i is parquet
    # column i), not all the file's.
    wanted = {i: f.name for i, f in enumerate(schema)
              if f.name in ANALYSIS_COLUMNS and pa.types.is_floating(f.type)}
    empty = set(wanted.values())
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for i, name in wanted.items():
            stats = group.column(i).statistics
            if stats is None or stats.has_min_max:
                empty.discard(name)
    return empty


def _with_every_column(table: pa.Table) -> pa.Table:
    """A metrics table with every column the analysis knows (NaN where not logged)."""
    for name in METRIC_COLUMNS + OPTIONAL_COLUMNS:
        if name not in table.column_names:
            table = table.append_column(name, pa.array(np.full(table.num_rows, np.nan)))
    return table.select(METRIC_COLUMNS + OPTIONAL_COLUMNS)  # one order: the tables concatenate


def _live_metrics(path: Path) -> pa.Table | None:
    """The rows a training run has written so far (its metrics parts), with the analysis'
    columns; None before its first part or when a part cannot be read yet."""
    try:
        table = store.read_metrics(path)
    except store.StoreError:
        return None
    if table is None or not table.num_rows:
        return None
    names = [c for c in METRIC_COLUMNS + OPTIONAL_COLUMNS if c in table.column_names]
    table = table.select(names)
    for name in OPTIONAL_COLUMNS:
        if name not in table.column_names:
            table = table.append_column(name, pa.array(np.full(table.num_rows, np.nan)))
    return table


def load_curves(sweep_dir: Path, skip_corrupt: bool = False) -> Curves:
    """Every run of a sweep and its logged rows as flat arrays (see `Curves`).

    A corrupt metrics file raises StoreError naming it, or with `skip_corrupt` marks its run
    state 'corrupt' and goes on.
    """
    runs, tables = _read_runs(sweep_dir, skip_corrupt)
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


def load_run_curves(run_dir: Path) -> Curves:
    """One run's logged rows (a branch sweep's base run), from its folder: its record
    (config.json) and its metrics, whatever its state (a base run may still be training)."""
    record = store.read_json(run_dir / store.RUN_CONFIG)
    spec = record.get("run") or {}
    done = (run_dir / store.METRICS).is_file()
    table = _read_metrics(run_dir / store.METRICS) if done else _live_metrics(run_dir)
    if table is None:
        raise store.StoreError(f"{run_dir}: no metrics logged yet")
    table = _with_every_column(table)
    runs = pd.DataFrame([{"run_id": str(record.get("run_id", run_dir.name)),
                          "batch_size": int(spec.get("batch_size", 0)),
                          "learning_rate": float(spec.get("learning_rate", 0.0)),
                          "seed": int(spec.get("seed", 0)),
                          "state": store.read_status(run_dir).state.value,
                          "samples": int(spec.get("batch_size", 0))}])
    runs["batch_size"] = batch_in_examples(runs["batch_size"].to_numpy(), [table])
    columns = {name: table.column(name).to_numpy().astype(float, copy=False)
               for name in CURVE_COLUMNS}
    return Curves(runs, np.array([0, table.num_rows], np.int64), columns)


def load_sweep(sweep_dir: Path, skip_corrupt: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, metrics) of a sweep. Runs without metrics (pending, failed) are in `runs` only.

    A corrupt metrics file raises StoreError naming it, or with `skip_corrupt` marks its run
    state 'corrupt' and goes on.
    """
    runs, tables = _read_runs(sweep_dir, skip_corrupt)
    parts = [_with_every_column(t).append_column("run_id",
                                                 pa.array([run_id] * t.num_rows, pa.string()))
             for run_id, t in zip(runs["run_id"], tables, strict=True) if t is not None]
    metrics = (pa.concat_tables(parts).to_pandas() if parts
               else pd.DataFrame(columns=[*METRIC_COLUMNS, *OPTIONAL_COLUMNS, "run_id"]))
    return runs, metrics
