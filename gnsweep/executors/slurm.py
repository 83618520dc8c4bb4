"""Runs on a Slurm cluster through submitit: one job array, each job taking many runs in turn.

The runs are split into `runs_per_job`-sized chunks (or over `workers` jobs when that is 0) and
submitted as one job array. Each job runs torchrun across its resources (`nodes` x
`nproc_per_node` DDP processes, `gpus_per_node` GPUs) with the worker entry point, which claims
each run before it trains it: a relaunch while jobs still run never runs a run twice, and runs
of a job that died (node lost, time limit, scancel -9) are found by their stale claims and
submitted again. Job ids go to `<sweep>/slurm/jobs.json`; job logs to `<sweep>/slurm/`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gnsweep import redact, store
from gnsweep.config import ExecutorConfig
from gnsweep.executors import PREEMPTED
from gnsweep.executors.rounds import Summary, Watcher, run_rounds
from gnsweep.executors.torchrun import worker_command, write_runs_file
from gnsweep.paths import SweepPaths
from gnsweep.progress import SweepProgress

if TYPE_CHECKING:
    from gnsweep.folder import SweepFolder

POLL_S = 2.0
RDZV_PORT = 29400


def chunks(run_ids: list[str], executor: ExecutorConfig) -> list[list[str]]:
    """Runs split into the jobs of the array, in order."""
    size = executor.runs_per_job or math.ceil(len(run_ids) / max(1, executor.workers or 1))
    return [run_ids[i:i + size] for i in range(0, len(run_ids), size)]


class SlurmJob:
    """What each Slurm job runs (one task per node): the worker in this process, or torchrun
    over this node's processes, joined across nodes by a c10d rendezvous on the first node.

    Slurm warns ahead of the time limit or a preemption with SIGUSR2 (submitit's `--signal`):
    the workers stop their runs at the next step boundary, checkpointed and pending; then
    submitit's own handler (which the job replaced) requeues the job with the same call
    (`checkpoint`), and the requeued job resumes each run from its checkpoint."""

    def __call__(self, sweep_dir: str, runs_file: str, nproc: int, max_retries: int,
                 threads: int, max_restarts: int = 0) -> int:
        import submitit

        from gnsweep.executors import worker

        requeue = signal.getsignal(signal.SIGUSR2)  # submitit's: checkpoint and requeue
        job = submitit.JobEnvironment()
        rendezvous = None
        if job.num_nodes > 1:
            rendezvous = [f"--nnodes={job.num_nodes}", "--rdzv_backend=c10d",
                          f"--rdzv_endpoint={job.hostnames[0]}:{RDZV_PORT}",
                          f"--rdzv_id={job.job_id}"]
        if nproc == 1 and rendezvous is None:
            # One process: no torchrun, no second interpreter; train right here (the worker
            # takes SIGUSR2 over and says it stopped on it).
            code = worker.main([sweep_dir, "--runs-file", runs_file, "--max-retries",
                                str(max_retries), "--threads", str(threads)])
            warned = code == PREEMPTED
        else:
            code, warned = _torchrun(worker_command(
                Path(sweep_dir), Path(runs_file), nproc=nproc, max_retries=max_retries,
                threads=threads, rendezvous=rendezvous, max_restarts=max_restarts), threads)
        if warned and callable(requeue):
            requeue(signal.SIGUSR2, None)  # exits: the job goes back to the queue
        return code

    def checkpoint(self, *args: Any) -> Any:
        """Submitit's hook at the warning: the requeued job makes the same call (the runs'
        own checkpoints hold where each stands)."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args)


