"""Micro-batch gradient norms (b_small = B / k): each micro-batch's own gradient, as the
increment of `.grad` between `accumulate()` calls (gradient accumulation)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gnsweep.measure.source import Reading, Stateless, StepNorms, unscale
from gnsweep.noise import NormPair


class Increments(Stateless):
    """Each micro-batch's own gradient, as the increment of `.grad` since the previous one.

    The gradients are flattened into one vector per call: a few ops whatever the number of
    parameters (`foreach` ops run per tensor on the CPU).
    """

    splits = True
    preconditions = False

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.handles: list[Any] = []
        self.preconditioner: torch.Tensor | None = None
        """A diagonal weight over the flattened parameters (the optimizer's preconditioner P):
        when set, `preconditioned()` gives the same pair in the P-norm `|v|_P^2 = sum P v^2`."""
        self.reset()

    def reset(self) -> None:
        self.previous: torch.Tensor | None = None
        self.sq: list[torch.Tensor] = []
        self.sq_preconditioned: list[torch.Tensor] = []
        self.counts: list[int] = []
        self._seen = 0

    def accumulate(self, examples_so_far: int) -> None:
        # fp32 whatever the parameters' dtype: increments of low-precision sums lose digits.
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          .float() for p in self.params]).detach()
        increment = flat if self.previous is None else flat - self.previous
        self.sq.append(torch.dot(increment, increment))
        if self.preconditioner is not None:
            self.sq_preconditioned.append(torch.dot(self.preconditioner * increment, increment))
        self.previous = flat
        self.counts.append(examples_so_far - self._seen)
        self._seen = examples_so_far

    def measure(self, required: bool) -> NormPair | None:
        k = len(self.counts)
        if k < 2:
            if required:
                raise ValueError(
                    "method='microbatch' needs >= 2 micro-batches per measured step, each "
                    "followed by monitor.accumulate(); a batch of one example cannot be split")
            return None
        if min(self.counts) < 1:
            raise ValueError("monitor.accumulate() was called without a forward pass of the "
                             "model since the last call: no examples to attribute")
        assert self.previous is not None
        # After the last accumulate() the flat vector is the batch-mean gradient: |G_big|^2.
        values = torch.stack([*self.sq, torch.dot(self.previous, self.previous)]).tolist()
        return self._pair(values)

    def read(self, step: StepNorms) -> Reading:
        """The `Source` reading: this step's pair (its norms were read during backward, so
        both carry the loss scale), or an incomplete step, said once, where it came in one
        piece (an error where micro-batches were asked for by name: `step.required`)."""
        if not step.plain:
            return Reading()
        part = self.measure(step.required)
        if part is not None:
            return Reading([unscale(part, step.small_scale, step.small_scale)])
        return Reading(complete=False, warning=(
            "fallback", f"noise scale: {step.why()}; measuring it needs >= 2 micro-batches a "
            f"measured step ({step.hint}), and this step had one: B_simple is not measured "
            "(NaN), never measured on part of the model"))

    def describe(self) -> str:
        return (f"micro-batches: each one's gradient as the increment of .grad, over "
                f"{len(self.params)} parameters (b_small = B / k)")

    def preconditioned(self) -> NormPair | None:
        """The pair of `measure` in the P-norm of `weight` (eq. A.2 with `|v|_P^2`), or None
        when no weight was set for every micro-batch of this step."""
        k = len(self.counts)
        if self.preconditioner is None or k < 2 or len(self.sq_preconditioned) != k or \
                min(self.counts) < 1:
            return None
        assert self.previous is not None
        big = torch.dot(self.preconditioner * self.previous, self.previous)
        return self._pair(torch.stack([*self.sq_preconditioned, big]).tolist())

    def _pair(self, values: list[float]) -> NormPair:
        k, big = len(self.counts), sum(self.counts)
        # .grad holds the batch mean: micro-batch j's own gradient is (B / n_j) x its increment;
        # E|g_j|^2 = |G|^2 + tr(Sigma)/n_j, so the mean over j has b_small = 1 / mean(1/n_j).
        sq_small = sum((big / n) ** 2 * s for n, s in zip(self.counts, values, strict=False)) / k
        b_small = k / sum(1.0 / n for n in self.counts)
        return NormPair(sq_small, values[-1], b_small, float(big))

