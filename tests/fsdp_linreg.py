"""Run by tests/test_fsdp.py under torchrun (2 CPU processes, gloo): linreg's nn.Linear sharded
by `fully_shard` (the weight split along its input dimension, so each rank holds half of it),
at fixed parameters (no optimizer step). Rank 0 prints one JSON line: linreg's closed-form
B_simple and what each route measured over the same batches:
- `fsdp_nosync`: `FsdpNoiseScale`, 2 micro-steps a step, gradient sync off on the first;
- `fsdp_sync`: the same with gradient sync on every micro-step;
- `monitor`: `NoiseScaleMonitor(model)` (auto routes to FSDP), one backward a step (b_small =
  one rank's batch);
- `measure`: `measure_noise_scale(model, None, batches, task_loss=task.loss)`.
Argument: the steps."""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from gnsweep import NoiseScaleMonitor, measure_noise_scale
from gnsweep.measure.fsdp import FsdpNoiseScale
from gnsweep.tasks import linreg

MICRO = 16  # examples of one rank's micro-step


def batches(task: linreg.LinReg, steps: int, rank: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return [task.sample(2 * MICRO, gen) for _ in range(steps)]


def accumulate(model, task, noise, data, *, sync_every: bool) -> float:
    for x, y in data:
        for k in range(2):
            model.set_requires_gradient_sync(sync_every or k == 1)
            piece = slice(k * MICRO, (k + 1) * MICRO)
            (task.loss(model, (x[piece], y[piece])) / 2).backward()
            noise.micro_step()
        noise.step()
        model.zero_grad()
    return noise.b_simple


def main(steps: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    task = linreg.make(linreg.Options(dim=32, condition=4.0), seed=0)
    model = task.model()
    truth = task.truth(model)
    fully_shard(model, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    out = {"truth": truth.b_simple, "g2": truth.g2}
    with FsdpNoiseScale(model, ema_examples=math.inf) as noise:
        out["fsdp_nosync"] = accumulate(model, task, noise, batches(task, steps, rank, 1),
                                        sync_every=False)
        assert noise.estimate is not None
        out["fsdp_g2"] = noise.estimate.g2
    with FsdpNoiseScale(model, ema_examples=math.inf) as noise:
        out["fsdp_sync"] = accumulate(model, task, noise, batches(task, steps, rank, 2),
                                      sync_every=True)
    monitor = NoiseScaleMonitor(model, ema_examples=math.inf)
    out["monitor_method"] = monitor.method
    for x, y in batches(task, steps, rank, 3):
        task.loss(model, (x, y)).backward()
        monitor.step()
        model.zero_grad()
    monitor.close()
    out["monitor"] = monitor.b_simple
    out["measure"] = measure_noise_scale(model, None, batches(task, steps, rank, 4),
                                         task_loss=task.loss).b_simple
    try:
        NoiseScaleMonitor(model, method="per_example")
    except ValueError as err:
        out["per_example_refused"] = str(err)
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
