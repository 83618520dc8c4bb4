"""The planner against the full grid, side by side in one run, on the same task and config:
compute (examples processed by all runs, diverged ones included) as a ratio, and B_crit of each
per target. The goal: plan's B_crit within 25% of the grid's at every target with at
most 30% of its compute (goal 10%).

    python -m gnsweep.bench planner [--set KEY=VALUE ...] [--workers N] [--keep DIR]

`--set` takes Hydra overrides (e.g. --set task=linreg --set sweep=linreg). Runs with one torch
thread per worker; on a shared machine the full default digits grid takes several minutes.
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

GOAL_COMPUTE = 0.30
GOAL_B_CRIT = 0.25


def main(argv: list[str]) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from gnsweep.commands.plan import examples_processed, plan
    from gnsweep.compose import compose
    from gnsweep.sweep import launch
    from gnsweep.sweep_analysis import analyze_sweep

    parser = argparse.ArgumentParser(prog="gnsweep bench planner")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="A Hydra override, e.g. task=linreg (repeatable).")
    parser.add_argument("--workers", type=int, default=0, help="Worker processes (0: cores).")
    parser.add_argument("--keep", type=Path, default=None, help="Write both sweeps here, keep "
                                                                "them (reused when present).")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.workers:
        overrides.append(f"executor.workers={args.workers}")
    config = compose(overrides)
    root = args.keep or Path(tempfile.mkdtemp(prefix="gnsweep-bench-planner-"))
    grid_dir, plan_dir = root / "grid", root / "plan"
    try:
        start = time.perf_counter()
        launch(config, grid_dir, show_progress=False)
        grid_s = time.perf_counter() - start
        start = time.perf_counter()
        planned = plan(config, plan_dir, show_progress=False, echo=lambda line: None)
        plan_s = time.perf_counter() - start
        grid_fits = analyze_sweep(grid_dir, write=False).fits.set_index("target")
        plan_fits = analyze_sweep(plan_dir, write=False).fits.set_index("target")
        grid_examples, plan_examples = examples_processed(grid_dir), examples_processed(plan_dir)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    ratio = plan_examples / grid_examples
    rows = []
    for target in sorted(config.sweep.targets, reverse=True):
        g, p = float(grid_fits.loc[target, "b_crit"]), float(plan_fits.loc[target, "b_crit"])
        rel = abs(p / g - 1) if math.isfinite(g) and math.isfinite(p) else math.nan
        rows.append({"target": target, "b_crit_grid": round(g, 4), "b_crit_plan": round(p, 4),
                     "rel_diff": round(rel, 4)})
    ok = ratio <= GOAL_COMPUTE and all(r["rel_diff"] <= GOAL_B_CRIT for r in rows)
    n_grid = len(config.sweep.batch_sizes) * len(config.sweep.learning_rates)
    result = {"subject": "planner", "task": config.task.name, "overrides": overrides,
              "grid_runs": n_grid * len(config.sweep.seeds),
              "plan_runs": len(set(planned.run_ids)), "plan_rounds": planned.rounds,
              "grid_examples": grid_examples, "plan_examples": plan_examples,
              "compute_ratio": round(ratio, 4), "goal_compute_ratio": GOAL_COMPUTE,
              "grid_s": round(grid_s, 1), "plan_s": round(plan_s, 1), "targets": rows,
              "done_when_met": ok}
    print(f"{'':<26}{'full grid':>14}{'plan':>14}")
    print(f"{'runs':<26}{result['grid_runs']:>14}{result['plan_runs']:>14}")
    print(f"{'examples processed':<26}{grid_examples:>14,}{plan_examples:>14,}")
    print(f"{'wall seconds':<26}{grid_s:>14.1f}{plan_s:>14.1f}")
    for row in rows:
        print(f"{'B_crit at loss ' + format(row['target'], 'g'):<26}{row['b_crit_grid']:>14.4g}"
              f"{row['b_crit_plan']:>14.4g}   ({row['rel_diff']:.1%} apart; goal <= 25%)")
    print(f"compute ratio plan/grid {ratio:.3f} (goal <= {GOAL_COMPUTE:g}, aim 0.1): "
          f"{'met' if ok else 'NOT met'}")
    print(json.dumps(result))
    return result
