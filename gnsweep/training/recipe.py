"""How a run trains apart from what the sweep varies: the optimizer (by name, `sweep.optimizer`)
and the learning rate each step uses. The recipe's later parts (a learning-rate schedule,
clipping, precision) belong here, each with `state_dict()` / `load_state_dict()` where it has
state; the optimizer's own are torch's."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from gnsweep.schedule import AdaptiveBatch, AlongBatch, BatchSchedule

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


def set_learning_rate(optimizer: torch.optim.Optimizer, schedule: BatchSchedule,
                      learning_rate: float) -> float:
    """This step's learning rate: the run's, or an adaptive batch schedule's eps(B) (eq. 2.7;
    `learning_rate` is then eps_max), set on the optimizer before its step."""
    if isinstance(schedule, (AdaptiveBatch, AlongBatch)):
        learning_rate = schedule.learning_rate()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
    return learning_rate
