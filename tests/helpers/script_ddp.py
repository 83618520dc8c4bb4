"""A script that does its own DDP, as a user's torchrun job does: gloo on the CPU, the global
batch split over the ranks, rank 0 logging through `gnsweep.current_run()` with the noise-scale
monitor on the DDP model (each rank's gradient before the all-reduce: b_small = B / world).

    torchrun --nproc_per_node 2 script_ddp.py --bs 32 --lr 0.2 --seed 0
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gnsweep

parser = argparse.ArgumentParser()
parser.add_argument("--bs", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
dim = 8
teacher = torch.randn(dim, generator=torch.Generator().manual_seed(123))
torch.manual_seed(args.seed)
model = DistributedDataParallel(torch.nn.Linear(dim, 1, bias=False))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
run = gnsweep.current_run()
monitor = run.monitor(model) if run else None
generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
local = args.bs // world
try:
    for step in range(1, args.steps + 1):
        x = torch.randn(local, dim, generator=generator)
        y = x @ teacher + 0.5 * torch.randn(local, generator=generator)
        loss = ((model(x).squeeze(1) - y) ** 2).mean() / 2
        optimizer.zero_grad()
        loss.backward()
        if monitor is not None:
            monitor.step()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if run is not None:
            run.log(step, None, mean.item() / world, lr=args.lr)  # rank 0 writes
            if run.should_stop():  # every rank agrees
                break
        elif rank == 0:
            print(f"step {step} loss {mean.item() / world:.5f}")
finally:
    dist.destroy_process_group()
