"""User tasks for the protocol tests (importable: tests/helpers/ is on sys.path, and on PYTHONPATH
for the launch subprocesses)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn


class Regression:
    """y = x . w* + noise, a linear model; `per_sample` examples counted per sample."""

    def __init__(self, seed: int, dim: int = 4, per_sample: int = 1) -> None:
        self.seed, self.dim, self.per_sample = seed, dim, per_sample
        self.w = torch.randn(dim, generator=torch.Generator().manual_seed(0))

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Linear(self.dim, 1)

    def sample(self, batch_size: int, generator: torch.Generator) -> dict:
        x = torch.randn(batch_size, self.dim, generator=generator)
        return {"x": x, "y": x @ self.w + 0.1 * torch.randn(batch_size, generator=generator)}

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return 0.5 * (model(batch["x"]).squeeze(-1) - batch["y"]).pow(2).mean()

    def examples(self, batch: dict) -> int:
        return self.per_sample * len(batch["x"])


def make(seed: int, dim: int = 4, per_sample: int = 1) -> Regression:
    return Regression(seed, dim, per_sample)


class Tokens(Regression):
    """Regression counting `per_sample` tokens a sample, and saying so."""

    unit = "tokens"


def tokens(seed: int, per_sample: int = 3) -> Tokens:
    return Tokens(seed, per_sample=per_sample)


class VectorLoss(Regression):
    def loss(self, model, batch):
        return 0.5 * (model(batch["x"]).squeeze(-1) - batch["y"]).pow(2)


def vector_loss(seed: int) -> VectorLoss:
    return VectorLoss(seed)


class Frozen(Regression):
    def model(self):
        model = super().model()
        for p in model.parameters():
            p.requires_grad_(False)
        return model


def frozen(seed: int) -> Frozen:
    return Frozen(seed)


not_callable = 42


class ForeignNoiseParameters(Regression):
    """noise_parameters names a parameter the model does not own."""

    def noise_parameters(self, model):
        return [torch.nn.Parameter(torch.zeros(3))]


def foreign_noise_parameters(seed: int) -> ForeignNoiseParameters:
    return ForeignNoiseParameters(seed)


class RaisesLater(Regression):
    """The loss raises after a few calls: fine for the launch check, fails every run."""

    calls = 0

    def loss(self, model, batch):
        self.calls += 1
        if self.calls > 3:
            raise RuntimeError("boom: the user's loss fails on purpose")
        return super().loss(model, batch)


def raises_later(seed: int) -> RaisesLater:
    return RaisesLater(seed)


class Unsplittable(Regression):
    """A batch with a shared table whose first dimension is not the examples'."""

    def sample(self, batch_size, generator):
        return {**super().sample(batch_size, generator), "table": torch.ones(7)}


def unsplittable(seed: int) -> Unsplittable:
    return Unsplittable(seed)


class Table(torch.utils.data.Dataset):
    """n fixed examples of y = x . w + noise; each item also carries its index."""

    def __init__(self, n: int, dim: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        w = torch.randn(dim, generator=torch.Generator().manual_seed(0))
        self.x = torch.randn(n, dim, generator=generator)
        self.y = self.x @ w + 0.1 * torch.randn(n, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "index": torch.tensor(i)}


class TableTask:
    """Regression over a Dataset (no sample()): `n` training items, 200 held out."""

    def __init__(self, seed: int, n: int = 1000, dim: int = 4) -> None:
        self.seed, self.n, self.dim = seed, n, dim

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Linear(self.dim, 1)

    def dataset(self) -> Table:
        return Table(self.n, self.dim, seed=1)

    def eval_dataset(self) -> Table:
        return Table(200, self.dim, seed=2)

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return 0.5 * (model(batch["x"]).squeeze(-1) - batch["y"]).pow(2).mean()


def table(seed: int, n: int = 1000, dim: int = 4) -> TableTask:
    return TableTask(seed, n, dim)


class NotADataset(TableTask):
    def dataset(self):
        return [(torch.zeros(4), torch.zeros(()))] * 10


def not_a_dataset(seed: int) -> NotADataset:
    return NotADataset(seed)


class NoData:
    """A model and a loss but nothing to train on."""

    def model(self) -> nn.Module:
        return nn.Linear(4, 1)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).mean()


def no_data(seed: int) -> NoData:
    return NoData()


class RecordingTable(TableTask):
    """TableTask whose loss appends each training batch's indices to
    $GNSWEEP_TEST_RECORD/rank<r>.txt under torch.distributed (one line a batch)."""

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        folder = os.environ.get("GNSWEEP_TEST_RECORD")
        dist = torch.distributed
        if folder and dist.is_available() and dist.is_initialized() and model.training:
            with open(os.path.join(folder, f"rank{dist.get_rank()}.txt"), "a") as out:
                out.write(" ".join(map(str, batch["index"].tolist())) + "\n")
        return super().loss(model, batch)


def recording_table(seed: int) -> RecordingTable:
    return RecordingTable(seed)


class Scale(nn.Module):
    """A learned scalar around a child layer: a layer the per-example norms do not cover (a
    leaf layer of one's own would be measured by its own forward,
    `measure.per_example.functional`)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.inner = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.inner(x)


class ScaledTable(TableTask):
    """TableTask with a layer measured by micro-batches (each run's monitor says so)."""

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Sequential(nn.Linear(self.dim, 1), Scale())


def scaled_table(seed: int, n: int = 1000) -> ScaledTable:
    return ScaledTable(seed, n)


class _Scale(nn.Module):
    """A learned scalar factor around a child layer: a parameter outside the layers
    per-example norms cover."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = nn.Parameter(torch.ones(()))
        self.inner = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.factor


class Uncovered(Regression):
    def model(self) -> nn.Module:
        return nn.Sequential(super().model(), _Scale())


def uncovered(seed: int) -> Uncovered:
    return Uncovered(seed)


class BatchNormed(Regression):
    """The regression through a BatchNorm layer: its examples interact within a batch."""

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Sequential(nn.Linear(self.dim, 16), nn.BatchNorm1d(16), nn.Tanh(),
                             nn.Linear(16, 1))


def batch_normed(seed: int) -> BatchNormed:
    return BatchNormed(seed)


class Slow(Regression):
    """A regression whose every loss takes `pause` seconds more: a run's length in wall time,
    whatever the machine's speed (a time limit must fall inside it)."""

    def __init__(self, seed: int, pause: float) -> None:
        super().__init__(seed)
        self.pause = pause

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        time.sleep(self.pause)
        return super().loss(model, batch)


def slow(seed: int, pause: float = 0.02) -> Slow:
    return Slow(seed, pause)
