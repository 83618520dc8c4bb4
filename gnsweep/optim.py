"""The optimizers a sweep can use, by name (`sweep.optimizer`): one small registry."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

Factory = Callable[[Iterable[torch.nn.Parameter], float, float], torch.optim.Optimizer]


def _sgd(params: Iterable[torch.nn.Parameter], lr: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def _momentum(params: Iterable[torch.nn.Parameter], lr: float, momentum: float
              ) -> torch.optim.Optimizer:
    # Heavy-ball SGD; sweep.momentum when set, else the usual 0.9.
    return torch.optim.SGD(params, lr=lr, momentum=momentum or 0.9)


def _adam(params: Iterable[torch.nn.Parameter], lr: float, momentum: float
          ) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def _adamw(params: Iterable[torch.nn.Parameter], lr: float, momentum: float
           ) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


REGISTRY: dict[str, Factory] = {"sgd": _sgd, "momentum": _momentum, "adam": _adam,
                                "adamw": _adamw}
"""Name -> factory(params, lr, momentum); the names are `gnsweep.config.OPTIMIZERS`."""


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, lr: float,
                   momentum: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer `name` over `params` (`sgd` uses `momentum`, 0 by default: plain SGD)."""
    if name not in REGISTRY:
        raise ValueError(f"optimizer {name!r}: choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name](params, lr, momentum)
