"""Runs trained with DistributedDataParallel, each over `nproc_per_node` torchrun processes.

`executor.workers` torchrun jobs run at once on this machine; each is started once and takes
runs in turn (`gnsweep.executors.worker`), since torchrun's start-up costs seconds. All jobs get
the whole list; claims decide who trains what. The launcher watches the run folders for
progress; when the jobs have exited and runs remain (a worker died, a run failed with retries
left), it starts them again.

On a machine with GPUs each job gets its own `nproc_per_node` of them (`executor.gpus`,
`gnsweep.executors.gpus`) through CUDA_VISIBLE_DEVICES, so its ranks' `cuda:LOCAL_RANK` are its
GPUs, not the first ones of the machine that every job would otherwise share.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gnsweep import store
from gnsweep.config import ExecutorConfig
from gnsweep.executors.gpus import GpuPlan, launcher_gpus, plan
from gnsweep.executors.rounds import Summary, Watcher, run_rounds
from gnsweep.paths import SweepPaths
from gnsweep.progress import SweepProgress

if TYPE_CHECKING:
    from gnsweep.folder import SweepFolder

POLL_S = 0.3


def worker_command(sweep_dir: Path, runs_file: Path, *, nproc: int, max_retries: int,
                   threads: int = 1, stop_with: int | None = None,
                   rendezvous: list[str] | None = None, max_restarts: int = 0) -> list[str]:
    """The torchrun command line of one job (`rendezvous`: multi-node options, else
    --standalone; `max_restarts`: torchrun's elastic restarts, each continuing the run in flight
    from its checkpoint); one process without torchrun when nproc is 1 and there is no
    rendezvous."""
    worker = ["-m", "gnsweep.executors.worker", str(sweep_dir), "--runs-file", str(runs_file),
              "--max-retries", str(max_retries), "--threads", str(threads)]
    if stop_with is not None:
        worker += ["--stop-with", str(stop_with)]
    if nproc == 1 and not rendezvous:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", *(rendezvous or ["--standalone"]),
            f"--nproc_per_node={nproc}", f"--max_restarts={max_restarts}", *worker]


def write_runs_file(sweep_dir: Path, run_ids: list[str]) -> Path:
    queue = SweepPaths(sweep_dir).queue
    path = store.subdir(sweep_dir, queue) / f"{uuid.uuid4().hex[:12]}.txt"
    store.write_text(path, "".join(f"{r}\n" for r in run_ids))
    return path


def run_torchrun(sweep_dir: Path, run_ids: list[str], executor: ExecutorConfig, *,
                 max_retries: int = 2, progress: SweepProgress | None = None) -> Summary:
    """Train `run_ids` with DDP over `executor.nproc_per_node` processes each, `executor.workers`
    torchrun jobs at a time; returns when every run has finished or is out of retries.

    With GPUs to share out, each job gets its own `nproc_per_node` (`executor.workers=0`: as
    many jobs as fit); jobs beyond that share GPUs round-robin, said once; a job needing more
    GPUs than there are is refused (ConfigError)."""
    gpus = launcher_gpus(executor.gpus)
    nproc = executor.nproc_per_node
    jobs = executor.workers or max(1, len(gpus or []) // nproc)
    gpu_plan, note = plan(gpus, jobs, nproc, what="torchrun job", setting=executor.gpus)
    if note and run_ids:
        print(note, file=sys.stderr)
    watcher = Watcher(sweep_dir, run_ids, max_retries, progress)
    remove_stale_scratch(sweep_dir)
    run_rounds(TorchrunBackend(sweep_dir, executor, max_retries, jobs, gpu_plan), watcher,
               max_retries)
    return watcher.summary()


def launch(sweep: SweepFolder, run_ids: list[str], executor: ExecutorConfig, *, max_retries: int,
           progress: SweepProgress | None, wait: bool = True) -> Summary:
    """The registry's entry (`gnsweep.executors.registry`)."""
    return run_torchrun(sweep.root, run_ids, executor, max_retries=max_retries,
                        progress=progress)


def scratch_name(stem: str) -> str:
    """The name of a round's scratch folder in queue/: `<round>.<host>.<launcher pid>.tmp`, so
    that a later launch knows whose it is (`remove_stale_scratch`)."""
    return f"{stem}.{socket.gethostname()}.{os.getpid()}.tmp"


