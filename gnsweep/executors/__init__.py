"""Executors run a sweep's remaining runs: a local process pool, torchrun, or Slurm.

They share `execute_run`, which trains one run and records its status, so that every executor
records runs the same way.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gnsweep import store


def execute_run(sweep_dir: Path, run_id: str,
                should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Train one run of the sweep and record how it ended; returns the final status.

    A run that raises is recorded as failed with its error (the executor decides on a retry); a
    diverged run is recorded as diverged and is final.
    """
    from gnsweep.sweep import parse_run_record
    from gnsweep.train import train

    path = store.run_dir(sweep_dir, run_id)
    attempts = int(store.read_status(path).get("attempts", 0)) + 1
    store.write_status(path, "running", attempts=attempts, host=socket.gethostname(),
                       pid=os.getpid(), started=time.time())
    try:
        config, spec = parse_run_record(store.read_json(path / store.RUN_CONFIG))
        result = train(config, spec, path, should_stop=should_stop)
    except KeyboardInterrupt:
        # Stopped from outside: the run is simply not done; a relaunch runs it again.
        store.write_status(path, "pending", attempts=attempts - 1)
        raise
    except Exception as err:
        return store.write_status(path, "failed", error=f"{type(err).__name__}: {err}",
                                  traceback=traceback.format_exc(limit=8))
    return store.write_status(path, result.state, steps=result.steps, reason=result.reason,
                              final_loss=result.final_loss, train_seconds=result.train_seconds)
