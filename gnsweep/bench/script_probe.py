"""Cost of measuring a script from its gradient accumulation: the step time of a training
script measured by the in-script probe (`gnsweep.inscript`, as a `task=script` run starts it)
over the same script unmeasured (`noise.method=none`).

`python -m gnsweep.bench script_probe` (or `gnsweep bench script_probe`). The script is a
plain PyTorch loop in its own process (this module run with `--child`), 4 micro-batches a step
(each loss divided by 4), gradient clipping and the optimizer step: a small MLP (SGD, where the
probe's per-parameter work weighs most against the model's) and a nanoGPT-shaped character
transformer (AdamW, 4 layers). The process trains two copies of the model, the first's
optimizer built before the probe starts (unmeasured), the second's after (measured, as a
script run is), in alternating blocks of steps, so that both see the same load; the ratio is
of their mean step times (steps over 3x their copy's median left out: another job took the
core), and the median process of `--rounds` is reported. A mean, not a median: with
`--every` above 1 most steps are not measured, and the median step would be one of those.
Each step is timed twice: by the wall clock (what the user waits) and by the thread's CPU
time (what it computes: on a machine other jobs load, the time they take from it is left
out, so it stands for an idle machine's wall clock).

Flags: `--quick` (2 rounds of 20 steps), `--rounds` (3), `--steps` (40), `--models mlp,gpt`,
`--every` (the probe's `noise.every`: 1, the default, measures every step; k, or auto).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gnsweep.noise import EVERY_AUTO
from gnsweep.paths import RunPaths

ACCUMULATION = 4
MODELS = ("mlp", "gpt")
"""The default models; `digits` (`--models digits`) is the smaller MLP that `bench sweep_cost
--sweeps script` sweeps."""
MICRO = {"digits": 16, "mlp": 64, "gpt": 8}
"""Samples a micro-batch."""
WARMUP = 5
BLOCK = 5


def _child(model_name: str, steps: int, rows: str, every: str = "1") -> None:
    """The training script (run in its own process): two copies of one model, the first's
    optimizer built before the probe starts (unmeasured), the second's after (measured),
    trained in alternating blocks of `BLOCK` steps; prints each one's median step time, by
    the wall clock and in CPU time."""
    import torch
    from torch import nn

    from gnsweep.inscript import probe

    torch.manual_seed(0)
    torch.set_num_threads(1)
    runs = []
    for measured in (False, True):
        if measured:
            batch_size = ACCUMULATION * MICRO[model_name]
            probe.install(json.dumps({"rows": rows, "batch_size": batch_size,
                                      "accumulation": ACCUMULATION,
                                      "every": every if every == EVERY_AUTO else int(every)}))
        runs.append(_script(model_name, torch, nn))
    times: dict[tuple[bool, bool], list[float]] = {(m, c): [] for m in (False, True)
                                                   for c in (False, True)}
    for block in range((WARMUP + steps) // BLOCK + 1):
        for measured, (step, data) in zip((False, True), runs, strict=True):
            for _ in range(BLOCK):
                batch = data()
                start, cpu = time.perf_counter(), time.thread_time()
                step(batch)
                if block * BLOCK >= WARMUP:
                    times[measured, False].append(time.perf_counter() - start)
                    times[measured, True].append(time.thread_time() - cpu)
    mean = {key: _mean(t) for key, t in times.items()}
    print(json.dumps({"plain": mean[False, False], "probed": mean[True, False],
                      "plain_cpu": mean[False, True], "probed_cpu": mean[True, True]}))


def _mean(times: list[float]) -> float:
    """The mean step time, steps over 3x the median (interrupted by other jobs) left out."""
    cut = 3 * sorted(times)[len(times) // 2]
    kept = [t for t in times if t <= cut]
    return sum(kept) / len(kept)


def _script(model_name: str, torch: Any, nn: Any) -> tuple[Any, Any]:
    """(one training step on a step's micro-batches, a step's micro-batches): 4 passes, each
    loss divided by 4, clipping, the optimizer's step."""
    if model_name in ("digits", "mlp"):
        # digits: the script of `bench sweep_cost --sweeps script` (batch 64); mlp: wider
        width, act, lr = (64, nn.Tanh, 0.1) if model_name == "digits" else (256, nn.ReLU, 0.01)
        model = nn.Sequential(nn.Linear(64, width), act(), nn.Linear(width, width), act(),
                              nn.Linear(width, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        micro = MICRO[model_name]

        def batch() -> Any:
            return torch.randn(micro, 64), torch.randint(0, 10, (micro,))

        def loss_of(x: Any, y: Any) -> Any:
            return nn.functional.cross_entropy(model(x), y)
    else:
        vocab, block, width = 65, 64, 128
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        body = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        embed, positions, head = nn.Embedding(vocab, width), nn.Embedding(block, width), \
            nn.Linear(width, vocab)
        model = nn.ModuleList([embed, positions, body, head])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        micro = MICRO[model_name]
        mask = nn.Transformer.generate_square_subsequent_mask(block)

        def batch() -> Any:
            tokens = torch.randint(0, vocab, (micro, block + 1))
            return tokens[:, :-1], tokens[:, 1:]

        def loss_of(x: Any, y: Any) -> Any:
            h = embed(x) + positions(torch.arange(block))
            logits = head(body(h, mask=mask, is_causal=True))
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))

    def step(data: list[Any]) -> None:
        optimizer.zero_grad(set_to_none=True)
        for x, y in data:
            (loss_of(x, y) / ACCUMULATION).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step, lambda: [batch() for _ in range(ACCUMULATION)]


