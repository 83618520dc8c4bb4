"""Cost of the training recipe: the step time of the real training loop with 4 accumulation
pieces over the whole-batch step, and in bf16 over fp32.

`python -m gnsweep.bench recipe` (or `gnsweep bench recipe`). The digits MLP, at a few batch
sizes; each variant is a run of the training loop (`gnsweep.training.run`: draw, forward and
backward, noise scale, step, log), the variants interleaved round by round, the fastest round
of each reported (other load only ever adds time):

- pieces: train.microbatch_size = B/4 (4 forward/backward passes, gradients accumulated) over
  the whole batch in one pass: what bounding the memory costs;
- bf16: train.precision=bf16 (autocast) over fp32. On a CPU without bf16 units autocast adds
  casts and saves nothing; the ratio to read is the one on your GPU.

Flags: `--quick` (fewer rounds and steps).
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from gnsweep.config import Config, SweepConfig, TaskConfig, TrainConfig
from gnsweep.runs import RunSpec
from gnsweep.training import build_run, run

BATCH_SIZES = (64, 256, 1024)
PIECES = 4
VARIANTS = {"whole": TrainConfig(), "pieces": None, "bf16": TrainConfig(precision="bf16")}


def _config(batch: int, steps: int, variant: str) -> Config:
    train = VARIANTS[variant] or TrainConfig(microbatch_size=batch // PIECES)
    # A learning rate far below any target's: the runs take every step of the budget.
    return Config(task=TaskConfig("digits"),
                  sweep=SweepConfig(batch_sizes=[batch], learning_rates=[1e-4],
                                    targets=[1e-9], max_steps=steps), train=train)


def _seconds_per_step(batch: int, rounds: int, steps: int) -> dict[str, float]:
    """Each variant's fastest round, seconds per step (the build of each run not timed)."""
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            state = build_run(_config(batch, steps, variant), RunSpec(batch, 1e-4))
            start = time.perf_counter()
            run(state)
            times[variant].append((time.perf_counter() - start) / steps)
    return {v: min(t) for v, t in times.items()}


def main(argv: list[str]) -> dict[str, Any]:
    import argparse

    parser = argparse.ArgumentParser(prog="gnsweep bench recipe",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 10 steps, not 5 x 30.")
    parser.add_argument("--batch-sizes", type=lambda s: tuple(int(b) for b in s.split(",")),
                        default=BATCH_SIZES, help="Comma-separated (default "
                        f"{','.join(map(str, BATCH_SIZES))}).")
    args = parser.parse_args(argv)
    rounds, steps = (2, 10) if args.quick else (5, 30)
    torch.set_num_threads(1)
    rows = []
    for batch in args.batch_sizes:
        seconds = _seconds_per_step(batch, rounds, steps)
        rows.append({"batch": batch, "whole_ms": 1e3 * seconds["whole"],
                     "pieces": seconds["pieces"] / seconds["whole"],
                     "bf16": seconds["bf16"] / seconds["whole"]})
    columns = ["batch", "whole_ms", "pieces", "bf16"]
    print(f"training-recipe cost on the digits MLP (step time of the training loop / the "
          f"whole-batch fp32 step, fastest of {rounds} interleaved rounds of {steps} steps, 1 "
          f"thread; pieces: train.microbatch_size = B/{PIECES}; bf16: autocast on this CPU)")
    width = {c: max(len(c), 8) for c in columns}
    print("  ".join(f"{c:>{width[c]}}" for c in columns))
    for row in rows:
        print("  ".join(f"{row[c]:>{width[c]}.3g}" if isinstance(row[c], float)
                        else f"{row[c]:>{width[c]}}" for c in columns))
    result = {"subject": "recipe", "rows": rows, "pieces": PIECES,
              "device": "cuda" if torch.cuda.is_available() else "cpu"}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
