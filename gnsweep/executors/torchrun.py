"""Runs trained with DistributedDataParallel, each over `nproc_per_node` torchrun processes.

`executor.workers` torchrun jobs run at once on this machine; each is started once and takes
runs in turn (`gnsweep.executors.worker`), since torchrun's start-up costs seconds. All jobs get
the whole list; claims decide who trains what. The launcher watches the run folders for
progress; when the jobs have exited and runs remain (a worker died, a run failed with retries
left), it starts them again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.config import ExecutorConfig
from gnsweep.executors import claims, runnable
from gnsweep.executors.local import Summary
from gnsweep.progress import SweepProgress

POLL_S = 0.3
QUEUE = "queue"
"""Folder of the sweep holding the run-id files handed to workers."""


def worker_command(sweep_dir: Path, runs_file: Path, *, nproc: int, max_retries: int,
                   threads: int = 1, stop_with: int | None = None,
                   rendezvous: list[str] | None = None) -> list[str]:
    """The torchrun command line of one job (`rendezvous`: multi-node options, else
    --standalone); one process without torchrun when nproc is 1 and there is no rendezvous."""
    worker = ["-m", "gnsweep.executors.worker", str(sweep_dir), "--runs-file", str(runs_file),
              "--max-retries", str(max_retries), "--threads", str(threads)]
    if stop_with is not None:
        worker += ["--stop-with", str(stop_with)]
    if nproc == 1 and not rendezvous:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", *(rendezvous or ["--standalone"]),
            f"--nproc_per_node={nproc}", "--max_restarts=0", *worker]


def write_runs_file(sweep_dir: Path, run_ids: list[str]) -> Path:
    path = sweep_dir / QUEUE / f"{uuid.uuid4().hex[:12]}.txt"
    store.write_text(path, "".join(f"{r}\n" for r in run_ids))
    return path


def run_torchrun(sweep_dir: Path, run_ids: list[str], executor: ExecutorConfig, *,
                 max_retries: int = 2, progress: SweepProgress | None = None) -> Summary:
    """Train `run_ids` with DDP over `executor.nproc_per_node` processes each, `executor.workers`
    torchrun jobs at a time; returns when every run has finished or is out of retries."""
    watcher = _Watcher(sweep_dir, run_ids, max_retries, progress)
    env = {**os.environ, "OMP_NUM_THREADS": str(executor.threads_per_worker)}
    jobs: list[subprocess.Popen] = []
    rounds = 0
    try:
        while True:
            todo, held = watcher.runnable(), watcher.held()
            if not todo and not held:
                break
            if not todo:
                # Only runs another launcher holds: wait until they finish or their owner dies.
                while watcher.held() and not watcher.runnable():
                    time.sleep(POLL_S)
                continue
            if rounds > max_retries + 1:
                break  # runs left, but their jobs keep dying: give up (their status says why)
            rounds += 1
            runs_file = write_runs_file(sweep_dir, todo)
            command = worker_command(sweep_dir, runs_file, nproc=executor.nproc_per_node,
                                     max_retries=max_retries,
                                     threads=executor.threads_per_worker, stop_with=os.getpid())
            # Own sessions: Ctrl-C reaches the launcher alone, which stops the jobs in order.
            # Their output goes to a log beside the runs file (it would garble the progress bar).
            logs = [runs_file.with_suffix(f".{i}.log")
                    for i in range(min(executor.workers or 1, len(todo)))]
            jobs = [_start(command, env, log) for log in logs]
            while any(job.poll() is None for job in jobs):
                watcher.update()
                time.sleep(POLL_S)
            for job, log in zip(jobs, logs, strict=True):
                if job.returncode != 0:
                    print(f"gnsweep: torchrun job exited with code {job.returncode}; its log: "
                          f"{log}", file=sys.stderr)
                else:
                    log.unlink(missing_ok=True)
            runs_file.unlink(missing_ok=True)
    except KeyboardInterrupt:
        stop_jobs(jobs)
        raise
    return watcher.summary()


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(command, env=env, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT)


def stop_jobs(jobs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    """SIGTERM each job's process group (its runs stop at the next step, back to pending), then
    SIGKILL what is left after `grace_s`."""
    for job in jobs:
        if job.poll() is None:
            with _suppress():
                os.killpg(job.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for job in jobs:
        try:
            job.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with _suppress():
                os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def _suppress() -> Any:
    import contextlib

    return contextlib.suppress(ProcessLookupError, PermissionError)


class _Watcher:
    """Follows the runs of one launch through their status files: progress and the summary."""

    def __init__(self, sweep_dir: Path, run_ids: list[str], max_retries: int,
                 progress: SweepProgress | None) -> None:
        self.sweep_dir, self.run_ids, self.max_retries = sweep_dir, run_ids, max_retries
        self.progress = progress
        self.final: dict[str, str] = {}

    def _status(self, run_id: str) -> dict[str, Any]:
        return store.read_status(store.run_dir(self.sweep_dir, run_id))

    def update(self) -> None:
        for run_id in self.run_ids:
            if run_id in self.final:
                continue
            status = self._status(run_id)
            if status["state"] in store.FINISHED or (
                    status["state"] == "failed" and not runnable(status, self.max_retries)):
                self.final[run_id] = status["state"]
                if self.progress is not None:
                    self.progress.advance(status["state"])

    def _open(self) -> list[str]:
        self.update()
        return [r for r in self.run_ids if r not in self.final]

    def held(self) -> list[str]:
        """Open runs a live owner (here or elsewhere) holds."""
        out = []
        for run_id in self._open():
            claim = claims.read_claim(store.run_dir(self.sweep_dir, run_id))
            if claim is not None and not claims.is_stale(claim):
                out.append(run_id)
        return out

    def runnable(self) -> list[str]:
        """Open runs nobody holds."""
        held = set(self.held())
        return [r for r in self._open() if r not in held]

    def summary(self) -> Summary:
        self.update()
        summary = Summary()
        for run_id in self.run_ids:
            summary.add(run_id, self.final.get(run_id, "failed"))
        return summary