def _ratio(model: str, steps: int, rows: Path, every: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GNSWEEP_NOISE")}
    env["OMP_NUM_THREADS"] = "1"
    rows.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "gnsweep.bench.script_probe", "--child",
                           model, str(steps), str(rows), every], capture_output=True, text=True,
                          env=env, check=True, timeout=1200)
    if not rows.exists():
        raise RuntimeError(f"the probe measured nothing: {done.stderr[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> dict[str, Any]:
    import argparse

    if argv[:1] == ["--child"]:
        _child(argv[1], int(argv[2]), argv[3], *argv[4:5])
        return {}
    parser = argparse.ArgumentParser(prog="gnsweep bench script_probe",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 20 steps.")
    parser.add_argument("--rounds", type=int, default=3, help="Processes a model.")
    parser.add_argument("--steps", type=int, default=40, help="Timed steps a process.")
    parser.add_argument("--models", type=lambda s: tuple(s.split(",")), default=MODELS)
    parser.add_argument("--every", default="1",
                        help="The probe's noise.every: 1 (every step), k or auto.")
    args = parser.parse_args(argv)
    rounds, steps = (2, 20) if args.quick else (args.rounds, args.steps)
    out = []
    with tempfile.TemporaryDirectory() as folder:
        rows = RunPaths(Path(folder)).noise_probe_rows  # the folder stands for a run's
        for model in args.models:
            # Each round a process; its ratio is of medians taken side by side; the median
            # round's is reported.
            seen = [_ratio(model, steps, rows, args.every) for _ in range(rounds)]
            rounds_seen = sorted(seen, key=lambda r: r["probed"] / r["plain"])
            middle = rounds_seen[len(rounds_seen) // 2]
            cpu = sorted(r["probed_cpu"] / r["plain_cpu"] for r in seen)
            out.append({"model": model, "plain_ms": 1e3 * middle["plain"],
                        "probed_ms": 1e3 * middle["probed"],
                        "ratio": middle["probed"] / middle["plain"],
                        "ratios": [round(r["probed"] / r["plain"], 3) for r in rounds_seen],
                        "cpu_ratio": cpu[len(cpu) // 2],
                        "cpu_ratios": [round(r, 3) for r in cpu]})
    print(f"in-script probe cost: step time of a script with {ACCUMULATION} micro-batches a "
          f"step, measured by the probe (noise.every={args.every}) / unmeasured (two copies "
          f"in one process, blocks of {BLOCK} steps alternated, means of {steps} steps each; "
          f"the median of {rounds} processes; 1 thread; load average "
          f"{os.getloadavg()[0]:.1f})")
    for row in out:
        print(f"  {row['model']:>4}  plain {row['plain_ms']:8.3f} ms  probed "
              f"{row['probed_ms']:8.3f} ms  ratio {row['ratio']:.3f}  (rounds {row['ratios']})"
              f"  cpu-time ratio {row['cpu_ratio']:.3f}  (rounds {row['cpu_ratios']})")
    result = {"rows": out, "every": args.every}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
