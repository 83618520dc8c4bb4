"""Executor throughput: does the local pool keep every core busy, and what does torchrun cost?

- local: the default sweep (56 runs) on `--workers` processes. Goal: the launch's wall time at
  most 1.15x the runs' own training time (`train_seconds`, summed) divided by the workers. The
  wall time is `gnsweep.sweep.launch` from call to return (worker start-up included; the CLI's
  own imports and Hydra compose are not). The start-up (importing the task's data libraries and
  torch._dynamo, about 2 s of one core here, once per launch) is also shown apart.
- torchrun: the start-up of one torchrun job with 2 processes that trains nothing, and the
  overhead per run of a job that trains `--torchrun-runs` runs in turn:
  (wall - start-up - training time) / runs. Starting torchrun per run would cost start-up + that.

    gnsweep bench executors [--workers 2] [--torchrun-runs 8] [--skip-torchrun] [--set K=V ...]

`--set` takes Hydra overrides for the local pool's sweep (e.g. --set sweep=tiny for a quick one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from gnsweep import store
from gnsweep.compose import compose
from gnsweep.paths import RunPaths, run_dir
from gnsweep.sweep import launch, prepare

GOAL = 1.15


def _attempts(sweep_dir: Path) -> list[dict]:
    """(pid, start, end, train seconds) of every run, in order of start, from the attempt logs."""

    out = []
    for run_id in store.run_ids(sweep_dir):
        path = run_dir(sweep_dir, run_id)
        history = RunPaths(path).history
        if not history.exists():  # prepared, not run (--torchrun-runs below the grid)
            continue
        events = [json.loads(line) for line in history.read_text().splitlines()]
        out.append({"pid": events[0]["pid"], "start": events[0]["time"],
                    "end": events[-1]["time"],
                    "train": store.read_status(path).train_seconds or 0.0})
    return sorted(out, key=lambda a: a["start"])


def bench_local(root: Path, workers: int, overrides: list[str] | None = None) -> dict:
    config = compose([*(overrides or []), f"executor.workers={workers}"])
    sweep_dir = root / "local"
    began = time.time()
    start = time.perf_counter()
    launch(config, sweep_dir, show_progress=False)
    wall = time.perf_counter() - start
    ended = time.time()
    runs = _attempts(sweep_dir)
    train = [a["train"] for a in runs]
    ideal = sum(train) / workers
    # Where the rest of the wall time went, summed over the workers.
    first = {a["pid"]: a["start"] for a in reversed(runs)}
    last = {a["pid"]: a["end"] for a in runs}
    startup = sum(t - began for t in first.values()) / workers
    tail = sum(ended - t for t in last.values()) / workers
    outside = sum(a["end"] - a["start"] - a["train"] for a in runs) / workers
    return {"runs": len(train), "workers": workers, "wall_s": round(wall, 3),
            "train_sum_s": round(sum(train), 3), "longest_run_s": round(max(train), 3),
            "ratio": round(wall / ideal, 3), "goal_ratio": GOAL,
            "ratio_after_start": round((wall - startup) / ideal, 3),
            "until_first_run_s": round(startup, 3), "after_last_run_s": round(tail, 3),
            "per_run_outside_training_s": round(outside / max(1, len(runs) / workers), 4)}


def bench_torchrun(root: Path, n_runs: int) -> dict:
    from gnsweep.executors.torchrun import worker_command, write_runs_file

    # Short runs of the default sweep (larger batches, middle learning rates).
    config = compose(["executor=torchrun", "executor.nproc_per_node=2",
                      "sweep.batch_sizes=[64,128,256,512]", "sweep.learning_rates=[0.6,1.5]"])
    sweep_dir = root / "torchrun"
    run_ids = [s.run_id for s in prepare(sweep_dir, config)][:n_runs]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def timed(ids: list[str], attempts: int = 1) -> float:
        """Seconds of one torchrun job; a job that fails says how (its output's end). A job
        without runs may start again (`attempts`): nothing of it is kept."""
        for attempt in range(1, attempts + 1):
            command = worker_command(sweep_dir, write_runs_file(sweep_dir, ids), nproc=2,
                                     max_retries=0)
            start = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode == 0:
                return time.perf_counter() - start
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            if attempt == attempts:
                raise RuntimeError(f"torchrun job exited {done.returncode}:\n{tail}")
            print(f"torchrun job exited {done.returncode}; starting it again:\n{tail}")
        raise AssertionError("unreachable")

    startup = min(timed([], attempts=2) for _ in range(2))
    wall = timed(run_ids)
    runs = _attempts(sweep_dir)
    train = sum(a["train"] for a in runs)
    # The first run pays the workers' one-off warm-up (task data, first DDP set-up); the
    # others show the steady cost of a run: claim, broadcast, DDP wrap, status and metrics.
    first = runs[0]["end"] - runs[0]["start"] - runs[0]["train"]
    steady = [b["end"] - a["end"] - b["train"] for a, b in itertools.pairwise(runs)]
    return {"runs": len(runs), "startup_s": round(startup, 3), "wall_s": round(wall, 3),
            "train_sum_s": round(train, 3),
            "overhead_per_run_s": round((wall - startup - train) / len(runs), 4),
            "first_run_warmup_s": round(first, 3),
            "steady_overhead_per_run_s": round(sum(steady) / max(1, len(steady)), 4)}


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="gnsweep bench executors")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--torchrun-runs", type=int, default=8)
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="A Hydra override for the local pool's sweep (repeatable).")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="gnsweep-bench-"))
    load = os.getloadavg()[0]
    try:
        local = bench_local(root, args.workers, args.overrides)
        torchrun = None if args.skip_torchrun else bench_torchrun(root, args.torchrun_runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average before: {load:.2f} (other processes slow both measurements)")
    print(f"{'local pool, default sweep':<44}{'value':>10}")
    print(f"{'  runs / workers':<44}{local['runs']:>6} / {local['workers']}")
    print(f"{'  wall time of the launch (s)':<44}{local['wall_s']:>10.2f}")
    print(f"{'  sum of the runs own training time (s)':<44}{local['train_sum_s']:>10.2f}")
    print(f"{f'  wall / (sum / workers) (goal <= {GOAL})':<44}{local['ratio']:>10.3f}")
    print(f"{'  per worker: launch -> first run (s)':<44}{local['until_first_run_s']:>10.2f}")
    print(f"{'  per worker: last run -> launch returns (s)':<44}{local['after_last_run_s']:>10.2f}")
    print(f"{'  wall / (sum / workers), after the start-up':<44}"
          f"{local['ratio_after_start']:>10.3f}")
    print(f"{'  per run: outside training (s)':<44}"
          f"{local['per_run_outside_training_s']:>10.3f}")
    if torchrun is not None:
        print(f"{'torchrun, 2 processes (gloo)':<44}")
        print(f"{'  start-up and exit, no run (s)':<44}{torchrun['startup_s']:>10.2f}")
        print(f"{'  runs taken in turn by one job':<44}{torchrun['runs']:>10}")
        print(f"{'  wall time of that job (s)':<44}{torchrun['wall_s']:>10.2f}")
        print(f"{'  sum of the runs training time (s)':<44}{torchrun['train_sum_s']:>10.2f}")
        print(f"{'  overhead per run, all (s)':<44}{torchrun['overhead_per_run_s']:>10.3f}")
        print(f"{'  of which first run warm-up (s)':<44}{torchrun['first_run_warmup_s']:>10.3f}")
        print(f"{'  steady overhead per later run (s)':<44}"
              f"{torchrun['steady_overhead_per_run_s']:>10.3f}")
    result = {"subject": "executors", "load_average": round(load, 2), "local": local,
              "torchrun": torchrun}
    print(json.dumps(result))
    return result
