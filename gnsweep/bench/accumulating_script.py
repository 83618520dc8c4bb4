"""A plain PyTorch training script with gradient accumulation, swept by
`gnsweep bench sweep_cost --sweeps script` as a user's own script is (`task=script`): it knows
nothing of gnsweep's training, and the in-script probe measures it with no line added.

The digits MLP of the default sweep (64-64-64-10, tanh, plain SGD) on the same split and
scaling, each step `--accumulation` forward/backward passes of `--batch-size / --accumulation`
samples, each loss divided by the passes, the optimizer's step, one printed row:

    python -m gnsweep.bench.accumulating_script --batch-size 64 --accumulation 4 --lr 0.4
        --seed 0 --max-steps 5000 --cpu-out /tmp/b64.json

`--cpu-out`: where to write, as the script ends (its last step, or SIGTERM when gnsweep stops
it at the target), the process's CPU seconds after each step since training started (the
import and the data's loading left out), so that the bench compares the sweeps' training
compute at the same step.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import torch
from torch import nn

from gnsweep.tasks.digits import load_digits  # the data only: the CSV that sklearn ships


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=5000)
    parser.add_argument("--cpu-out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pixels, labels = load_digits()
    x, y = torch.tensor(pixels, dtype=torch.float32) / 16.0, torch.tensor(labels)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order[round(0.2 * len(x)):]], y[order[round(0.2 * len(x)):]]
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-3)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    micro = args.batch_size // args.accumulation
    cpu: list[float] = []

    def finish(*_: object) -> None:
        if args.cpu_out:
            with open(args.cpu_out, "w") as out:
                json.dump({"cpu": cpu}, out)
        sys.exit(0)

    signal.signal(signal.SIGTERM, finish)
    start = time.process_time()
    for step in range(1, args.max_steps + 1):
        optimizer.zero_grad()
        total = 0.0
        for _ in range(args.accumulation):
            index = torch.randint(len(x), (micro,), generator=generator)
            loss = nn.functional.cross_entropy(model(x[index]), y[index]) / args.accumulation
            loss.backward()
            total += loss.item()
        optimizer.step()
        cpu.append(time.process_time() - start)  # before the row: gnsweep may stop it there
        print(f"step {step} loss {total:.6f}", flush=True)
    finish()


if __name__ == "__main__":
    main()
