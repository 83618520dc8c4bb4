"""Reading a sweep folder into two tables: runs (one row per run) and metrics (one per step)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa

from gnsweep import store

METRIC_COLUMNS = ["step", "examples", "loss", "loss_smooth", "eval_loss", "b_simple", "b_noise"]


def load_sweep(sweep_dir: Path, skip_corrupt: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, metrics) of a sweep. Runs without metrics (pending, failed) are in `runs` only.

    A corrupt metrics file raises StoreError naming it, or with `skip_corrupt` marks its run
    state 'corrupt' and goes on.
    """
    store.require_sweep(sweep_dir)
    runs, tables = [], []
    for run_id in store.run_ids(sweep_dir):
        path = store.run_dir(sweep_dir, run_id)
        record = store.read_json(path / store.RUN_CONFIG)
        state = store.read_status(path)["state"]
        spec = record["run"]
        if (path / store.METRICS).exists() and state in store.FINISHED:
            try:
                table = store.read_table(path / store.METRICS, columns=METRIC_COLUMNS)
            except store.StoreError:
                if not skip_corrupt:
                    raise
                state = "corrupt"
            else:
                tables.append(table.append_column(
                    "run_id", pa.array([run_id] * table.num_rows, pa.string())))
        runs.append({"run_id": run_id, "batch_size": int(spec["batch_size"]),
                     "learning_rate": float(spec["learning_rate"]), "seed": int(spec["seed"]),
                     "state": state})
    if not runs:
        raise store.StoreError(f"{sweep_dir}: the sweep has no runs")
    metrics = (pa.concat_tables(tables).to_pandas() if tables
               else pd.DataFrame(columns=[*METRIC_COLUMNS, "run_id"]))
    return pd.DataFrame(runs), metrics
