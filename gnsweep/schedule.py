"""Batch schedules: the batch size of each training step.

The loop asks the schedule before every step, handing it where training stands (`Progress`:
steps, examples, the monitor's latest `NoiseEstimate`); the schedule returns the global number
of samples to draw (`task.sample`'s unit: windows for a language model, not tokens). Constant
today; an adaptive schedule (B = sqrt(r * B_noise)) reads `progress.estimate`, whose noise
scales are in the task's example unit: divide by `progress.examples_per_sample` to get samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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


@dataclass(frozen=True)
class ConstantBatch:
    """The grid point's batch size, every step."""

    batch_size: int

    def next_batch_size(self, progress: Progress) -> int:
        return self.batch_size
