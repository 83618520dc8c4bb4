"""Batch schedules: the batch size of each training step.

The loop asks the schedule before every step, handing it where training stands (`Progress`:
steps, examples, the monitor's latest `NoiseEstimate`); the schedule returns the global number
of samples to draw (`task.sample`'s unit: windows for a language model, not tokens). Constant
(the grid's runs), or adaptive (appendix D: B = sqrt(r * B_noise), the learning rate following
eq. 2.7), which reads `progress.estimate`, whose noise scales are in the task's example unit:
divided by `progress.examples_per_sample` they are in samples. docs/adaptive.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gnsweep.lr_law import eps_opt
from gnsweep.noise import NoiseEstimate


@dataclass(frozen=True)
class Progress:
    """Where a run stands before a step."""

    step: int
    """Optimizer steps taken."""
    examples: int
    """Examples seen (the task's unit: `task.examples(batch)` summed over steps)."""
    estimate: NoiseEstimate | None
    """The monitor's latest estimate (B_simple, B_noise in the task's example unit), or None."""
    examples_per_sample: float
    """Examples per sampled item in the last batch (tokens per window; 1 for most tasks)."""


class BatchSchedule(Protocol):
    def next_batch_size(self, progress: Progress) -> int:
        """The global batch size (samples) of the next step; a multiple of the DDP world size."""

    def state_dict(self) -> dict[str, Any]:
        """What the schedule learned on the way (empty for a constant one)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class ConstantBatch:
    """The grid point's batch size, every step."""

    batch_size: int

    def next_batch_size(self, progress: Progress) -> int:
        return self.batch_size

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def eps_of_batch(batch_size: float, eps_max: float, b_noise: float) -> float:
    """The learning rate at batch size B, eq. 2.7 (`lr_law.eps_opt`, SGD)."""
    return float(eps_opt(batch_size, eps_max, b_noise))


class AdaptiveBatch:
    """Appendix D's schedule: B = sqrt(r * B_noise) with the latest noise scale, each step.

    B_noise is the monitor's B_noise where measured (noise.hessian_every), else B_simple in its
    place. The exchange rate r is in the task's example unit (examples per step: the price of
    one step in examples); the answer is in samples, clipped to [min_batch, max_batch], rounded
    to a multiple of the DDP world size, and changed only when it moves by at least
    `min_change` (relative) so that the size does not jitter with the estimate's noise. Until
    a usable estimate exists (the first step, or a negative noisy one) the size stays put.
    """

    def __init__(self, exchange_rate: float, eps_max: float, min_batch: int, max_batch: int,
                 min_change: float = 0.1, world: int = 1, lr_noise: float = 0.0) -> None:
        if not (exchange_rate > 0 and eps_max > 0 and 0 < min_batch <= max_batch):
            raise ValueError("AdaptiveBatch needs exchange_rate > 0, eps_max > 0 and "
                             f"0 < min_batch <= max_batch, got {exchange_rate}, {eps_max}, "
                             f"{min_batch}, {max_batch}")
        self.exchange_rate, self.eps_max = exchange_rate, eps_max
        """r in the task's example unit; eps_max of eq. 2.7."""
        self.world = world
        self.min_batch = _multiple(min_batch, world, math.ceil)
        self.max_batch = max(self.min_batch, _multiple(max_batch, world, math.floor))
        self.min_change = min_change
        self.size = self.min_batch
        self.b_noise = math.nan
        """The noise scale (samples) the current size was set from (NaN: none yet)."""
        self.lr_noise = lr_noise
        """A fixed B_noise (examples) for the learning-rate rule (0: the measured one)."""
        self.per_sample = 1.0

    def target(self, b_noise: float, examples_per_sample: float = 1.0) -> int:
        """sqrt(r * B_noise) with r and B_noise in examples, in samples (divided by the
        examples per sample), clipped to the bounds (no jitter threshold)."""
        wanted = math.sqrt(self.exchange_rate * b_noise) / examples_per_sample
        return min(self.max_batch, max(self.min_batch, _multiple(wanted, self.world)))

    def next_batch_size(self, progress: Progress) -> int:
        self.per_sample = progress.examples_per_sample
        b_noise = noise_in_samples(progress)
        if math.isfinite(b_noise) and b_noise > 0:
            self.b_noise = b_noise
            per_sample = progress.examples_per_sample
            wanted = self.target(b_noise * per_sample, per_sample)
            if abs(wanted - self.size) >= self.min_change * self.size:
                self.size = wanted
        return self.size

    def state_dict(self) -> dict[str, Any]:
        """The current size, the noise scale it was set from and the last examples per sample
        (the bounds and the rule are the constructor's)."""
        return {"size": self.size, "b_noise": self.b_noise, "per_sample": self.per_sample}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.size, self.b_noise = int(state["size"]), float(state["b_noise"])
        self.per_sample = float(state["per_sample"])

    def learning_rate(self) -> float:
        """eps(B) = eps_max / (1 + B_noise/B) at the current size (eq. 2.7), B_noise the measured
        one or `lr_noise`. Before any estimate B_noise is taken at the upper bound: a step too
        small wastes one small batch, one too large can throw the run off (on linreg eps_max/2
        at the smallest batch doubled the loss)."""
        if self.lr_noise > 0:
            return eps_of_batch(self.size, self.eps_max, self.lr_noise / self.per_sample)
        if not math.isfinite(self.b_noise):
            return eps_of_batch(self.size, self.eps_max, self.max_batch)
        return eps_of_batch(self.size, self.eps_max, self.b_noise)


class AlongBatch:
    """A batch-size warm-up that follows the critical batch size measured along a base run
    (docs/along.md, Merrill et al. 2025): at E examples seen, the local B_crit of a branch
    sweep (`analysis.along`) interpolated linearly in log E and log B_crit between its branch
    points (held at the first and last point beyond them), in samples (divided by the examples
    per sample), rounded down to a power of two (a multiple of the DDP world size), clipped to
    [min_batch, max_batch]. The learning rate is eq. 2.7's eps_max / (1 + B_noise/B) at the
    current size with the fixed B_noise the grid's best learning rates imply (`lr_noise`,
    examples): the rule the fixed-batch runs beside it follow.

    The schedule is a function of the examples seen: nothing to save but the last examples per
    sample (the learning rate's unit)."""

    def __init__(self, points: list[tuple[float, float]], eps_max: float, lr_noise: float,
                 min_batch: int, max_batch: int, world: int = 1) -> None:
        usable = sorted((float(e), float(b)) for e, b in points if e > 0 and b > 0)
        if not usable or not (eps_max > 0 and lr_noise > 0 and 0 < min_batch <= max_batch):
            raise ValueError("AlongBatch needs measured points (examples, B_crit > 0), "
                             f"eps_max > 0, lr_noise > 0 and 0 < min_batch <= max_batch; got "
                             f"{points}, {eps_max}, {lr_noise}, {min_batch}, {max_batch}")
        self.log_e = [math.log(e) for e, _ in usable]
        self.log_b = [math.log(b) for _, b in usable]
        self.eps_max, self.lr_noise, self.world = eps_max, lr_noise, world
        self.min_batch = _multiple(min_batch, world, math.ceil)
        self.max_batch = max(self.min_batch, _multiple(max_batch, world, math.floor))
        self.size = self.min_batch
        self.per_sample = 1.0

    def b_crit(self, examples: float) -> float:
        """The measured local B_crit (examples) at `examples` seen, interpolated in log-log."""
        if examples <= 0 or len(self.log_e) == 1:
            return math.exp(self.log_b[0])
        x = math.log(examples)
        if x <= self.log_e[0]:
            return math.exp(self.log_b[0])
        if x >= self.log_e[-1]:
            return math.exp(self.log_b[-1])
        i = next(k for k in range(1, len(self.log_e)) if x <= self.log_e[k])
        t = (x - self.log_e[i - 1]) / (self.log_e[i] - self.log_e[i - 1])
        return math.exp(self.log_b[i - 1] + t * (self.log_b[i] - self.log_b[i - 1]))

    def next_batch_size(self, progress: Progress) -> int:
        self.per_sample = progress.examples_per_sample
        wanted = self.b_crit(progress.examples) / self.per_sample
        # Down to a power of two; one that the log interpolation hits within rounding counts.
        power = 2 ** max(0, math.floor(math.log2(max(wanted, 1.0)) + 1e-9))
        self.size = min(self.max_batch, max(self.min_batch,
                                            _multiple(power, self.world, math.floor)))
        return self.size

    def learning_rate(self) -> float:
        """eq. 2.7 at the current size, with the fixed B_noise of the grid's best rates."""
        return eps_of_batch(self.size, self.eps_max, self.lr_noise / self.per_sample)

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "per_sample": self.per_sample}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.size, self.per_sample = int(state["size"]), float(state["per_sample"])


def noise_in_samples(progress: Progress) -> float:
    """The latest B_noise (B_simple where B_noise is not measured) in samples (the unit of
    batch sizes and of eq. 2.7's B_noise/B); NaN if none."""
    estimate = progress.estimate
    if estimate is None:
        return math.nan
    value = estimate.b_noise if math.isfinite(estimate.b_noise) and estimate.b_noise > 0 \
        else estimate.b_simple
    return value / progress.examples_per_sample


def _multiple(value: float, world: int, rounding: Callable[[float], int] = round) -> int:
    """A multiple of `world` (at least `world`): the nearest, or as `rounding` (ceil, floor)."""
    return max(1, int(rounding(value / world))) * world
