"""Run by tests/measure/test_fsdp.py under torchrun (2 CPU processes, gloo): linreg's nn.Linear
sharded by `fully_shard` (the weight split along its input dimension, so each rank holds half of
it), at fixed parameters (no optimizer step). Rank 0 prints one JSON line: linreg's closed-form
B_simple and what each route measured over the same batches:
- `fsdp_nosync`: `FsdpNoiseScale`, 2 micro-steps a step, gradient sync off on the first;
- `fsdp_sync`: the same with gradient sync on every micro-step;
- `monitor`: `NoiseScaleMonitor(model)` (auto routes to FSDP), one backward a step (b_small =
  one rank's batch);
- `measure`: `measure_noise_scale(model, None, batches, task_loss=task.loss)`;
- `bf16`: `FsdpNoiseScale` on a copy sharded with bf16 parameters, fp32 reduction;
- `one_rank`: `FsdpNoiseScale` on a copy sharded over a 1-rank mesh of each process (world 1:
  b_small one micro-step, b_big the rank's 2), and `one_backward_refused`, what one backward a
  step on one rank raises.
- `nested`: an MLP sharded layer by layer and whole, micro-steps of 10 and 22 examples: the
  norms `FsdpNoiseScale` read against plain autograd on an unsharded copy (`brute`);
- `unclosed_refused`: two backward passes without `micro_step()` in between.
Argument: the steps."""

from __future__ import annotations

import copy
import json
import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from gnsweep import FsdpNoiseScale, NoiseScaleMonitor, measure_noise_scale
from gnsweep.distributed import close_process_group
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


def nested(rank: int) -> dict[str, list[float]]:
    """One step of 2 uneven micro-steps on an MLP sharded per layer: FsdpNoiseScale's norms, and
    the same from plain autograd on an unsharded copy, the global gradient all-reduced."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    plain = copy.deepcopy(mlp)
    fully_shard(mlp[0])
    fully_shard(mlp[2])
    fully_shard(mlp)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 3, generator=gen)
    sizes = [10, 22]

    def loss(model, piece):
        return 0.5 * (model(x[piece]) - y[piece]).pow(2).sum(1).mean() * (piece.stop -
                                                                         piece.start) / 32

    pieces = [slice(0, sizes[0]), slice(sizes[0], 32)]
    with FsdpNoiseScale(mlp, ema_examples=math.inf) as noise:
        for k, piece in enumerate(pieces):
            mlp.set_requires_gradient_sync(k == 1)
            loss(mlp, piece).backward()
            noise.micro_step()
        estimate = noise.step()
    assert estimate is not None
    micro, total = [], None
    for piece in pieces:
        grads = torch.autograd.grad(loss(plain, piece), list(plain.parameters()))
        flat = torch.cat([g.reshape(-1) for g in grads]).double()
        micro.append(float((flat * 32 / (piece.stop - piece.start)).square().sum()))
        total = flat if total is None else total + flat
    assert total is not None
    dist.all_reduce(total)
    pack = torch.tensor(micro, dtype=torch.float64)
    dist.all_reduce(pack)
    b_small = 4 / sum(2 / n for n in sizes)
    return {"nested": [estimate.sq_norm_small, estimate.sq_norm_big, estimate.b_small,
                       estimate.b_big],
            "brute": [float(pack.sum()) / 4, float((total / 2).square().sum()), b_small, 64.0]}


def main(steps: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    task = linreg.make(linreg.Options(dim=32, condition=4.0), seed=0)
    model = task.model()
    truth = task.truth(model)
    bf16, alone = task.model(), task.model()
    by_column = {"shard_placement_fn": lambda p: Shard(p.dim() - 1)}
    fully_shard(model, **by_column)
    fully_shard(bf16, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.float32), **by_column)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ranks", "alone"))["alone"]
    fully_shard(alone, mesh=mesh, **by_column)
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
    with FsdpNoiseScale(bf16, ema_examples=math.inf) as noise:
        out["bf16"] = accumulate(bf16, task, noise, batches(task, steps, rank, 5),
                                 sync_every=False)
    with FsdpNoiseScale(alone, ema_examples=math.inf) as noise:
        out["one_rank"] = accumulate(alone, task, noise, batches(task, 2 * steps, rank, 6),
                                     sync_every=False)
        x, y = batches(task, 1, rank, 7)[0]
        task.loss(alone, (x, y)).backward()
        try:
            noise.step()
        except ValueError as err:
            out["one_backward_refused"] = str(err)
    out.update(nested(rank))
    with FsdpNoiseScale(model) as noise:
        x, y = batches(task, 1, rank, 8)[0]
        task.loss(model, (x[:MICRO], y[:MICRO])).backward()
        task.loss(model, (x[MICRO:], y[MICRO:])).backward()
        try:
            noise.step()
        except ValueError as err:
            out["unclosed_refused"] = str(err)
        model.zero_grad()
    if rank == 0:
        print(json.dumps(out), flush=True)
    # Both ranks done with every group (the 1-rank meshes' too) before either tears gloo down.
    close_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
