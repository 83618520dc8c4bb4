"""Each step's batch: this rank's share drawn from the task's `sample(batch_size, generator)`,
moved to the run's device. The generator is the data's position: its state is the state."""

from __future__ import annotations

from typing import Any

import torch

from gnsweep.measure.common import to_device
from gnsweep.tasks import Task

__all__ = ["DataSource", "to_device"]


class DataSource:
    """Draws this rank's samples from `task.sample` with its own generator.

    Each rank draws its own examples from a generator seeded from (seed, rank); rank 0 alone
    draws what a single process would. The probes draw from a generator of their own
    (`measure.probe.RunProbes`), so training sees the same examples with or without them."""

    def __init__(self, task: Task, seed: int, world: int, rank: int,
                 device: torch.device) -> None:
        self.task, self.world, self.device = task, world, device
        self.generator = torch.Generator().manual_seed(10_000 + seed + 1_000_003 * rank)

    def draw(self, size: int) -> Any:
        """This rank's share (size / world samples) of a step's batch of `size`, on the device."""
        if size % self.world:
            raise ValueError(f"batch size {size} is not divisible by the {self.world} DDP "
                             "workers")
        return to_device(self.task.sample(size // self.world, self.generator), self.device)

    def state_dict(self) -> dict[str, Any]:
        """The generator's state (a uint8 tensor): the next draw follows from it."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
