"""Each step's batch, moved to the run's device: drawn from the task's `sample(batch_size,
generator)` (synthetic or endless data), or taken from its `dataset()` (a map-style
`torch.utils.data.Dataset`) without replacement, epoch after epoch, through a `DataLoader`.

Either source has `draw(size)`, `epochs` (passes over the dataset so far: the `epoch` column) and
`state_dict()` / `load_state_dict()`: where the data stand, so that a resumed run draws what the
uninterrupted run would have.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from gnsweep.measure.common import to_device
from gnsweep.tasks import Task, examples_of
from gnsweep.tasks.datasets import as_dataset

__all__ = ["DataSource", "DatasetSource", "as_dataset", "make_data", "mean_loss", "to_device"]


class DataSource:
    """Draws this rank's samples from `task.sample` with its own generator.

    Each rank draws its own examples from a generator seeded from (seed, rank); rank 0 alone
    draws what a single process would. The probes draw from a generator of their own
    (`measure.run_probes.RunProbes`), so training sees the same examples with or without them."""

    epochs = math.nan
    """Endless data have no epochs."""

    def __init__(self, task: Task, seed: int, world: int, rank: int,
                 device: torch.device) -> None:
        self.task, self.world, self.device = task, world, device
        self.generator = torch.Generator().manual_seed(10_000 + seed + 1_000_003 * rank)

    def draw(self, size: int) -> Any:
        """This rank's share (size / world samples) of a step's batch of `size`, on the device."""
        return to_device(self.task.sample(_per_rank(size, self.world), self.generator),
                         self.device)

    def state_dict(self) -> dict[str, Any]:
        """The generator's state (a uint8 tensor): the next draw follows from it."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])

    def close(self) -> None:
        """Nothing to release."""


class DatasetSource:
    """Takes this rank's samples from a map-style Dataset, each index once an epoch.

    Every epoch the indices are shuffled by a generator seeded from (seed, epoch) alone, the
    same permutation on every rank; rank r takes every world-th index from position r on (as
    torch's DistributedSampler does), so the ranks' shares are disjoint and together hold all
    but the last len % world indices, a different few each epoch. A step takes the next
    size / world indices of this rank's share and goes on into the next epoch where the share
    runs out, so every batch is whole and no index repeats within an epoch.

    Where the data stand is (epoch, position in this rank's share): nothing else. Items are
    fetched and collated (`task.collate(items)`, else torch's default) by a `DataLoader` with
    `workers` worker processes, kept alive across steps and prefetching while the model trains;
    memory is pinned on CUDA. The loader's own generator (worker seeds) is seeded from where
    the data stand, so torch's global generator (dropout, initialisation) is never drawn from.
    """

    def __init__(self, dataset: Dataset, seed: int, world: int, rank: int,
                 device: torch.device, *, workers: int = 0, collate: Any = None) -> None:
        self.seed, self.world, self.rank, self.device = seed, world, rank, device
        self.length = len(dataset)  # type: ignore[arg-type]
        self.share = self.length // world
        """Indices of this rank an epoch."""
        if self.share < 1:
            raise ValueError(f"the task's dataset has {self.length} items, fewer than the "
                             f"{world} DDP workers")
        self.epoch, self.position = 0, 0
        self.size = 0
        """Samples of this rank a step, as the loader's iterator was made for."""
        self._orders: dict[int, torch.Tensor] = {}
        self._loader_generator = torch.Generator()
        self.loader = DataLoader(dataset, batch_sampler=_Steps(self), num_workers=workers,
                                 collate_fn=collate or default_collate,
                                 pin_memory=device.type == "cuda",
                                 persistent_workers=workers > 0,
                                 generator=self._loader_generator)
        self._batches: Iterator[Any] | None = None

    @property
    def epochs(self) -> float:
        """Passes over this rank's share so far (1.5: half way through the second epoch)."""
        return self.epoch + self.position / self.share

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's share of the dataset's indices in `epoch`, in the order they are drawn."""
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(30_000 + 1_000_003 * self.seed + epoch)
            permutation = torch.randperm(self.length, generator=generator)
            # Kept: this epoch's and the one before (a batch that spans the two).
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = permutation[self.rank::self.world][:self.share]
        return self._orders[epoch]

    def draw(self, size: int) -> Any:
        """This rank's next size / world samples, collated, on the device."""
        per_rank = _per_rank(size, self.world)
        if self._batches is None or per_rank != self.size:
            # A new size (an adaptive run) or a resumed position: the loader starts over from
            # where the data stand (prefetched batches of another size are dropped).
            self.size = per_rank
            self._loader_generator.manual_seed(
                40_000 + 1_000_003 * self.seed + 1_009 * self.rank + self.epoch * self.share
                + self.position)
            self._batches = iter(self.loader)
        batch = next(self._batches)
        self.position += per_rank
        self.epoch += self.position // self.share
        self.position %= self.share
        return to_device(batch, self.device)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the position in this rank's share of it: the next draw follows."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def close(self) -> None:
        """Shut the loader's worker processes down (a later `draw` starts them again)."""
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
            # The loader keeps its persistent workers' iterator to reset it on the next
            # iter(): forget the one shut down, so that the next one starts new workers.
            self.loader._iterator = None


class _Steps:
    """The loader's batch sampler: the index lists of the steps to come, each of the source's
    size, from where the source stands when the loader's iterator is made (the source counts
    what was taken, this only reads it)."""

    def __init__(self, source: DatasetSource) -> None:
        self.source = source

    def __iter__(self) -> Iterator[list[int]]:
        source = self.source
        return _steps(source, source.epoch, source.position, source.size)


def _steps(source: DatasetSource, epoch: int, position: int, size: int) -> Iterator[list[int]]:
    while True:
        indices: list[int] = []
        while len(indices) < size:
            taken = source.order(epoch)[position:position + size - len(indices)].tolist()
            indices += taken
            position += len(taken)
            if position == source.share:
                epoch, position = epoch + 1, 0
        yield indices


def make_data(task: Task, seed: int, world: int, rank: int, device: torch.device,
              workers: int = 0) -> DataSource | DatasetSource:
    """The run's data: the task's `dataset()` where it has one (`workers` loader processes),
    else its `sample()`."""
    build = getattr(task, "dataset", None)
    if build is None:
        return DataSource(task, seed, world, rank, device)
    return DatasetSource(as_dataset(build(), "dataset()"), seed, world, rank, device,
                         workers=workers, collate=getattr(task, "collate", None))


@torch.no_grad()
def mean_loss(task: Task, model: torch.nn.Module, dataset: Dataset, device: torch.device,
              batch_size: int = 256) -> float:
    """The task's loss averaged over every item of `dataset`: each batch's mean loss weighted
    by the examples it counts (`task.examples`, else its first dimension)."""
    loader = DataLoader(dataset, batch_size=batch_size,
                        collate_fn=getattr(task, "collate", None) or default_collate)
    total, count = 0.0, 0
    for batch in loader:
        batch = to_device(batch, device)
        n = examples_of(task, batch)
        total += float(task.loss(model, batch)) * n
        count += n
    return total / count if count else math.nan


def _per_rank(size: int, world: int) -> int:
    if size % world:
        raise ValueError(f"batch size {size} is not divisible by the {world} DDP workers")
    return size // world

