"""Probe a new-protocol task outside the sweep: train one (batch size, learning rate) pair and
print the per-step cost and the step at which the smoothed loss (or the task's metric) first
crosses each target.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/task_probe.py mnist1d --batch 64 \
        --lr 0.1 --optimizer adam --steps 2000 --targets 1.0 0.5 0.3 --workers 2

Smoothing: an EMA over about `--ema-examples` examples (as the sweep's loss_ema_examples), at
least over one step. For a task with `metric_name` the metric is tracked instead of the loss.
"""

from __future__ import annotations

import argparse
import importlib
import math
import multiprocessing
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("task")
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--lr", type=float, nargs="+", default=[0.1])
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam"])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--targets", type=float, nargs="+", default=[])
    parser.add_argument("--ema-examples", type=float, default=128.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-examples", type=float, default=0.0, help="0: no limit")
    parser.add_argument("--workers", type=int, default=1, help="processes for the grid")
    parser.add_argument("--option", nargs="*", default=[], help="key=value task options")
    args = parser.parse_args()
    # Largest batches first, as a sweep would start its slowest runs early.
    grid = [(b, lr) for b in sorted(args.batch, reverse=True) for lr in args.lr]
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        pool.starmap(run, [(args, b, lr) for b, lr in grid], chunksize=1)
    print(f"grid of {len(grid)} runs on {args.workers} processes: "
          f"{time.perf_counter() - start:.0f} s wall", flush=True)


def run(args, batch_size: int, lr: float) -> None:
    torch.set_num_threads(1)
    module = importlib.import_module(f"gnsweep.tasks.{args.task}")
    values = {}
    for item in args.option:
        key, value = item.split("=", 1)
        values[key] = type(getattr(module.Options(), key))(value)
    options = module.Options(**values)
    task = module.make(options, args.seed)
    model = task.model()
    params = list(model.parameters())
    if args.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9 if args.optimizer == "momentum" else 0)
    generator = torch.Generator().manual_seed(args.seed + 1)
    higher = getattr(task, "higher_is_better", False)
    name = getattr(task, "metric_name", "loss")
    targets = sorted(args.targets, reverse=not higher)
    reached: dict[float, int] = {}
    ema, weight, examples, smooth = 0.0, 0.0, 0, math.nan
    start = time.perf_counter()
    step = 0
    for step in range(1, args.steps + 1):
        batch = task.sample(batch_size, generator)
        n = task.examples(batch) if hasattr(task, "examples") else len(batch)
        loss = task.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        examples += n
        value = task.metric(model) if hasattr(task, "metric") else float(loss.detach())
        if not math.isfinite(value):
            if name == "loss":
                print(f"B={batch_size} lr={lr}: diverged at step {step}")
                return
            continue
        # An EMA over about ema_examples examples; a metric is already a window mean.
        decay = math.exp(-n / args.ema_examples) if name == "loss" else 0.0
        ema, weight = decay * ema + (1 - decay) * value, decay * weight + (1 - decay)
        smooth = ema / weight
        for target in targets:
            hit = smooth >= target if higher else smooth <= target
            if target not in reached and hit:
                reached[target] = step
        if len(reached) == len(targets) and targets:
            break
        if args.max_examples and examples >= args.max_examples:
            break
    seconds = time.perf_counter() - start
    extra = ""
    if hasattr(task, "eval_loss"):
        extra = f" eval={task.eval_loss(model):.4f}"
    hits = " ".join(f"{t}@{reached.get(t, '-')}" for t in targets)
    print(f"B={batch_size:5d} lr={lr:<8g} {name}={smooth:.4f}{extra} steps={step} "
          f"ms/step={1000 * seconds / step:.2f} examples/step={examples / step:.0f} "
          f"targets {hits}", flush=True)


if __name__ == "__main__":
    main()
