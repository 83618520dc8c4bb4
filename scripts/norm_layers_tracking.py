"""How well the norm-layer noise scale (`noise.method=norm_layers`, Gray et al. 2024) tracks the
whole model's B_simple, at fixed parameters at points along training.

For each model it trains with Adam and, at the given steps, holds the parameters fixed and
measures B_simple twice on the same fresh batches (`measure_noise_scale`, pooled, no window):
from every parameter (per-example norms; micro-batches where a layer needs them) and from the
LayerNorm/RMSNorm parameters alone. It prints both and their ratio.

Models: the architectures matrix's GPT-2 (`bench.architectures.gpt2`: transformers' GPT-2, 2
layers, width 24, 12 tokens, Markov-chain tokens) and the character LM (`task=chars`, 64
tokens a window, trained on its text).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/norm_layers_tracking.py --batches 40
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gnsweep.measure import measure_noise_scale


def _models(name: str) -> tuple[nn.Module, Callable[[int, torch.Generator], Any],
                                Callable[[nn.Module, Any], torch.Tensor], float, str]:
    """(model, sample(batch, generator), loss(model, batch), Adam's rate, full method)."""
    if name == "gpt2":
        from gnsweep.bench.architectures import gpt2

        arch = gpt2(0)
        return arch.model, arch.sample, arch.loss, 3e-3, "per_example"
    from gnsweep.tasks import chars

    task = chars.make(chars.Options(eval_windows=0), seed=0)
    # The positions embedding is looked up once for the batch: micro-batches measure it.
    return task.model(), task.sample, task.loss, 4e-3, "microbatch"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2,chars")
    parser.add_argument("--at", default="0,100,300,1000", help="training steps to measure at")
    parser.add_argument("--batch", type=int, default=16, help="training and measuring batch")
    parser.add_argument("--batches", type=int, default=40, help="batches pooled per estimate")
    args = parser.parse_args()
    torch.set_num_threads(1)
    points = [int(s) for s in args.at.split(",")]
    print(f"{'model':<7}{'step':>6}{'full':>12}{'norm_layers':>13}{'ratio':>8}")
    for name in args.models.split(","):
        model, sample, loss, lr, full = _models(name)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        train = torch.Generator().manual_seed(1)
        step = 0
        for point in points:
            while step < point:
                optimizer.zero_grad()
                loss(model, sample(args.batch, train)).backward()
                optimizer.step()
                step += 1
            held = torch.Generator().manual_seed(100 + point)
            batches = [sample(args.batch, held) for _ in range(args.batches)]
            whole = measure_noise_scale(model, None, batches, method=full, task_loss=loss)
            norms = measure_noise_scale(model, None, batches, method="norm_layers",
                                        task_loss=loss)
            print(f"{name:<7}{step:>6}{whole.b_simple:>12.4g}{norms.b_simple:>13.4g}"
                  f"{norms.b_simple / whole.b_simple:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
