"""What checkpointing costs a run: the default sweep's runs trained as `gnsweep launch` trains
them (checkpoints at the default interval, `train.checkpoint_seconds`=600, rows streamed to the
run folder), and at a checkpoint every `--every` steps, each against the same runs without
checkpoints or streamed rows (the loop alone, metrics written at the end).

Ratios of wall times, fastest of `--rounds` interleaved rounds, 1 thread; also the time of one
save and the size of one checkpoint. Goal: the default interval within 2% of no checkpoints.

    gnsweep bench checkpoint [--rounds 5] [--runs 3] [--steps 300] [--every 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gnsweep.compose import compose
from gnsweep.config import Config
from gnsweep.paths import run_dir
from gnsweep.runs import expand_grid
from gnsweep.training import build_run, run, train
from gnsweep.training.checkpoint import Checkpointer

GOAL = 1.02


def _config(steps: int, every: int) -> Config:
    config = compose([f"sweep.max_steps={steps}"])
    return dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                 checkpoint_every=every))


def _time(config: Config, specs: list, root: Path, mode: str) -> float:
    """Seconds to train `specs` in turn: `none` without a checkpointer, else through `train`."""
    shutil.rmtree(root, ignore_errors=True)
    start = time.perf_counter()
    for spec in specs:
        path = run_dir(root, spec.run_id)
        path.mkdir(parents=True)
        if mode == "none":
            run(build_run(config, spec), path)
        else:
            train(config, spec, path)
    return time.perf_counter() - start


def _one_save(config: Config, spec: Any, root: Path) -> tuple[float, int]:
    """(seconds, bytes) of one checkpoint of a run's state after a few steps."""
    state = build_run(config, spec)
    path = root / "one" / spec.run_id
    path.mkdir(parents=True)
    run(state)  # a whole run: the state at its end
    saver = Checkpointer(path)
    start = time.perf_counter()
    saved = saver.save(state)
    seconds = time.perf_counter() - start
    assert saved is not None
    return seconds, saved.path.stat().st_size


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="gnsweep bench checkpoint",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3, help="Grid points of the default sweep.")
    parser.add_argument("--steps", type=int, default=300, help="Steps a run at most.")
    parser.add_argument("--every", type=int, default=50, help="A checkpoint every N steps.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    default = _config(args.steps, 0)
    frequent = _config(args.steps, args.every)
    grid = expand_grid(default)
    specs = grid[len(grid) // 2: len(grid) // 2 + args.runs]  # mid-grid: no quick divergence
    modes = {"none": default, "default": default, "every": frequent}
    best = dict.fromkeys(modes, float("inf"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for _ in range(args.rounds):
            for mode, config in modes.items():
                best[mode] = min(best[mode], _time(config, specs, root / mode,
                                                   "none" if mode == "none" else "train"))
        save_s, size = _one_save(default, specs[0], root)
    result = {"subject": "checkpoint", "runs": len(specs), "steps": args.steps,
              "default_ratio": best["default"] / best["none"],
              "every_ratio": best["every"] / best["none"], "every": args.every,
              "save_ms": 1e3 * save_s, "checkpoint_bytes": size, "plain_s": best["none"],
              "goal": GOAL}
    print(f"checkpointing cost ({len(specs)} runs of the default sweep, <= {args.steps} steps "
          f"each, fastest of {args.rounds} interleaved rounds, 1 thread): default interval "
          f"{result['default_ratio']:.3f}x (goal <= {GOAL}), every {args.every} steps "
          f"{result['every_ratio']:.3f}x; one save {result['save_ms']:.1f} ms, "
          f"{size / 1024:.0f} KiB")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
