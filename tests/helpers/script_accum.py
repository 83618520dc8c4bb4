"""A plain PyTorch script with gradient accumulation, written as a user would and knowing
nothing of gnsweep, for the in-script noise probe's truth tests: linear regression without a
bias, `x ~ N(0, I_d)`, `y = w*.x + 0.5 eps`, loss `0.5 mean((w.x - y)^2)`.

With `--frozen` the weights stay at `w* + delta` (the step is taken with a zero rate), where
the noise scale is exact (Isserlis): `G = delta`, `Sigma = (|delta|^2 + s^2) I + delta delta^T`,
so `B_simple = (d (|delta|^2 + s^2) + |delta|^2) / |delta|^2`, printed as b_simple_true.

    python script_accum.py --bs 64 --micro 16 --accum 4 [--scaler] [--ddp] [--sum]

Each step runs `--accum` forward/backward passes of `--micro` samples (under --ddp, the
rank's share: `--accum` counts the passes of all ranks, nanoGPT's convention), each loss
divided by the passes (`--sum`: not divided); `--scaler` scales the loss by a GradScaler
(a constant 1024, and an overflow injected at step 7, which it skips), `--clip` clips the
gradient norm before the step.
"""

import argparse
import contextlib
import math

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--bs", type=int, default=64)
parser.add_argument("--micro", type=int, default=64)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--frozen", action="store_true")
parser.add_argument("--scaler", action="store_true")
parser.add_argument("--ddp", action="store_true")
parser.add_argument("--sum", action="store_true")
parser.add_argument("--clip", type=float, default=0.0)
parser.add_argument("--scaled-seeds", default="",
                    help="seeds run as --scaler --sum --clip=0.5 (two kinds in one sweep)")
args = parser.parse_args()
if str(args.seed) in args.scaled_seeds.split(","):
    args.scaler, args.sum, args.clip = True, True, 0.5

rank, world = 0, 1
if args.ddp:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
dim, noise = 8, 0.5
teacher = torch.randn(dim, generator=torch.Generator().manual_seed(123))
delta = torch.full((dim,), 0.5)
model = torch.nn.Linear(dim, 1, bias=False)
with torch.no_grad():
    model.weight.copy_(teacher + delta)
trained = DistributedDataParallel(model) if args.ddp else model
optimizer = torch.optim.SGD(model.parameters(), lr=0.0 if args.frozen else args.lr)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if args.scaler else None
passes = args.accum // world if args.ddp else args.accum
d2 = float(delta @ delta)
truth = (dim * (d2 + noise ** 2) + d2) / d2
generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
for step in range(1, args.steps + 1):
    optimizer.zero_grad()
    total = 0.0
    for j in range(passes):
        x = torch.randn(args.micro, dim, generator=generator)
        y = x @ teacher + noise * torch.randn(args.micro, generator=generator)
        sync = j == passes - 1 or not args.ddp
        with contextlib.nullcontext() if sync else trained.no_sync():
            loss = ((trained(x).squeeze(1) - y) ** 2).mean() / 2
            total += loss.item() / passes
            scaled = loss if args.sum else loss / passes
            if scaler is not None:
                scaled = scaler.scale(scaled)
                if step == 7 and j == 0:
                    scaled = scaled * math.inf  # an overflow: the scaler skips this step
            scaled.backward()
    if scaler is not None:
        scaler.unscale_(optimizer)
    if args.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if rank == 0:
        print(f"step {step} loss {total:.6f} b_simple_true {truth:.6f}", flush=True)
if args.ddp:
    dist.destroy_process_group()
