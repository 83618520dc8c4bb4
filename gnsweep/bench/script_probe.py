"""Cost of measuring a script from its gradient accumulation: the step time of a training
script measured by the in-script probe (`gnsweep.inscript`, as a `task=script` run starts it)
over the same script unmeasured (`noise.method=none`).

`python -m gnsweep.bench script_probe` (or `gnsweep bench script_probe`). The script is a
plain PyTorch loop in its own process (this module run with `--child`), 4 micro-batches a step
(each loss divided by 4), gradient clipping and the optimizer step: a small MLP (SGD, where the
probe's per-parameter norms weigh most against the model's work) and a nanoGPT-shaped
character transformer (AdamW, 4 layers). Each process times its own steps (the median after a
warm-up, its start not counted); the two variants alternate round by round and the fastest
round of each is reported (other load only ever adds time).

Flags: `--quick` (2 rounds of 20 steps), `--rounds` (7), `--steps` (40), `--models mlp,gpt`.
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

ACCUMULATION = 4
MODELS = ("mlp", "gpt")
WARMUP = 5


def _child(model_name: str, steps: int) -> None:
    """The training script (run in its own process): prints its median step time."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if model_name == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256),
                                         nn.ReLU(), nn.Linear(256, 10))
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        micro = 64

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(micro, 64), torch.randint(0, 10, (micro,))

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
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
        micro = 8
        mask = nn.Transformer.generate_square_subsequent_mask(block)

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            tokens = torch.randint(0, vocab, (micro, block + 1))
            return tokens[:, :-1], tokens[:, 1:]

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = embed(x) + positions(torch.arange(block))
            logits = head(body(h, mask=mask, is_causal=True))
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))

    times = []
    for _ in range(WARMUP + steps):
        data = [batch() for _ in range(ACCUMULATION)]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for x, y in data:
            (loss_of(x, y) / ACCUMULATION).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
    times = sorted(times[WARMUP:])
    print(json.dumps({"seconds": times[len(times) // 2]}))


def _step_seconds(model: str, steps: int, measured: bool, rows: Path) -> float:
    from gnsweep.config import Config
    from gnsweep.training.script_noise import probe_environment

    env = {k: v for k, v in os.environ.items() if not k.startswith("GNSWEEP_NOISE")}
    env["OMP_NUM_THREADS"] = "1"
    if measured:
        config = Config.from_dict({"task": {"name": "script", "command": "python t.py"}})
        batch = ACCUMULATION * (64 if model == "mlp" else 8)
        rows.unlink(missing_ok=True)
        env.update(probe_environment(config, {"batch_size": batch}, 1.0, ACCUMULATION,
                                     rows.parent))
    done = subprocess.run([sys.executable, "-m", "gnsweep.bench.script_probe", "--child",
                           model, str(steps)], capture_output=True, text=True, env=env,
                          check=True, timeout=600)
    if measured and not rows.exists():
        raise RuntimeError(f"the probe measured nothing: {done.stderr[-500:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


def main(argv: list[str]) -> dict[str, Any]:
    import argparse

    if argv[:1] == ["--child"]:
        _child(argv[1], int(argv[2]))
        return {}
    parser = argparse.ArgumentParser(prog="gnsweep bench script_probe",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 20 steps.")
    parser.add_argument("--rounds", type=int, default=7, help="Rounds of each variant.")
    parser.add_argument("--steps", type=int, default=40, help="Timed steps a process.")
    parser.add_argument("--models", type=lambda s: tuple(s.split(",")), default=MODELS)
    args = parser.parse_args(argv)
    rounds, steps = (2, 20) if args.quick else (args.rounds, args.steps)
    out = []
    with tempfile.TemporaryDirectory() as folder:
        rows = Path(folder) / "noise_probe.jsonl"
        for model in args.models:
            seconds: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(rounds):
                for measured in (False, True):
                    seconds[measured].append(_step_seconds(model, steps, measured, rows))
            plain, probed = min(seconds[False]), min(seconds[True])
            out.append({"model": model, "plain_ms": 1e3 * plain, "probed_ms": 1e3 * probed,
                        "ratio": probed / plain})
    print(f"in-script probe cost: step time of a script with {ACCUMULATION} micro-batches a "
          f"step, measured by the probe / unmeasured (fastest of {rounds} interleaved rounds, "
          f"median of {steps} steps each, 1 thread)")
    for row in out:
        print(f"  {row['model']:>4}  plain {row['plain_ms']:8.3f} ms  probed "
              f"{row['probed_ms']:8.3f} ms  ratio {row['ratio']:.3f}")
    result = {"rows": out}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
