"""The run-logger interface and the rule that logging never fails a run."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from typing import Any

from gnsweep.tables import TRACKED_METRICS

log = logging.getLogger("gnsweep.tracking")

METRICS = TRACKED_METRICS
"""The per-step metric names a gnsweep run logs (any others pass through unchanged)."""


class RunLogger:
    """One experiment tracker, serving the runs of one process one after another.

    `start(run_id, params)` opens a run (params: the run's resolved config, nested dicts
    allowed), `log(step, metrics)` records one optimizer step, `close()` ends the run
    (`failed=True` marks it failed where the tracker has such a status). The base class logs
    nothing: it is the `none` backend.
    """

    kind = "none"

    def start(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Open the run `run_id`; a run still open is closed first."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record `metrics` at optimizer step `step`."""

    def close(self, *, failed: bool = False) -> None:
        """End the current run (no-op when none is open)."""


class SafeLogger(RunLogger):
    """Wraps a backend so that it never fails a run: the first error of any call (package
    missing, store unwritable, server gone) is reported once, with `hint` on how to fix it,
    and the backend is dropped for the rest of the process.

    Values that are None or not finite are left out (B_noise is NaN between measurements).
    """

    def __init__(self, backend: RunLogger, hint: str) -> None:
        self.backend: RunLogger | None = backend
        self.kind = backend.kind
        self.hint = hint
        self.failed: str | None = None

    def _fail(self, action: str, err: BaseException) -> None:
        from gnsweep import redact

        self.failed = redact.text(f"{type(err).__name__}: {err}")  # a URI with its password
        log.warning("gnsweep: logger=%s could not %s (%s); runs go on without it. %s",
                    self.kind, action, self.failed, self.hint)
        backend, self.backend = self.backend, None
        if backend is not None and action != "start":
            # It has already failed once: one warning is enough.
            with contextlib.suppress(Exception):
                backend.close(failed=True)

    def start(self, run_id: str, params: Mapping[str, Any]) -> None:
        if self.backend is None:
            return
        try:
            self.backend.start(run_id, params)
        except Exception as err:
            self._fail("start", err)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.backend is None:
            return
        try:
            values = {name: float(value) for name, value in metrics.items()
                      if value is not None and math.isfinite(float(value))}
            if values:
                self.backend.log(int(step), values)
        except Exception as err:
            self._fail("log", err)

    def close(self, *, failed: bool = False) -> None:
        if self.backend is None:
            return
        try:
            self.backend.close(failed=failed)
        except Exception as err:
            self._fail("close", err)


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"task": {"dim": 16}}` -> `{"task.dim": 16}`: trackers take flat parameter names."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out
