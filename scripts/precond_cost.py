"""What B_simple_P costs: one measured training step (forward, backward, monitor.step, Adam's
update) with and without the preconditioned pair, side by side, interleaved, best of N.

    PYTHONPATH=. python scripts/precond_cost.py [--task chars|linreg] [--batch 8] [--reps 20]

Variants: `plain` (the monitor's own method, B_simple only), `precond` (the same monitor given
the optimizer: per-example norms for B_simple, and the batch split into noise.microbatches = 4
micro-batches for the P-norm pair), `split` (micro-batches without P: what the split alone
costs), `split+P` (micro-batches for both pairs: the P-norm adds one weighted dot a
micro-batch). One thread: timings on a shared machine are noisy, so the minimum of interleaved
repetitions is reported, as a ratio to the unmeasured step.
"""

from __future__ import annotations

import argparse
import time

import torch

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.tasks import make_task
from gnsweep.training.backward import backward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="chars")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = make_task(args.task, {}, seed=0)
    gen = torch.Generator().manual_seed(0)
    batch = task.sample(args.batch, gen)
    # One model, optimizer and monitor per variant: hooks of one never run in another.
    variants: dict[str, tuple] = {}
    for name, method in (("none", None), ("plain", "per_example"), ("precond", "per_example"),
                         ("split", "microbatch"), ("split+P", "microbatch")):
        model = task.model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        monitor = None if method is None else NoiseScaleMonitor(model, method, ema_fraction=0.2)
        if name in ("precond", "split+P"):
            assert monitor is not None
            monitor.precondition(optimizer)
        variants[name] = (model, optimizer, monitor)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps + 2):  # the first two: Adam's state, warm caches
        for name, (model, optimizer, monitor) in variants.items():
            k = 4 if monitor is not None and (monitor.needs_microbatches
                                             or monitor.wants_microbatches) else 1
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            if monitor is None:
                task.loss(model, batch).backward()
            else:
                backward(model, task, batch, k, monitor)
                monitor.step()
            optimizer.step()
            if rep >= 2:
                times[name].append(time.perf_counter() - started)
    base = min(times["none"])
    print(f"task {args.task}, batch {args.batch} ({args.reps} interleaved repetitions, best):")
    for name, values in times.items():
        print(f"  {name:8s} {min(values) * 1e3:8.2f} ms  {min(values) / base:5.2f}x")
    estimate = variants["precond"][2].estimate
    assert estimate is not None
    print(f"  b_simple {estimate.b_simple:.4g}, b_simple_precond {estimate.b_simple_precond:.4g}")


if __name__ == "__main__":
    main()
