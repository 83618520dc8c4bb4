"""User tasks for the protocol tests (importable: tests/ is on sys.path, and on PYTHONPATH for
the launch subprocesses)."""

from __future__ import annotations

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


class _Scale(nn.Module):
    """A learned scalar factor: a parameter outside the layers per-example norms cover."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Uncovered(Regression):
    def model(self) -> nn.Module:
        return nn.Sequential(super().model(), _Scale())


def uncovered(seed: int) -> Uncovered:
    return Uncovered(seed)
