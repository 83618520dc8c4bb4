"""A pool of worker processes on this machine, each taking many runs in turn.

Workers are started once (process start-up and `import torch` cost more than a small run) and
each uses one torch thread: two 1-thread processes beat one 2-thread process on small models.
The parent hands one run at a time to each idle worker, so it always knows which run a worker
holds; a worker that dies is replaced and its run recorded as failed and retried.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.progress import SweepProgress


@dataclass
class _Worker:
    process: Any
    inbox: Any
    run_id: str | None = None


@dataclass
class Summary:
    """How the runs handed to an executor ended."""

    done: list[str] = field(default_factory=list)
    diverged: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def _worker_main(inbox: Any, outbox: Any, sweep_dir: str, threads: int) -> None:
    import torch

    from gnsweep.executors import execute_run

    # The parent owns Ctrl-C: it stops the workers and records what was in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    while (run_id := inbox.get()) is not None:
        status = execute_run(Path(sweep_dir), run_id)
        outbox.put((run_id, status["state"]))


def run_local(sweep_dir: Path, run_ids: list[str], *, workers: int, threads: int = 1,
              max_retries: int = 2, progress: SweepProgress | None = None) -> Summary:
    """Run `run_ids` on `workers` processes; failed runs are retried up to `max_retries` times."""
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    pending = deque(run_ids)
    pool: list[_Worker] = []
    summary = Summary()

    def start_worker() -> _Worker:
        inbox = ctx.SimpleQueue()
        process = ctx.Process(target=_worker_main, args=(inbox, outbox, str(sweep_dir), threads),
                              daemon=True)
        process.start()
        return _Worker(process, inbox)

    def finish(run_id: str, state: str) -> None:
        if state == "failed":
            attempts = int(store.read_status(store.run_dir(sweep_dir, run_id)).get("attempts", 1))
            if attempts <= max_retries:
                pending.append(run_id)
                return
        getattr(summary, state if state in ("done", "diverged") else "failed").append(run_id)
        if progress is not None:
            progress.advance(state)

    pool = [start_worker() for _ in range(min(workers, len(pending)))]
    try:
        while pending or any(w.run_id for w in pool):
            for worker in pool:
                if worker.run_id is None and pending:
                    worker.run_id = pending.popleft()
                    worker.inbox.put(worker.run_id)
            try:
                run_id, state = outbox.get(timeout=0.5)
            except queue.Empty:
                _replace_dead(pool, sweep_dir, start_worker, finish)
                continue
            for worker in pool:
                if worker.run_id == run_id:
                    worker.run_id = None
            finish(run_id, state)
    except KeyboardInterrupt:
        for worker in pool:
            if worker.process.is_alive():
                worker.process.terminate()
            worker.process.join(5)
            if worker.run_id is not None:
                # Nothing half-written stays: metrics are written only at the end, atomically.
                store.write_status(store.run_dir(sweep_dir, worker.run_id), "pending")
        raise
    for worker in pool:
        worker.inbox.put(None)
    for worker in pool:
        worker.process.join(10)
    return summary


def _replace_dead(pool: list[_Worker], sweep_dir: Path, start_worker: Any, finish: Any) -> None:
    for i, worker in enumerate(pool):
        if worker.process.is_alive():
            continue
        if worker.run_id is not None:
            store.write_status(store.run_dir(sweep_dir, worker.run_id), "failed",
                               error=f"worker process died (exit code {worker.process.exitcode})")
            finish(worker.run_id, "failed")
        pool[i] = start_worker()
