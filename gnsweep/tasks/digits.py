"""An MLP on scikit-learn's bundled handwritten digits (1797 x 64, 10 classes), cross-entropy.

The data ship inside scikit-learn's wheel, so the default sweep needs no download.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

DESCRIPTION = "MLP on scikit-learn's bundled digits (1797 x 64, 10 classes), cross-entropy."


@dataclass
class Options:
    hidden: int = 64
    """Width of each hidden layer."""
    depth: int = 2
    """Number of hidden layers."""
    holdout: float = 0.2
    """Fraction of the examples kept out of training, for the eval loss."""

    def __post_init__(self) -> None:
        from gnsweep.config import ConfigError, _integer, _number

        self.hidden = _integer("task.hidden", self.hidden)
        self.depth = _integer("task.depth", self.depth)
        self.holdout = _number("task.holdout", self.holdout)
        if self.hidden < 1 or self.depth < 0:
            raise ConfigError("task.hidden must be >= 1 and task.depth >= 0")
        if not 0 <= self.holdout < 1:
            raise ConfigError(f"task.holdout: {self.holdout} must be in [0, 1)")


class Digits:
    def __init__(self, options: Options, seed: int) -> None:
        from sklearn.datasets import load_digits

        data = load_digits()
        x = torch.tensor(data.data, dtype=torch.float32) / 16.0
        y = torch.tensor(data.target, dtype=torch.long)
        # The split is fixed (seed 0) so that every run of a sweep sees the same data.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        n_eval = round(options.holdout * len(x))
        self._eval = (x[order[:n_eval]], y[order[:n_eval]]) if n_eval else None
        self.x, self.y = x[order[n_eval:]], y[order[n_eval:]]
        mean, std = self.x.mean(0), self.x.std(0).clamp_min(1e-3)
        self.x = (self.x - mean) / std
        if self._eval is not None:
            self._eval = ((self._eval[0] - mean) / std, self._eval[1])
        self.options, self.seed = options, seed

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        layers: list[nn.Module] = []
        width = self.x.shape[1]
        for _ in range(self.options.depth):
            layers += [nn.Linear(width, self.options.hidden), nn.Tanh()]
            width = self.options.hidden
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(len(self.x), (size,), generator=generator)
        return self.x[index], self.y[index]

    def eval_data(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._eval


def make(options: Options, seed: int) -> Digits:
    return Digits(options, seed)
