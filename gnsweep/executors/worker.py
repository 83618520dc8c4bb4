"""The worker entry point: one process group that trains many runs in turn.

    python -m gnsweep.executors.worker SWEEP_DIR --runs-file FILE [--max-retries N]
    torchrun --standalone --nproc_per_node 2 -m gnsweep.executors.worker SWEEP_DIR --runs-file F

Under torchrun (WORLD_SIZE set) it initialises the process group once (nccl with GPUs, else
gloo) and keeps it for every run: torchrun's start-up costs seconds, more than a small run.
Rank 0 claims the next run (`gnsweep.executors.take_run`) and broadcasts its id; every rank
trains it as a DDP replica; rank 0 alone writes. Runs another live executor holds are skipped:
their launcher waits for them. The runs file holds one run id a line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gnsweep import allocator
from gnsweep.distributed import close_process_group
from gnsweep.errors import StopRequested
from gnsweep.executors import (
    LAUNCH_ENV,
    PREEMPTED,
    open_folder,
    process_logger,
    run_taken,
    stall_seconds,
    take_run,
    warm_up,
)
from gnsweep.executors.watchdog import STALLED_EXIT
from gnsweep.folder import SweepFolder
from gnsweep.notices import kept_logging, once_per_launch
from gnsweep.stall import Stalled
from gnsweep.store import RunState


def init_process_group() -> bool:
    """Join torchrun's process group when started by torchrun; False without one."""
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return dist.is_initialized()
    if torch.cuda.is_available():
        local_rank, seen = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= seen:  # nccl refuses two ranks on one GPU: say why, not NCCL's words
            raise SystemExit(f"gnsweep: local rank {local_rank} has no GPU of its own: this job "
                             f"sees {seen} (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES')}); use at most {seen} "
                             "processes per node")
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    # A peer that dies mid-run must not leave the others waiting for half an hour.
    timeout = timedelta(minutes=5)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return True
    # After an elastic restart (--max-restarts) the agent's store still holds the addresses
    # of the processes that died, and gloo's connect would wait for them: each incarnation
    # keys its own under a prefix of its restart count.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"gnsweep/restart{restart}", store),
                            rank=rank, world_size=world, timeout=timeout)
    return True


def serve(sweep: SweepFolder, run_ids: list[str], max_retries: int,
          should_stop: Callable[[], bool]) -> int:
    """Train `run_ids` in turn (each once, failed ones again while retries last); returns how
    many this process group trained. `sweep`: the folder opened at the worker's start."""
    sweep_dir = sweep.root
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    queue = deque(run_ids)
    trained = 0
    logger = process_logger(sweep)  # one per process group (rank 0 logs), for every run
    while True:
        run_id, claim = None, None
        if rank == 0 and not should_stop():
            while queue and claim is None:
                candidate = queue.popleft()
                claim, _ = take_run(sweep_dir, candidate, max_retries)
                run_id = candidate if claim is not None else None
        if distributed:
            box: list[Any] = [run_id]
            dist.broadcast_object_list(box, src=0)
            run_id = box[0]
        if run_id is None:
            return trained
        status = run_taken(sweep, run_id, claim, should_stop, logger)
        trained += 1
        if status.state is RunState.FAILED:
            queue.append(run_id)  # take_run decides whether it has retries left


class StopFlag:
    """Stop on SIGTERM/SIGINT/SIGUSR2, or when process `stop_with` (our launcher) is gone;
    `signum` remembers the signal."""

    def __init__(self, stop_with: int | None) -> None:
        self.stop_with = stop_with
        self.signum: int | None = None
        # SIGUSR2: Slurm's warning ahead of the time limit (submitit asks for it).
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def __call__(self) -> bool:
        if self.stop_with is not None and self.signum is None:
            try:
                os.kill(self.stop_with, 0)
            except ProcessLookupError:
                return True
        return self.signum is not None


def main(argv: list[str] | None = None) -> int:
    with kept_logging():  # called in-process, the caller's logging is as it was after
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gnsweep.executors.worker")
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--runs-file", type=Path, required=True, help="One run id a line.")
    parser.add_argument("--max-retries", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per process.")
    parser.add_argument("--stop-with", type=int, default=None,
                        help="Stop cleanly when this pid (the launcher) is gone.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator.tune()  # a step's temporaries stay on the heap (gnsweep.allocator)
    once_per_launch(args.sweep_dir, os.environ.get(LAUNCH_ENV))  # a notice once, not per run
    should_stop = StopFlag(args.stop_with)
    run_ids = [line.strip() for line in args.runs_file.read_text().splitlines() if line.strip()]
    init_process_group()
    folder = open_folder(args.sweep_dir)  # config.yaml parsed once, for every run served here
    if run_ids:
        try:  # before claiming: a claimed run starts at once
            warm_up(folder, run_ids[0], stall_seconds(folder))
        except Stalled as err:  # the task blocks: end, rather than hang the job
            print(f"gnsweep: {err}", file=sys.stderr, flush=True)
            close_process_group(False)
            return STALLED_EXIT
    stopped = clean = False
    try:
        serve(folder, run_ids, args.max_retries, should_stop)
        clean = True
    except (KeyboardInterrupt, StopRequested):
        stopped = True  # the run in flight is checkpointed and back to pending
    finally:
        close_process_group(clean)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # Under torchrun a stop is clean: exit 0, or its agent would restart the workers
        # (--max-restarts); the job's own process knows which signal came.
        return 0
    if should_stop.signum == signal.SIGUSR2:
        return PREEMPTED  # also warned between two runs: those not taken want the requeue
    return 130 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
