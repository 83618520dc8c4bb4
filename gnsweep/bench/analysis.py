"""Analysis speed: `analyze_sweep` on a sweep of many runs against pyarrow reading its files.

Writes a synthetic sweep (default 1,000 runs x 2,000 logged steps: 2 million metric rows, real
parquet files in the store's layout), then times (a) pyarrow alone reading, from every metrics
file, the columns the analysis reads (`analysis.load`: the seven core ones and the newer
optional ones: drift, probes, exact truth, metric) and (b) the whole analysis: load,
steps-to-target at the centred smoother's window and refits at half and double it, fronts,
fits, and writing its tables. Reports (b)/(a); the goal is at most 2.5. (a) reads on one
thread, pyarrow's fastest way on these small files (the analysis reads so too); for comparison
with earlier versions, (b) over (a) with pyarrow's thread pool, and over the seven core columns.

    python -m gnsweep.bench analysis [--runs=N] [--steps=N] [--repeat=N] [--keep=DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from gnsweep import store, tables
from gnsweep.analysis.load import METRIC_COLUMNS
from gnsweep.analysis.steps import CURVE_COLUMNS
from gnsweep.paths import RunPaths, SweepPaths, run_dir
from gnsweep.sweep_analysis import analyze_sweep

TARGETS = (1.0, 0.5, 0.25)


def write_sweep(root: Path, n_runs: int, n_steps: int, seed: int = 0) -> None:
    """Runs over a batch-size x learning-rate x seed grid whose loss decays at a rate given by
    S = S_min + E_min/B at eps_opt(B) (eq. 2.11), with noise."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    SweepPaths(root).config_file.write_text(
        f"sweep:\n  targets: {list(TARGETS)}\ntrain:\n  optimizer: sgd\n")
    batches = [2 ** k for k in range(3, 13)]
    lrs = list(np.geomspace(0.05, 5.0, 10))
    n_seeds = max(1, math.ceil(n_runs / (len(batches) * len(lrs))))
    grid = [(b, lr, s) for s in range(n_seeds) for b in batches for lr in lrs][:n_runs]
    step = np.arange(1, n_steps + 1)
    for b, lr, s in grid:
        run_id = f"b{b:05d}_lr{lr:.4g}_s{s}"
        path = run_dir(root, run_id)
        store.write_json(RunPaths(path).record, {"run": {
            "batch_size": b, "learning_rate": float(lr), "seed": s}})
        # Steps to halve the loss: the hyperbola at the best learning rate, a bowl around it.
        best = 2.0 / (1 + 64 / b)
        half = (n_steps / 40) * (1 + 64 / b) * math.exp(0.3 * math.log(lr / best) ** 2)
        loss = 2.0 * np.exp2(-step / half) * np.exp(rng.normal(0, 0.05, n_steps))
        smooth = np.convolve(loss, np.ones(8) / 8, mode="full")[:n_steps]
        nan = np.full(n_steps, np.nan)
        rows = {f.name: nan for f in tables.METRICS_SCHEMA}
        rows.update(step=step, examples=step * b, loss=loss, loss_smooth=smooth,
                    lr=np.full(n_steps, lr), b_simple=50 + rng.normal(0, 5, n_steps),
                    wall_time=step * 1e-3)
        table = store.metrics_table({k: np.asarray(v).tolist() for k, v in rows.items()})
        store.write_table(RunPaths(path).metrics, table)
        store.write_json(RunPaths(path).status, {"state": "done", "attempts": 1})


GOAL = 2.5


def time_read(root: Path, columns: list[str] | None = None, threads: bool = False) -> float:
    """pyarrow alone, its fastest way for many small files (ParquetFile.read, not read_table;
    one thread, not its pool: on these files the pool costs more than it saves), or with
    `threads` (its default, what earlier versions of this bench timed): `columns` (default:
    those of CURVE_COLUMNS each file has, what the analysis reads)."""
    start = time.perf_counter()
    for run_id in store.run_ids(root):
        file = pq.ParquetFile(SweepPaths(root).run(run_id).metrics)
        names = file.schema_arrow.names
        file.read(columns=columns or [c for c in CURVE_COLUMNS if c in names],
                  use_threads=threads)
    return time.perf_counter() - start


def time_analysis(root: Path) -> float:
    start = time.perf_counter()
    analyze_sweep(root)
    return time.perf_counter() - start


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="gnsweep bench analysis")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--keep", type=Path, default=None, help="Write the sweep here, keep it.")
    args = parser.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="gnsweep-bench-")) / "sweep"
    load = os.getloadavg()[0]
    try:
        if not SweepPaths(root).config_file.exists():
            start = time.perf_counter()
            write_sweep(root, args.runs, args.steps)
            print(f"wrote {args.runs} runs x {args.steps} steps in "
                  f"{time.perf_counter() - start:.1f} s -> {root}")
        time_read(root)  # warm the page cache for both
        # Interleaved, best of each: a busy machine slows both alike.
        reads, threaded, cores, analyses = [], [], [], []
        for _ in range(args.repeat):
            reads.append(time_read(root))
            threaded.append(time_read(root, threads=True))
            cores.append(time_read(root, METRIC_COLUMNS))
            analyses.append(time_analysis(root))
        read, pool, core = min(reads), min(threaded), min(cores)
        analysis = min(analyses)
    finally:
        if args.keep is None:
            shutil.rmtree(root.parent, ignore_errors=True)
    result = {"subject": "analysis", "runs": args.runs, "steps": args.steps,
              "rows": args.runs * args.steps, "pyarrow_read_s": round(read, 3),
              "pyarrow_read_threads_s": round(pool, 3), "ratio_threads": round(analysis / pool, 2),
              "pyarrow_read_core_s": round(core, 3), "analyze_s": round(analysis, 3),
              "ratio": round(analysis / read, 2), "ratio_core": round(analysis / core, 2),
              "goal_ratio": GOAL, "load_average": round(load, 2)}
    print(f"fastest of {args.repeat} interleaved rounds, {args.runs} runs x {args.steps} steps; "
          f"load average before: {load:.2f} (other processes slow the analysis more than the "
          "read: the ratio rises on a busy machine)")
    print(f"{'what':<48}{'seconds':>10}")
    print(f"{'pyarrow reads the columns the analysis reads':<48}{read:>10.3f}")
    print(f"{'  the same with its thread pool (its default)':<48}{pool:>10.3f}")
    print(f"{'pyarrow reads the 7 core columns':<48}{core:>10.3f}")
    print(f"{'gnsweep analyze (load..write)':<48}{analysis:>10.3f}")
    print(f"{f'ratio (goal <= {GOAL})':<48}{analysis / read:>10.2f}")
    print(f"{'ratio over the 7-column read':<48}{analysis / core:>10.2f}")
    print(f"{'ratio over the read with the pool':<48}{analysis / pool:>10.2f}")
    print(json.dumps(result))
    return result
