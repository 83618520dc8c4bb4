"""MLflow: one MLflow run per gnsweep run, the run's config as params, per-step metrics.

The store is `tracking_uri`, else `$MLFLOW_TRACKING_URI`, else a local SQLite store inside the
sweep folder, `<sweep>/mlflow/mlflow.db` (artifacts beside it), readable with
`mlflow ui --backend-store-uri sqlite:///<sweep>/mlflow/mlflow.db`. MLflow 3 refuses new
plain-folder stores, hence SQLite (`gnsweep[mlflow]` brings SQLAlchemy and Alembic for it).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.paths import SweepPaths
from gnsweep.tracking.run_logger import RunLogger, flatten

RUN_TAG = "gnsweep.run_id"
_FLUSH_EVERY, _FLUSH_SECS = 500, 10.0  # metrics are sent in batches, not one call a step
_PARAM_BATCH, _PARAM_CHARS = 100, 6000  # MLflow's limits per log_batch call and per value


class MlflowLogger(RunLogger):
    kind = "mlflow"

    def __init__(self, sweep_dir: Path, *, tracking_uri: str | None = None,
                 experiment: str | None = None) -> None:
        self.sweep_dir = Path(sweep_dir)
        self.local = SweepPaths(self.sweep_dir).mlflow
        self.tracking_uri = (tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                             or f"sqlite:///{(self.local / 'mlflow.db').resolve()}")
        self.experiment = experiment or self.sweep_dir.resolve().name
        self.client: Any = None
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self.pending: list[Any] = []
        self.last_flush = 0.0

    def _is_local(self) -> bool:
        return self.tracking_uri.startswith(f"sqlite:///{self.local.resolve()}")

    def _lock_path(self) -> Path | None:
        """Where workers queue to open a SQLite store (None: a server, which serialises)."""
        if self._is_local():
            store.subdir(self.sweep_dir, self.local)  # never through a link
            return self.local / ".lock"
        if self.tracking_uri.startswith("sqlite:///"):
            db = Path(self.tracking_uri.removeprefix("sqlite:///").split("?")[0])
            return db.with_name(db.name + ".gnsweep-lock")
        return None

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Several worker processes open a SQLite store at once: the first creates its tables
        (and the experiment) while the others wait (else some fail with "table exists")."""
        path = self._lock_path()
        if path is None:
            yield
            return
        with store.exclusive(path):
            yield

    def _connect(self) -> None:
        from mlflow.tracking import MlflowClient

        with self._exclusive():
            client = MlflowClient(tracking_uri=self.tracking_uri)
            found = client.get_experiment_by_name(self.experiment)
            if found is None:
                artifacts = (self.local / "artifacts").resolve().as_uri() if self._is_local() \
                    else None
                try:
                    self.experiment_id = client.create_experiment(
                        self.experiment, artifact_location=artifacts)
                except Exception:
                    # Another process (on another machine) created it first.
                    found = client.get_experiment_by_name(self.experiment)
                    if found is None:
                        raise
            if found is not None:
                self.experiment_id = found.experiment_id
        self.client = client

    def start(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        self.close()
        if self.client is None:
            self._connect()
        # One MLflow run per gnsweep run: a retried run replaces its earlier attempts (soft
        # delete, `mlflow gc` removes them for good).
        for old in self.client.search_runs([self.experiment_id],
                                           filter_string=f"tags.`{RUN_TAG}` = '{run_id}'"):
            self.client.delete_run(old.info.run_id)
        run = self.client.create_run(self.experiment_id, run_name=run_id,
                                     tags={RUN_TAG: run_id})
        self.run_id = run.info.run_id
        values = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in flatten(params).items()]
        for i in range(0, len(values), _PARAM_BATCH):
            self.client.log_batch(self.run_id, params=values[i:i + _PARAM_BATCH])
        self.last_flush = time.monotonic()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if self.run_id is None:
            return
        stamp = int(time.time() * 1000)
        self.pending += [Metric(name, value, stamp, step) for name, value in metrics.items()]
        if len(self.pending) >= _FLUSH_EVERY or time.monotonic() - self.last_flush > _FLUSH_SECS:
            self._flush()

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        self.last_flush = time.monotonic()
        for i in range(0, len(pending), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=pending[i:i + 1000])

    def close(self, *, failed: bool = False) -> None:
        if self.run_id is None:
            return
        try:
            self._flush()
        finally:
            run_id, self.run_id = self.run_id, None
            self.client.set_terminated(run_id, "FAILED" if failed else "FINISHED")
