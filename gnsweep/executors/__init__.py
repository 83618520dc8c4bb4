"""Executors run a sweep's remaining runs: a local process pool, torchrun, or Slurm.

Every executor takes a run the same way (`take_run`: claim it, then check it still needs running)
and records it the same way (`run_taken`: train, write the final status atomically, release the
claim), so that any mix of executors and relaunches runs each run once. Under torch.distributed
only rank 0 claims, writes and logs; the other ranks train alongside it.

A worker opens the sweep folder once at its start (`folder.SweepFolder.of_config`: config.yaml
parsed once) and hands the opened folder to every function here; each run's record is read
from it (`SweepFolder.read_run`). A function given a folder's path instead opens it there.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gnsweep import redact, store
from gnsweep.errors import ScriptFailed, StopRequested
from gnsweep.executors import claims
from gnsweep.executors.watchdog import STALLED, Watchdog
from gnsweep.folder import SweepFolder
from gnsweep.paths import RunPaths, run_dir
from gnsweep.runs import OUT_OF_SPACE, WILL_REPEAT, RunState, needs_running, read_state
from gnsweep.tracking import METRICS, RunLogger, make_logger

runnable = needs_running
"""Whether a run still needs running (the retry rule lives in `gnsweep.runs.needs_running`)."""

PREEMPTED = 75
"""Exit code of a worker stopped by Slurm's warning ahead of a time limit or preemption
(SIGUSR2): its run is checkpointed and pending, and the job wants requeueing."""
LAUNCH_ENV = "GNSWEEP_LAUNCH"
"""The id of the `gnsweep launch` a worker serves (inherited by every worker, also under
torchrun and Slurm): each attempt records it, so a launch can tell its runs from another's."""


@dataclass(frozen=True)
class Outcome:
    """What became of one run handed to an executor."""

    state: str
    """done, diverged or failed; held when another live executor holds the run."""
    ran: bool
    """Whether this call trained it (False: finished, out of retries, or held elsewhere)."""


def rank() -> int:
    """This process's rank under torch.distributed (0 without it)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_event(run_path: Path, event: str, **fields: Any) -> None:
    """Append one line to the run's attempt log (one `write` on an O_APPEND file, O_NOFOLLOW)."""
    line = json.dumps({"event": event, "time": time.time(), "host": socket.gethostname(),
                       "pid": os.getpid(), "slurm_job_id": claims.slurm_job_id(),
                       "launch": os.environ.get(LAUNCH_ENV), **fields},
                      default=str) + "\n"
    store.append_line(RunPaths(run_path).history, line)  # never through a link


def history_lines(run_path: Path) -> list[str]:
    """The lines of a run's attempt log (none when it has none). A line that is not UTF-8 or
    not JSON (a torn write, an edit) reads as text its readers skip; a FIFO or other special
    file in its place is refused (StoreError, `store.read_bytes`), never opened to block."""
    try:
        data = store.read_bytes(RunPaths(run_path).history)
    except FileNotFoundError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()


def ended_by(run_path: Path) -> str | None:
    """The launch whose worker recorded the run's last end (None: unknown)."""
    lines = history_lines(run_path)
    for line in reversed(lines):
        with contextlib.suppress(ValueError, AttributeError, RecursionError):
            event = json.loads(line)
            if event.get("event") == "end":
                launch = event.get("launch")
                return launch if isinstance(launch, str) else None
    return None


def requeues(run_path: Path) -> int:
    """How often Slurm requeued the run: attempts started by a Slurm job that had started it
    before (a requeued job keeps its id)."""
    lines = history_lines(run_path)
    seen: set[str] = set()
    count = 0
    for line in lines:
        with contextlib.suppress(ValueError, AttributeError, RecursionError, TypeError):
            event = json.loads(line)
            job = event.get("slurm_job_id")
            if event.get("event") != "start" or not isinstance(job, str) or not job:
                continue
            count += job in seen
            seen.add(job)
    return count


def open_folder(sweep_dir: Path | str) -> SweepFolder:
    """A worker's sweep folder, opened once at its start (config.yaml parsed once); where the
    config cannot be read, each run fails with the reason (`SweepFolder.for_worker`)."""
    return SweepFolder.for_worker(sweep_dir)


def process_logger(sweep: SweepFolder) -> RunLogger:
    """The run logger of this worker process (the sweep's `logger=` setting), made once at
    worker start and reused for every run it trains; rank 0 alone logs under torch.distributed.

    Read from the sweep's config.yaml, which the latest launch wrote: a relaunch may switch
    logging on for the runs still to do. It never raises (a sweep config this process cannot
    read fails the runs themselves, with the reason).
    """
    from gnsweep.config import LoggerConfig

    if rank() != 0:
        return RunLogger()
    try:
        folder = sweep
        # config.yaml holds secrets masked: the real values come from the launcher's
        # environment (`gnsweep.redact`); a value still masked is left to the tracker's own
        # environment variables (MLFLOW_TRACKING_URI, WANDB_API_KEY...).
        data = redact.restore(folder.config.to_dict(), redact.exported())
        settings = LoggerConfig(**data["logger"])
        options = {k: v for k, v in settings.options().items()
                   if not (isinstance(v, str) and redact.MASK in v)}
        return make_logger(settings.kind, folder.root, **options)
    except Exception:
        return RunLogger()


