"""Squared gradient norms from a live model, fed to the pure estimators in `gnsweep.noise`.

`NoiseScaleMonitor` works in any training loop. With method="microbatch", call
`monitor.accumulate()` after each micro-batch's backward (the loss of each micro-batch scaled so
that `.grad` ends up holding the batch-mean gradient, as in ordinary gradient accumulation), then
`monitor.step()` before `optimizer.step()`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gnsweep.noise import NoiseEstimate, NoiseScaleEma

METHODS = ("per_example", "microbatch", "ddp")


class NoiseScaleMonitor:
    """Measures B_simple during training from two batch sizes (eq. A.2), smoothed by EMAs."""

    def __init__(self, model: nn.Module, method: str = "microbatch", *, every: int = 1,
                 ema_steps: float = 0.0, ema_examples: float = 2048.0) -> None:
        if method not in METHODS:
            raise ValueError(f"method={method!r}: choose one of {', '.join(METHODS)}")
        if method != "microbatch":
            raise NotImplementedError(f"method={method!r} is not available yet")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters: nothing to measure")
        self.method, self.every = method, every
        self.ema = NoiseScaleEma(ema_steps=ema_steps, ema_examples=ema_examples)
        self._batch_sizes: list[int] = []
        self._hook = model.register_forward_pre_hook(self._count_examples)
        self._reset()
        self.steps = 0
        self.estimate: NoiseEstimate | None = None

    def _count_examples(self, module: nn.Module, args: tuple) -> None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and torch.is_grad_enabled():
            self._batch_sizes.append(int(first.shape[0]))

    def _reset(self) -> None:
        self._previous = [torch.zeros_like(p) for p in self.params]
        self._sq_micro: list[float] = []
        self._batch_sizes = []

    @torch.no_grad()
    def accumulate(self) -> None:
        """Record the gradient of the micro-batch just back-propagated (call after backward)."""
        sq = 0.0
        for p, prev in zip(self.params, self._previous, strict=True):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            sq += float(((grad - prev) ** 2).sum())
            prev.copy_(grad)
        self._sq_micro.append(sq)

    @torch.no_grad()
    def step(self) -> NoiseEstimate | None:
        """Fold this step's measurement in; returns the current estimate (None before the first)."""
        self.steps += 1
        if len(self._sq_micro) < 2:
            raise ValueError("method='microbatch' needs >= 2 micro-batches, each followed by "
                             "monitor.accumulate()")
        k = len(self._sq_micro)
        b_big = sum(self._batch_sizes[-k:])
        b_small = b_big / k
        # .grad holds the mean of the k micro-batch gradients, so each micro-batch's own
        # gradient is k times its increment.
        sq_small = k * k * sum(self._sq_micro) / k
        sq_big = sum(float((p.grad**2).sum()) for p in self.params if p.grad is not None)
        if math.isfinite(sq_small) and math.isfinite(sq_big):
            self.estimate = self.ema.update(sq_small, sq_big, b_small, b_big)
        self._reset()
        return self.estimate

    def close(self) -> None:
        self._hook.remove()
