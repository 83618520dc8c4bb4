"""A plain PyTorch training script, written as a user would, for the task=script tests: SGD on
a noisy linear regression (the loss floor is noise^2 / 2 = 0.125), its own argument parsing,
its own checkpoint, its own log. Nothing of gnsweep unless --log api.

    python script_sgd.py --bs 16 --lr 0.1 --seed 0 --out DIR [--log print|csv|jsonl|api]

--faults A,B,... gives the run of seed i fault i: fail (exit 1 after step 3 with a message on
stderr), nan (a NaN loss at step 5), back (step 3 logged again after step 6), quiet (prints no
loss line), none. --sleep waits after every step (to be killed).
"""

import argparse
import json
import math
import os
import sys
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--bs", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default=".")
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--log", default="print")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--checkpoint-every", type=int, default=10)
parser.add_argument("--faults", default="")
args = parser.parse_args()
faults = args.faults.split(",") if args.faults else []
fault = faults[args.seed] if args.seed < len(faults) else "none"

torch.manual_seed(args.seed)
dim = 8
teacher = torch.randn(dim, generator=torch.Generator().manual_seed(123))
weights = torch.zeros(dim, requires_grad=True)
optimizer = torch.optim.SGD([weights], lr=args.lr)
os.makedirs(args.out, exist_ok=True)
checkpoint = os.path.join(args.out, "ckpt.pt")
start = 0
if os.path.exists(checkpoint):  # resume: the weights, the optimizer and the random stream
    saved = torch.load(checkpoint)
    weights.data.copy_(saved["weights"])
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    start = saved["step"]

run = None
if args.log == "api":
    import gnsweep

    run = gnsweep.current_run()
if args.log == "csv":
    log_path = os.path.join(args.out, "log.csv")
    with open(log_path, "a") as f:
        if f.tell() == 0:
            f.write("iteration,train_loss,lr\n")

for step in range(start + 1, args.steps + 1):
    x = torch.randn(args.bs, dim)
    y = x @ teacher + 0.5 * torch.randn(args.bs)
    loss = ((x @ weights - y) ** 2).mean() / 2
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    value = loss.item()
    if fault == "nan" and step == 5:
        value = math.nan
    logged = 3 if fault == "back" and step == 7 else step
    if fault == "quiet":
        print(f"at {step}")
    elif args.log == "print":
        print(f"step {logged} | loss {value:.6f} | lr {args.lr}")
    elif args.log == "csv":
        with open(log_path, "a") as f:
            f.write(f"{logged},{value!r},{args.lr}\n")
    elif args.log == "jsonl":
        with open(os.path.join(args.out, "log.jsonl"), "a") as f:
            f.write(json.dumps({"step": logged, "loss": value}) + "\n")
    elif run is not None:
        run.log(logged, None, value, lr=args.lr)
        if run.should_stop():
            break
    if fault == "fail" and step == 3:
        print("RuntimeError: CUDA out of memory (a made-up failure)", file=sys.stderr)
        sys.exit(1)
    if step % args.checkpoint_every == 0:
        torch.save({"weights": weights.data, "optimizer": optimizer.state_dict(), "step": step,
                    "rng": torch.get_rng_state()}, checkpoint + ".tmp")
        os.replace(checkpoint + ".tmp", checkpoint)
    if args.sleep:
        time.sleep(args.sleep)