def remove_stale_scratch(sweep_dir: Path) -> list[Path]:
    """Remove the scratch folders of rounds whose launcher, on this host, is gone (killed
    before its round could remove them), with the round's runs file (`<round>.txt`) and its
    jobs' logs (`<round>.<i>.log`); those of live launchers, and of other hosts sharing the
    folder, stay. Returns what was removed."""
    import shutil

    folder = SweepPaths(sweep_dir).queue
    if not folder.is_dir() or folder.is_symlink():
        return []
    import re

    mine = re.compile(rf"[0-9a-f]+\.{re.escape(socket.gethostname())}\.(\d+)\.tmp")
    removed = []
    for path in folder.iterdir():
        match = mine.fullmatch(path.name)
        if match is None or path.is_symlink() or not path.is_dir() or _alive(int(match[1])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        stem = path.name.split(".", 1)[0]
        for leftover in [folder / f"{stem}.txt", *sorted(folder.glob(f"{stem}.*.log"))]:
            if leftover.is_file() and not leftover.is_symlink():
                leftover.unlink(missing_ok=True)
                removed.append(leftover)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


@dataclass
class TorchrunBackend:
    """Rounds of `jobs` torchrun jobs on this machine; job i sees `gpus.env(i)`."""

    sweep_dir: Path
    executor: ExecutorConfig
    max_retries: int
    jobs: int = 1
    gpus: GpuPlan = field(default_factory=lambda: GpuPlan(None))
    poll_s: float = POLL_S

    def start(self, run_ids: list[str]) -> _LocalJobs:
        runs_file = write_runs_file(self.sweep_dir, run_ids)
        command = worker_command(self.sweep_dir, runs_file, nproc=self.executor.nproc_per_node,
                                 max_retries=self.max_retries,
                                 threads=self.executor.threads_per_worker, stop_with=os.getpid(),
                                 max_restarts=self.executor.max_restarts)
        # torchrun's agent keeps its scratch files (torchelastic_*/<run>/attempt_0/<rank>) in
        # the temporary folder: this round's own, inside the sweep folder, removed when the
        # round ends (nothing of a sweep is left outside its folder).
        scratch = store.subdir(self.sweep_dir, SweepPaths(self.sweep_dir).queue
                               / scratch_name(runs_file.stem))
        env = {**os.environ, "OMP_NUM_THREADS": str(self.executor.threads_per_worker),
               "TMPDIR": str(scratch.resolve())}
        # Own sessions: Ctrl-C reaches the launcher alone, which stops the jobs in order.
        # Their output goes to a log beside the runs file (it would garble the progress bar).
        logs = [runs_file.with_suffix(f".{i}.log") for i in range(min(self.jobs, len(run_ids)))]
        return _LocalJobs([_start(command, {**env, **self.gpus.env(i)}, log)
                           for i, log in enumerate(logs)], logs, runs_file, self.sweep_dir,
                          scratch)


@dataclass
class _LocalJobs:
    """One round: torchrun processes on this machine."""

    jobs: list[subprocess.Popen]
    logs: list[Path]
    runs_file: Path
    sweep_dir: Path
    scratch: Path | None = None
    """The jobs' temporary folder (TMPDIR), removed when the round ends."""

    def done(self) -> bool:
        return all(job.poll() is not None for job in self.jobs)

    def finish(self) -> None:
        for job, log in zip(self.jobs, self.logs, strict=True):
            if job.returncode != 0:
                print(f"gnsweep: torchrun job exited with code {job.returncode}; its log: "
                      f"{log}", file=sys.stderr)
            else:
                log.unlink(missing_ok=True)
        self.runs_file.unlink(missing_ok=True)
        self._remove_scratch()

    def stop(self) -> None:
        from gnsweep.executors import stopped_by_launcher

        stop_jobs(self.jobs)
        # A job killed when it did not stop in time (its task blocked) could not record its
        # run's stop: the launcher does, so that its "went back to pending" holds.
        with contextlib.suppress(OSError):
            for run_id in self.runs_file.read_text().split():
                with contextlib.suppress(Exception):  # never in place of the signal's exit
                    stopped_by_launcher(self.sweep_dir, run_id)
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        import shutil

        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    fd = store.open_nofollow(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as out:
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
