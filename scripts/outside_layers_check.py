"""Checks from outside the project: models from a public library (Hugging Face transformers:
ViT, SigLIP's vision tower with its nn.MultiheadAttention pooling head, GPT-2, Llama), small
configurations, B_simple by gnsweep's per-example measurement against brute force (one
backward per example, eq. A.2 with b_small = 1), and what the monitor measured how.

In a scratch virtual environment, never the project's:

    python -m venv /tmp/outside
    /tmp/outside/bin/pip install torch==2.13.0 transformers==5.25.0
    PYTHONPATH=. /tmp/outside/bin/python scripts/outside_layers_check.py [name ...]

Parameters that fall back to micro-batches are measured with micro-batches of one example, so
that the mixed estimator is brute force itself: any difference is the per-example part's.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.measure import NoiseScaleMonitor, measure_noise_scale

MODELS = ("vit", "siglip", "gpt2", "llama")


def brute_force(model: nn.Module, loss_fn: Callable, batches: list) -> tuple[float, float]:
    """(|G|^2, tr Sigma) of eq. A.2 from every example's own gradient, pooled over batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    small = big = 0.0
    for x, y in batches:
        rows = []
        for i in range(len(x)):
            loss = loss_fn(model(x[i:i + 1]), y[i:i + 1])
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            rows.append(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                                   for g, p in zip(grads, params, strict=True)]).double())
        g = torch.stack(rows)
        small += float(g.square().sum(1).mean()) / len(batches)
        big += float(g.mean(0).square().sum()) / len(batches)
    n = len(batches[0][0])
    return (n * big - small) / (n - 1), (small - big) / (1 - 1 / n)


class _Call(nn.Module):
    """A library model called on one tensor, its output turned into logits by `out`."""

    def __init__(self, inner: nn.Module, key: str, out: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.inner, self.key, self.out = inner, key, out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(**{self.key: x}))


def _tokens(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def build(name: str) -> tuple[nn.Module, Callable, list]:
    import transformers as hf

    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    images = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 5, (8,), generator=g))
              for _ in range(2)]
    # A copy task (target = input): |G|^2 well above zero at initialisation.
    tokens = [(t, t) for t in (torch.randint(0, 50, (8, 12), generator=g) for _ in range(2))]
    if name == "vit":
        vit = hf.ViTForImageClassification(hf.ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
        return _Call(vit, "pixel_values", lambda o: o.logits), F.cross_entropy, images
    if name == "siglip":
        tower = hf.SiglipVisionModel(hf.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=32, patch_size=8))
        head = nn.Linear(32, 5)
        model = _Call(tower, "pixel_values", lambda o: head(o.pooler_output))
        model.head = head
        return model, F.cross_entropy, images
    if name == "gpt2":
        lm = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                                              n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0,
                                              embd_pdrop=0.0))
    else:
        lm = hf.LlamaForCausalLM(hf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=50, max_position_embeddings=32))
    return _Call(lm, "input_ids", lambda o: o.logits), _tokens, tokens


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="  log: %(message)s")
    torch.set_num_threads(1)
    for name in sys.argv[1:] or MODELS:
        model, loss_fn, data = build(name)
        model.train()
        print(name)
        monitor = NoiseScaleMonitor(model, "per_example")
        x, y = data[0]
        loss_fn(model(x), y).backward()
        monitor.step()
        model.zero_grad(set_to_none=True)
        print(f"  micro-batches needed: {monitor.needs_microbatches}; "
              f"{monitor.sources[0].describe()}")
        monitor.close()
        g2, trace = brute_force(model, loss_fn, data)
        estimate = measure_noise_scale(model, loss_fn, data, method="per_example",
                                       microbatches=len(x))
        print(f"  B_simple brute force {trace / g2:.5g}, gnsweep {estimate.b_simple:.5g}: "
              f"ratio {estimate.b_simple / (trace / g2):.6f} (|G|^2 {estimate.g2 / g2:.6f}, "
              f"tr Sigma {estimate.trace_sigma / trace:.6f})")


if __name__ == "__main__":
    main()