def take_run(sweep_dir: Path, run_id: str, max_retries: int) -> tuple[claims.Claim | None, str]:
    """Claim a run that still needs running. Returns (claim, "claimed"), or (None, why not):
    the run's state (done, diverged, failed: out of retries) or "held" (a live owner has it).

    A run found `running` without a live owner died with its worker (kill -9, node lost): that
    attempt is recorded as failed, and the run runs again if it has retries left.
    """
    path = run_dir(sweep_dir, run_id)
    claim, other = claims.try_claim(path)
    if claim is None:
        return None, "held"
    status = read_state(path)  # a finished run whose metrics are gone runs again
    if status.state is RunState.RUNNING:
        who = f"{other['host']}:{other['pid']}" if other else "unknown"
        job = other.get("slurm_job_id") if other else None
        error = f"worker {who}{f' (Slurm job {job})' if job else ''} died while running it"
        status = store.write_status(path, RunState.FAILED, error=error)
        log_event(path, "died", owner=who)
    if not needs_running(status, max_retries):
        claim.release()
        return None, status.state.value
    return claim, "claimed"


def run_taken(sweep: SweepFolder, run_id: str, claim: claims.Claim | None,
              should_stop: Callable[[], bool] | None = None,
              logger: RunLogger | None = None) -> store.RunStatus:
    """Train a run this process (rank 0: `claim`) has taken; record how it ended on rank 0.

    A run that raises is recorded as failed with its error (the executor decides on a retry); a
    diverged run is recorded as diverged and is final; a stopped run (StopRequested, or
    KeyboardInterrupt) is checkpointed, goes back to pending and the exception propagates.
    Nothing is half-written: rows and checkpoints are written atomically as the run goes
    (`gnsweep.training.checkpoint`), metrics.parquet at the end.
    """
    path = run_dir(sweep.root, run_id)
    writer = rank() == 0
    attempts = 0
    watchdog = None
    if writer:
        assert claim is not None, "rank 0 trains only runs it has claimed"
        try:
            attempts = store.read_status(path).attempts + 1
            where = placed()  # host, GPUs, device: "where did this run train?"
            # Logged before the status says running: whoever sees `running` finds the start.
            log_event(path, "start", attempt=attempts, **where)
            store.write_status(path, RunState.RUNNING, attempts=attempts,
                               host=socket.gethostname(), pid=os.getpid(),
                               slurm_job_id=claims.slurm_job_id(), started=time.time(),
                               traceback=None, **where)
        except BaseException:
            claim.release()  # refused before it started (a link, a full disk): not held
            raise
        watchdog = start_watchdog(path, attempts, claim, stall_seconds(sweep))
        claims.heartbeat().add(claim, alive=watchdog.alive)
    try:
        return _train_and_record(sweep, path, attempts, writer, should_stop,
                                 logger or RunLogger(), watchdog)
    finally:
        # Released only after the final status is written: whoever claims next sees it.
        if writer and claim is not None:
            claims.heartbeat().discard(claim)
            claim.release()


def stopped_by_launcher(sweep_dir: Path, run_id: str) -> None:
    """Record a run whose worker its launcher stopped, killed when it did not stop in time (a
    task blocked in a system call): back to pending with its claim released, as a worker that
    stops cleanly leaves it, so that the launcher's "went back to pending" and `gnsweep status`
    agree. Nothing is done while a live owner holds the run."""
    path = run_dir(sweep_dir, run_id)
    claim, _ = claims.try_claim(path)  # breaks the claim of the worker, which is gone
    if claim is None:
        return
    try:
        status = store.read_status(path)
        if status.state is RunState.RUNNING:
            store.write_status(path, RunState.PENDING, attempts=max(status.attempts - 1, 0))
            log_event(path, "stopped", attempt=status.attempts, killed=True)
    finally:
        claim.release()