def _torchrun(command: list[str], threads: int) -> tuple[int, bool]:
    """Run torchrun in its own process group; SIGUSR2 is passed on to its workers (its agent,
    which would die of it, ignores it). Returns (exit code, whether SIGUSR2 came)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(command, env=env, preexec_fn=_own_group_ignoring_usr2)
    warned = False

    def forward(signum: int, frame: Any) -> None:
        nonlocal warned
        warned = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGUSR2)

    signal.signal(signal.SIGUSR2, forward)
    return process.wait(), warned


def _own_group_ignoring_usr2() -> None:
    os.setpgid(0, 0)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


slurm_job = SlurmJob()
"""The callable submitted for each job."""

MAX_REQUEUES = 100
"""Requeues submitit allows a job at time limits (each continues its runs from their
checkpoints, so a run of any length finishes under any limit that lets it take a step)."""


def signal_delay_s(time_min: int) -> int:
    """Seconds ahead of the time limit that Slurm warns (SIGUSR2): submitit's 90, or a quarter
    of a short limit (a warning before the job has started would stop every run at once)."""
    return min(90, max(10, time_min * 60 // 4))


def make_executor(folder: Path, executor: ExecutorConfig) -> Any:
    import submitit

    params: dict[str, Any] = {
        "nodes": executor.nodes, "tasks_per_node": 1, "timeout_min": executor.time_min,
        "cpus_per_task": max(executor.cpus_per_task,
                             executor.nproc_per_node * executor.threads_per_worker),
        "name": "gnsweep", "slurm_additional_parameters": dict(executor.sbatch_extra),
        "slurm_signal_delay_s": signal_delay_s(executor.time_min),
    }
    if executor.partition:
        params["slurm_partition"] = executor.partition
    if executor.gpus_per_node:
        params["gpus_per_node"] = executor.gpus_per_node
    out = submitit.AutoExecutor(folder=folder, cluster="slurm",
                                slurm_max_num_timeout=MAX_REQUEUES)
    out.update_parameters(**params)
    return out


def submit(sweep_dir: Path, run_ids: list[str], executor: ExecutorConfig,
           max_retries: int) -> list[Any]:
    """Submit `run_ids` as one job array; record which job took which run."""
    if shutil.which("sbatch") is None:
        from gnsweep.config import ConfigError

        raise ConfigError("executor=slurm: sbatch is not on PATH; run on a Slurm login node")
    folder = store.subdir(sweep_dir, SweepPaths(sweep_dir).slurm)
    parts = chunks(run_ids, executor)
    files = [str(write_runs_file(sweep_dir, part)) for part in parts]
    n = len(parts)
    # A task=script job runs the worker in its own process, which starts each command under
    # torchrun with nproc_per_node processes itself (`training.script_command.command`).
    nproc = 1 if _script_sweep(sweep_dir) else executor.nproc_per_node
    jobs = make_executor(folder, executor).map_array(
        slurm_job, [str(sweep_dir)] * n, files, [nproc] * n,
        [max_retries] * n, [executor.threads_per_worker] * n, [executor.max_restarts] * n)
    record = job_ids(sweep_dir)
    for job, part in zip(jobs, parts, strict=True):
        record.update(dict.fromkeys(part, job.job_id))
    store.write_json(SweepPaths(sweep_dir).jobs, record)
    return jobs


def _script_sweep(sweep_dir: Path) -> bool:
    from gnsweep.folder import read_config
    from gnsweep.tasks import SCRIPT

    return read_config(sweep_dir).task.name == SCRIPT


def job_ids(sweep_dir: Path) -> dict[str, str]:
    """Run id -> the Slurm job id it was last submitted to."""
    path = SweepPaths(sweep_dir).jobs
    return dict(store.read_json(path)) if path.is_file() else {}


def queue_states(ids: list[str]) -> dict[str, str]:
    """Slurm job id -> state (PENDING, RUNNING...) for the jobs still in the queue."""
    if not ids or shutil.which("squeue") is None:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T", "-j",
                              ",".join(sorted({i.split('_')[0] for i in ids}))],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)


def run_slurm(sweep_dir: Path, run_ids: list[str], executor: ExecutorConfig, *,
              max_retries: int = 2, progress: SweepProgress | None = None,
              wait: bool = True) -> Summary:
    """Submit the runs and (with `wait`) follow them until every run has finished or is out of
    retries, resubmitting runs whose job died. Ctrl-C cancels the jobs."""
    watcher = Watcher(sweep_dir, run_ids, max_retries, progress)
    if not wait:
        todo = watcher.runnable()
        summary = Summary()
        summary.submitted = [job.job_id for job in submit(sweep_dir, todo, executor,
                                                         max_retries)] if todo else []
        return summary
    rounds = run_rounds(SlurmBackend(sweep_dir, executor, max_retries), watcher, max_retries)
    summary = watcher.summary()
    summary.submitted = [job.job_id for r in rounds if isinstance(r, _ArrayJobs)
                         for job in r.jobs]
    return summary


def launch(sweep: SweepFolder, run_ids: list[str], executor: ExecutorConfig, *, max_retries: int,
           progress: SweepProgress | None, wait: bool = True) -> Summary:
    """The registry's entry (`gnsweep.executors.registry`)."""
    return run_slurm(sweep.root, run_ids, executor, max_retries=max_retries, progress=progress,
                     wait=wait)


@dataclass
class SlurmBackend:
    """Rounds of one job array each."""

    sweep_dir: Path
    executor: ExecutorConfig
    max_retries: int
    poll_s: float = POLL_S

    def start(self, run_ids: list[str]) -> _ArrayJobs:
        return _ArrayJobs(submit(self.sweep_dir, run_ids, self.executor, self.max_retries))


@dataclass
class _ArrayJobs:
    """One round: the jobs of one submitted array."""

    jobs: list[Any]

    def done(self) -> bool:
        return all(job.done() for job in self.jobs)

    def finish(self) -> None:
        _report_job_errors(self.jobs)

    def stop(self) -> None:
        for job in self.jobs:
            if not job.done():
                job.cancel(check=False)


def _report_job_errors(jobs: list[Any]) -> None:
    """One line on stderr per job that raised or whose workers exited badly."""
    for job in jobs:
        try:
            code = job.result()
        except Exception as err:
            first = redact.text((str(err).strip().splitlines() or [type(err).__name__])[-1])
            print(f"gnsweep: Slurm job {job.job_id} failed ({first}); log: {job.paths.stderr}",
                  file=sys.stderr)
            continue
        if code not in (0, 130, PREEMPTED):
            print(f"gnsweep: Slurm job {job.job_id}: workers exited with code {code}; log: "
                  f"{job.paths.stderr}", file=sys.stderr)
