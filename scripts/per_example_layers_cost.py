"""What measuring costs on the layers that used to need micro-batches: one training step
(zero_grad, forward, backward, monitor.step) unmeasured, per-example (every step measured), and
with the batch split into 4 micro-batches, interleaved, best of N, as a ratio to the unmeasured
step.

    PYTHONPATH=. python scripts/per_example_layers_cost.py [--model encoder|lm] [--batch 32]

`encoder`: a 2-layer `nn.TransformerEncoder` classifier (width 64, 4 heads, 16 positions,
dropout 0), its `nn.MultiheadAttention` measured whole (`gnsweep.measure.per_example.attention`).
`lm`: tests/helpers/lm_task.py's nanoGPT-style model (positions `wpe(torch.arange(16))`, tied
embeddings), the positions through their expanded output (`gnsweep.measure.per_example.positions`).
One thread; timings on a shared machine are noisy, so the minimum of interleaved repetitions is
reported.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.measure import NoiseScaleMonitor


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.inp(x)).mean(1))


def _setup(name: str, batch: int) -> tuple[nn.Module, Any, Any]:
    """(model, loss(model, batch), a batch sampler from a generator)."""
    torch.manual_seed(0)
    if name == "lm":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
        import lm_task

        task = lm_task.make(0)
        return task.model(), task.loss, lambda g: task.sample(batch, g)
    model = _Encoder()

    def loss(model: nn.Module, part: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(part[0]), part[1])

    return model, loss, lambda g: (torch.randn(batch, 16, 8, generator=g),
                                   torch.randint(0, 5, (batch,), generator=g))


def _chunks(batch: Any, pieces: int) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(pieces))
    return list(zip(*(t.chunk(pieces) for t in batch), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="encoder", choices=["encoder", "lm"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = {"plain": (None, 1), "per_example": ("per_example", 1),
                "microbatch x4": ("microbatch", 4)}
    setups = {name: _setup(args.model, args.batch) for name in variants}
    monitors = {name: NoiseScaleMonitor(setups[name][0], method, ema_steps=math.inf)
                for name, (method, _) in variants.items() if method is not None}
    best = dict.fromkeys(variants, math.inf)
    generator = torch.Generator().manual_seed(0)
    for rep in range(args.reps + 3):
        batch = setups["plain"][2](generator)
        for name, (_, pieces) in variants.items():
            model, loss, _ = setups[name]
            monitor = monitors.get(name)
            started = time.perf_counter()
            model.zero_grad(set_to_none=True)
            parts = _chunks(batch, pieces)
            for part in parts:
                (loss(model, part) / len(parts)).backward()
                if monitor is not None:
                    monitor.accumulate()
            if monitor is not None:
                monitor.step()
            if rep >= 3:  # the first steps carry the coverage checks
                best[name] = min(best[name], time.perf_counter() - started)
    for name, monitor in monitors.items():
        print(f"{name}: {monitor.sources[0].describe()}; micro-batches: "
              f"{monitor.needs_microbatches}")
        monitor.close()
    for name, seconds in best.items():
        print(f"{args.model} batch {args.batch} {name}: {seconds * 1e3:.2f} ms, "
              f"{seconds / best['plain']:.2f}x the unmeasured step")


if __name__ == "__main__":
    main()