def placed() -> dict[str, Any]:
    """Where this process trains, for a run's status and history: `gpus`, the
    CUDA_VISIBLE_DEVICES it was given (its launcher's share for it, or Slurm's; None: not set),
    and `device`, the torch device of rank 0 ("cuda:0" is the first of `gpus`; "cpu")."""
    from gnsweep.training import placement

    return {"gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "device": str(placement()[2])}


def stall_seconds(sweep: SweepFolder) -> float:
    """The sweep's `sweep.stall_seconds` (its config.yaml, which the latest launch wrote); the
    default when it cannot be read (the run then fails with the reason)."""
    from gnsweep.config import SweepConfig

    try:
        return sweep.config.sweep.stall_seconds
    except Exception:
        return SweepConfig.stall_seconds


def start_watchdog(run_path: Path, attempt: int, claim: claims.Claim,
                   limit: float) -> Watchdog:
    """The stall watchdog of a run this process (rank 0) trains: on a stall (no step logged
    for `limit` seconds, sweep.stall_seconds) it records the attempt failed (reason "stalled",
    retried like any failure), releases the claim, and ends the process
    (`gnsweep.executors.watchdog`)."""

    def on_stall(idle: float) -> None:
        error = (f"stalled: no step logged for {idle:.0f} s (sweep.stall_seconds={limit:g}); "
                 "the worker was stopped")
        store.write_status(run_path, RunState.FAILED, error=error, reason=STALLED)
        log_event(run_path, "end", attempt=attempt, state=RunState.FAILED.value, reason=STALLED)
        claims.heartbeat().discard(claim)
        claim.release()
        print(f"gnsweep: run {run_path.name}: {error}", file=sys.stderr, flush=True)

    return Watchdog(limit, on_stall)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _failed(path: Path, attempts: int, writer: bool, err: BaseException,
            error: str | None = None) -> store.RunStatus:
    """Record a run that raised `err` as failed, with its error (masked: an error may quote a
    URI with its password) and traceback; an out-of-space error with reason OUT_OF_SPACE, a
    script failure that would repeat with WILL_REPEAT (neither retried by this launch)."""
    error = redact.text(error or f"{type(err).__name__}: {err}")
    no_space = isinstance(err, OSError) and err.errno in _NO_SPACE
    repeats = isinstance(err, ScriptFailed) and err.repeats
    extra = {"reason": OUT_OF_SPACE if no_space else WILL_REPEAT if repeats else None}
    if no_space:
        error += " (out of space: not retried in this launch; free space and relaunch)"
    elif repeats:
        error += " (not retried: every attempt would fail alike; fix it and relaunch)"
    status = store.RunStatus(state=RunState.FAILED, error=error, reason=extra["reason"])
    if writer:
        # A script's own last stderr lines say why it failed; gnsweep's traceback would not.
        where: dict[str, Any] = (
            {"traceback": None, "stderr": [redact.text(line) for line in err.stderr]}
            if isinstance(err, ScriptFailed)
            else {"traceback": redact.text(traceback.format_exc(limit=8))})
        with unrecorded_end(path, attempts):
            status = store.write_status(path, RunState.FAILED, error=error, **extra, **where)
        log_event(path, "end", attempt=attempts, state=RunState.FAILED.value, **extra)
    return status


UNRECORDED = "unrecorded"
"""The attempt-log event of a run whose end could not be written to its status.json (a full
disk): `gnsweep status` shows its error beside the run it then finds `died`."""


@contextlib.contextmanager
def unrecorded_end(path: Path, attempts: int) -> Iterator[None]:
    """Around the write of a run's final status: when it fails (a full disk, a read-only
    file system), one line to the run's attempt log says why (a short append often fits where
    a new file does not), and the error goes on."""
    try:
        yield
    except OSError as err:
        with contextlib.suppress(OSError, store.StoreError):
            log_event(path, UNRECORDED, attempt=attempts,
                      error=redact.text(f"its end was not recorded: {err}"))
        raise


def unrecorded_error(run_path: Path) -> str | None:
    """Why the last attempt's end is missing from the run's status.json (`unrecorded_end`),
    None when nothing says so."""
    for line in reversed(history_lines(run_path)):
        with contextlib.suppress(ValueError, AttributeError, RecursionError):
            event = json.loads(line)
            if event.get("event") == "start":
                return None
            if event.get("event") == UNRECORDED:
                return str(event.get("error") or "")
    return None


_sigint_seen = False


def _on_sigint(signum: int, frame: Any) -> None:
    global _sigint_seen
    _sigint_seen = True
    raise KeyboardInterrupt


def interrupt_signalled() -> bool:
    """Whether a SIGINT reached this process while a run trained (`watch_interrupts`): a
    KeyboardInterrupt without one was raised by the task's own code."""
    return _sigint_seen


@contextlib.contextmanager
def watch_interrupts() -> Iterator[None]:
    """While a run trains in the main thread under Python's default SIGINT handler, note each
    SIGINT before it interrupts as that handler does. Workers that ignore SIGINT or turn it
    into a stop flag (local and torchrun workers) never get a KeyboardInterrupt from a signal:
    there, as in any other thread, one can only come from the task's own code."""
    global _sigint_seen
    _sigint_seen = False
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _train_and_record(sweep: SweepFolder, path: Path, attempts: int, writer: bool,
                      should_stop: Callable[[], bool] | None,
                      logger: RunLogger, watchdog: Watchdog | None = None) -> store.RunStatus:
    try:
        config, spec = sweep.read_run(path.name)
        train = trainer(config.task.name)

        def on_row(row: dict[str, float]) -> None:
            if watchdog is not None:
                watchdog.beat()  # a step was logged: the run is not stalled
            metrics = {name: row[name] for name in METRICS if name in row}
            # The row's own batch size (an adaptive run's varies), else the grid point's.
            logger.log(int(row["step"]), {"batch_size": spec.batch_size, **metrics})

        # A diverged run is an outcome, not a failure: only one that raised is marked failed.
        failed = True
        # The tracker shows the config as written to disk: secrets masked.
        logger.start(path.name, redact.config({**config.to_dict(), "run": asdict(spec)}))
        try:
            with watch_interrupts():
                result = train(config, spec, path if writer else None, should_stop=should_stop,
                               on_row=on_row)
            failed = False
        finally:
            if watchdog is not None:
                watchdog.stop()  # from here on the run records its own end
            logger.close(failed=failed)
    except (KeyboardInterrupt, StopRequested) as err:
        if isinstance(err, StopRequested) or interrupt_signalled():
            if writer:
                store.write_status(path, RunState.PENDING, attempts=attempts - 1)
                log_event(path, "stopped", attempt=attempts)
            raise
        # No SIGINT reached this process: the task itself raised KeyboardInterrupt. A failure
        # with its reason, its attempt counted, never a stop that leaves the run pending.
        return _failed(path, attempts, writer, err,
                       "KeyboardInterrupt raised inside the task (no interrupt signal reached "
                       "the worker)")
    except Exception as err:
        return _failed(path, attempts, writer, err)
    status = store.RunStatus(state=RunState(result.state))
    if writer:
        with unrecorded_end(path, attempts):
            status = store.write_status(
                path, result.state, steps=result.steps, reason=result.reason,
                final_loss=result.final_loss, train_seconds=result.train_seconds,
                train_cpu_seconds=result.train_cpu_seconds,
                rows=result.rows, examples=result.examples, noise_method=result.noise_method,
                b_simple_nan_share=result.b_simple_nan_share,
                **({"noise_measured": result.noise_measured} if result.noise_measured else {}))
        log_event(path, "end", attempt=attempts, state=result.state,
                  noise_method=(result.noise_method or {}).get("method"),
                  b_simple_nan_share=result.b_simple_nan_share)
    return status


def trainer(task: str) -> Callable[..., Any]:
    """What trains a run of `task`: `training.train` (gnsweep's loop), or for task=script
    `training.script_runner.run_script` (the user's command as a process); both take (config, spec,
    out_dir, should_stop=, on_row=) and return a `RunResult`."""
    from gnsweep.tasks import SCRIPT

    if task == SCRIPT:
        from gnsweep.training.script_runner import run_script

        return run_script
    from gnsweep.training import train

    return train


def warm_up(sweep: SweepFolder, run_id: str, stall_s: float = 0.0) -> None:
    """Import the training code and the task's data libraries once, before the first run.

    The first optimizer a process builds imports torch._dynamo (over a second here): build one.
    Only a speed-up: a run whose config cannot be read fails when it runs, not here. Building
    the task runs the task's own code, before any run (and its stall watchdog) has started:
    bounded by `stall_s` (`gnsweep.stall.bounded`; 0: no bound), whose `Stalled` is the one
    error raised here.
    """
    from gnsweep.stall import Stalled, bounded

    with contextlib.suppress(Exception):
        _warm_imports()
    try:
        bounded(stall_s, f"task of run {run_id}: building it in a worker before its first run",
                lambda: _warm_task(sweep, run_id))
    except Stalled:
        raise
    except Exception:  # the run itself reports the error
        pass


def _warm_imports() -> None:
    import torch

    from gnsweep.training import train  # noqa: F401

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _warm_task(sweep: SweepFolder, run_id: str) -> None:
    from gnsweep.tasks import SCRIPT, make_task

    config, spec = sweep.read_run(run_id)
    if config.task.name == SCRIPT:  # a command: nothing to build in this process
        return
    make_task(config.task.name, config.task.options, spec.seed)


def execute_run(sweep: SweepFolder, run_id: str,
                should_stop: Callable[[], bool] | None = None, max_retries: int = 0,
                logger: RunLogger | None = None) -> Outcome:
    """Take one run and train it in this process (no torch.distributed)."""
    claim, why = take_run(sweep.root, run_id, max_retries)
    if claim is None:
        return Outcome(why, ran=False)
    return Outcome(run_taken(sweep, run_id, claim, should_stop, logger).state.value, ran=True)
