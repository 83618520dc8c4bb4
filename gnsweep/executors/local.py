"""A pool of worker processes on this machine, each taking many runs in turn.

Workers are started once (process start-up and `import torch` cost more than a small run) and
each uses one torch thread: two 1-thread processes beat one 2-thread process on small models.
On Linux they are forked from the launcher, which has imported torch already, so they start in
milliseconds (fork is what torch's DataLoader does; the launcher never touches CUDA).

On a machine with GPUs each worker trains on its own (`executor.gpus`, `gnsweep.executors.gpus`):
its CUDA_VISIBLE_DEVICES is set first thing in the child, before it initialises CUDA, so its
`cuda:0` is its GPU. A worker that replaces a dead one takes its slot, and so its GPU.

The parent hands one run at a time to each idle worker, so it always knows which run a worker
holds. Workers claim each run before training it (`gnsweep.executors.take_run`), so another
launcher on the same sweep never runs it twice. A worker that dies is replaced and its run
retried; a worker whose launcher died (kill -9) stops its run cleanly and exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gnsweep import allocator, redact
from gnsweep.config import ExecutorConfig
from gnsweep.errors import StopRequested
from gnsweep.executors import (
    LAUNCH_ENV,
    Outcome,
    stopped_by_launcher,
    warm_up,
)
from gnsweep.executors.gpus import GpuPlan, launcher_gpus, plan
from gnsweep.executors.rounds import Summary
from gnsweep.folder import SweepFolder
from gnsweep.notices import once_per_launch
from gnsweep.paths import run_dir
from gnsweep.progress import SweepProgress
from gnsweep.runs import FINISHED, max_attempts, needs_running, read_state

__all__ = ["Summary", "launch", "run_local"]

HELD_RETRY_S = 1.0
"""How long to wait before asking again for a run another executor holds."""


@dataclass
class _Worker:
    process: Any
    inbox: Any
    slot: int
    """Its place in the pool: which GPUs it has (a replacement takes the same)."""
    run_id: str | None = None


def _worker_main(inbox: Any, outbox: Any, sweep: SweepFolder, threads: int, parent: int,
                 max_retries: int, env: dict[str, str]) -> None:
    # Before anything can initialise CUDA: which GPUs this worker sees (CUDA reads it then).
    os.environ.update(env)
    import torch

    from gnsweep.executors import execute_run, process_logger

    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    # The parent owns Ctrl-C: it asks the workers to stop with SIGTERM, which ends the run in
    # flight at its next step (recorded pending, claim released).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_term)
    # Forked while the launcher's progress bar thread may hold a stream's lock: fresh streams.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    torch.set_num_threads(threads)
    allocator.tune()  # a step's temporaries stay on the heap (gnsweep.allocator)
    sweep_dir = sweep.root
    once_per_launch(sweep_dir, os.environ.get(LAUNCH_ENV))  # a notice once, not per run

    def should_stop() -> bool:
        return stop or os.getppid() != parent

    # The folder the launcher opened (its config parsed there, once).
    folder = sweep
    logger = process_logger(folder)  # one per worker, reused for each of its runs
    while not should_stop():
        try:
            run_id = inbox.get(timeout=0.5)
        except queue.Empty:
            continue
        if run_id is None:
            break
        try:
            outcome = execute_run(folder, run_id, should_stop, max_retries, logger)
        except (KeyboardInterrupt, StopRequested):
            break
        except Exception as err:  # the run's files are unreadable: it cannot even be recorded
            print(redact.text(f"gnsweep: run {run_id}: {err}"), file=sys.stderr)
            outcome = Outcome("failed", ran=False)
        outbox.put((run_id, outcome))


def _context() -> Any:
    return mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def run_local(sweep: SweepFolder, run_ids: list[str], *, workers: int, threads: int = 1,
              max_retries: int = 2, progress: SweepProgress | None = None,
              gpus: GpuPlan | None = None) -> Summary:
    """Run `run_ids` on `workers` processes; failed runs are retried up to `max_retries` times.
    Worker i gets the environment `gpus.env(i)` (its CUDA_VISIBLE_DEVICES; None: inherited).

    Returns when every run has finished here or elsewhere, or is out of retries. `sweep`: the
    folder the launch opened, handed to every worker (config.yaml is not parsed again there).
    """
    folder = sweep
    sweep_dir = folder.root
    ctx = _context()
    outbox = ctx.Queue()
    pending = deque(run_ids)
    later: list[tuple[float, str]] = []  # runs held elsewhere: (when to ask again, run id)
    deaths: Counter[str] = Counter()  # workers that died holding each run
    summary = Summary()

    def start_worker(slot: int) -> _Worker:
        inbox = ctx.Queue()
        env = gpus.env(slot) if gpus is not None else {}
        # Not daemonic: a daemonic process cannot start children, and a run's DataLoader starts
        # worker processes (train.loader_workers). Every exit below stops the workers instead.
        process = ctx.Process(target=_worker_main, daemon=False,
                              args=(inbox, outbox, folder, threads, os.getpid(),
                                    max_retries, env))
        process.start()
        return _Worker(process, inbox, slot)

    def finish(run_id: str, outcome: Outcome) -> None:
        if outcome.state == "held":
            later.append((time.monotonic() + HELD_RETRY_S, run_id))
            return
        status = read_state(run_dir(sweep_dir, run_id))
        if outcome.ran and needs_running(status, max_retries):
            pending.append(run_id)  # failed with retries left
            return
        summary.add(run_id, outcome.state)
        if not outcome.ran and outcome.state in FINISHED:
            summary.elsewhere.append(run_id)
        if progress is not None:
            progress.advance(outcome.state)

    if ctx.get_start_method() == "fork" and run_ids:
        # Forked workers inherit it. It builds the task the launcher's pre-check has built
        # already, under its bound (`check_task`, sweep.stall_seconds).
        warm_up(folder, run_ids[0])
    pool = [start_worker(slot) for slot in range(min(workers, len(pending)))]
    try:
        while pending or later or any(w.run_id for w in pool):
            now = time.monotonic()
            pending.extend(run_id for when, run_id in later if when <= now)
            later[:] = [(when, run_id) for when, run_id in later if when > now]
            for worker in pool:
                if worker.run_id is None and pending:
                    worker.run_id = pending.popleft()
                    worker.inbox.put(worker.run_id)
            for run_id in _replace_dead(pool, start_worker):
                # Its claim names a dead pid: the next worker to take the run records the death
                # as a failed attempt; a run that kills its worker before that gives up here.
                deaths[run_id] += 1
                if deaths[run_id] < max_attempts(max_retries):
                    pending.appendleft(run_id)
                else:
                    finish(run_id, Outcome("failed", ran=False))
            try:
                run_id, outcome = outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            for worker in pool:
                if worker.run_id == run_id:
                    worker.run_id = None
            finish(run_id, outcome)
    except BaseException:  # Ctrl-C, or a bug here: no worker outlives the launcher's loop
        _stop(pool)
        for worker in pool:  # those killed could not record their run's stop themselves
            if worker.run_id is not None:
                with contextlib.suppress(Exception):  # never in place of the signal's exit
                    stopped_by_launcher(sweep_dir, worker.run_id)
        raise
    for worker in pool:
        worker.inbox.put(None)
    for worker in pool:
        worker.process.join(10)
    _stop(pool)  # any that did not finish (nothing is joined at exit forever)
    return summary


def launch(sweep: SweepFolder, run_ids: list[str], executor: ExecutorConfig, *, max_retries: int,
           progress: SweepProgress | None, wait: bool = True) -> Summary:
    """The registry's entry (`gnsweep.executors.registry`). With GPUs to share out and
    `executor.workers=0`, one worker per GPU; more workers than GPUs share them round-robin
    (said once): small runs leave a GPU mostly idle, and the user asked for that many."""
    gpus = launcher_gpus(executor.gpus)
    workers = executor.workers or (len(gpus) if gpus else executor.n_workers())
    gpu_plan, note = plan(gpus, workers, 1, what="worker", setting=executor.gpus)
    if note and run_ids:
        print(note, file=sys.stderr)
    return run_local(sweep, run_ids, workers=workers,
                     threads=executor.threads_per_worker, max_retries=max_retries,
                     progress=progress, gpus=gpu_plan)


def launch_scripts_under_torchrun(sweep: SweepFolder, run_ids: list[str], executor: ExecutorConfig,
                                  *, max_retries: int, progress: SweepProgress | None,
                                  wait: bool = True) -> Summary:
    """task=script with executor=torchrun: each worker starts its run's command under torchrun
    with `executor.nproc_per_node` processes (`training.script_command.torchrun_args`), which share
    the worker's GPUs; `executor.workers` runs at once (0: as many as the GPUs hold, else 1)."""
    gpus = launcher_gpus(executor.gpus)
    nproc = executor.nproc_per_node
    workers = executor.workers or (max(1, len(gpus) // nproc) if gpus else 1)
    gpu_plan, note = plan(gpus, workers, nproc, what="torchrun job", setting=executor.gpus)
    if note and run_ids:
        print(note, file=sys.stderr)
    return run_local(sweep, run_ids, workers=workers,
                     threads=executor.threads_per_worker, max_retries=max_retries,
                     progress=progress, gpus=gpu_plan)


def _stop(pool: list[_Worker]) -> None:
    """Ask every worker to stop (its run goes back to pending), then make sure they are gone."""
    for worker in pool:
        if worker.process.is_alive():
            worker.process.terminate()
    deadline = time.monotonic() + 10
    for worker in pool:
        worker.process.join(max(0.1, deadline - time.monotonic()))
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(5)


def _replace_dead(pool: list[_Worker], start_worker: Callable[[int], _Worker]) -> list[str]:
    """Replace dead workers; returns the runs they held."""
    lost = []
    for i, worker in enumerate(pool):
        if worker.process.is_alive():
            continue
        if worker.run_id is not None:
            lost.append(worker.run_id)
        pool[i] = start_worker(worker.slot)  # the same slot: the same GPUs
    return lost
