"""How a run trains apart from what the sweep varies (`config.train`): the optimizer, each
step's learning rate (`lr_schedule`, or an adaptive batch schedule's eq. 2.7), clipping and
precision. The parts with state have `state_dict()` / `load_state_dict()` and a place in the
run's `TrainState`: the optimizer (torch's), the learning-rate schedule (its settings: its
position is the run's counters) and the precision (fp16's gradient scaler). Clipping holds no
state: `clip_gradients` each step."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from gnsweep.config import TrainConfig
from gnsweep.schedule import AdaptiveBatch, AlongBatch, BatchSchedule
from gnsweep.training.lr_schedule import LrSchedule

Factory = Callable[[Iterable[torch.nn.Parameter], float, TrainConfig], torch.optim.Optimizer]


def _sgd(params: Iterable[torch.nn.Parameter], lr: float, train: TrainConfig
         ) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=train.momentum,
                           weight_decay=train.weight_decay)


def _momentum(params: Iterable[torch.nn.Parameter], lr: float, train: TrainConfig
              ) -> torch.optim.Optimizer:
    # Heavy-ball SGD; train.momentum when set, else the usual 0.9.
    return torch.optim.SGD(params, lr=lr, momentum=train.momentum or 0.9,
                           weight_decay=train.weight_decay)


def _adam(params: Iterable[torch.nn.Parameter], lr: float, train: TrainConfig
          ) -> torch.optim.Optimizer:
    # Adam's weight decay is L2 (added to the gradient, then normalised with it).
    return torch.optim.Adam(params, lr=lr, betas=(train.betas[0], train.betas[1]),
                            eps=train.eps, weight_decay=train.weight_decay)


def _adamw(params: Iterable[torch.nn.Parameter], lr: float, train: TrainConfig
           ) -> torch.optim.Optimizer:
    # Decoupled: each step the weights shrink by lr x weight_decay, apart from the gradient.
    return torch.optim.AdamW(params, lr=lr, betas=(train.betas[0], train.betas[1]),
                             eps=train.eps, weight_decay=train.weight_decay)


REGISTRY: dict[str, Factory] = {"sgd": _sgd, "momentum": _momentum, "adam": _adam,
                                "adamw": _adamw}
"""Name -> factory(params, lr, train); the names are `gnsweep.config.OPTIMIZERS`."""


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, lr: float,
                   train: TrainConfig | None = None) -> torch.optim.Optimizer:
    """The optimizer `name` over `params` with `train`'s momentum, weight decay, betas and eps
    (default: `TrainConfig()`'s, plain SGD for `sgd`)."""
    if name not in REGISTRY:
        raise ValueError(f"optimizer {name!r}: choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name](params, lr, train or TrainConfig())


def set_learning_rate(optimizer: torch.optim.Optimizer, schedule: BatchSchedule,
                      lr_schedule: LrSchedule, peak: float, steps: int, examples: float,
                      per_step: float) -> float:
    """Set and return the rate of the step that ends at `steps` steps and `examples` examples
    (`per_step` of them this step): `peak` x the learning-rate schedule's factor, or an
    adaptive or along batch schedule's eps(B) (eq. 2.7; `peak` is then eps_max; the config
    refuses a warmup or decay with it)."""
    if isinstance(schedule, (AdaptiveBatch, AlongBatch)):
        rate = schedule.learning_rate()
    else:
        rate = peak * lr_schedule.factor(steps, examples, per_step)
    for group in optimizer.param_groups:
        group["lr"] = rate
    return rate


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """The global 2-norm of the parameters' gradients, and with `max_norm` > 0 the gradients
    scaled down to that norm where it is above (torch's `clip_grad_norm_`); the norm returned
    is the one before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return math.nan
    norm = torch.nn.utils.get_total_norm(grads)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16,
                                         "fp16": torch.float16}
"""train.precision -> the autocast dtype (None: no autocast)."""


class Precision:
    """fp32, bf16 or fp16 training: autocast around the task's loss on the run's device, and
    for fp16 a gradient scaler (the loss scaled up before backward so that small gradients do
    not flush to zero in fp16; unscaled before clipping and the step; a step whose gradients
    overflowed is skipped and the scale halved)."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision not in DTYPES:
            raise ValueError(f"precision {precision!r}: choose one of {', '.join(DTYPES)}")
        self.precision, self.device = precision, device
        self.dtype = DTYPES[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.skipped = 0
        """Steps skipped so far for overflowed gradients."""

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward pass's context: autocast to the precision's dtype (nothing for fp32)."""
        if self.dtype is None:
            yield
        else:
            with torch.autocast(self.device.type, dtype=self.dtype):
                yield

    @property
    def loss_scale(self) -> float:
        """The factor the gradients carry until `unscale` (1 without a scaler)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale (before clipping and the step)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer's step; False when the scaler skipped it (non-finite gradients: the
        scale drops, which is how a skip shows)."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        taken = self.scaler.get_scale() >= before
        self.skipped += not taken
        return taken

    def state_dict(self) -> dict[str, Any]:
        """The scaler's scale and growth tracker, and the steps skipped so far."""
        return {"precision": self.precision, "skipped": self.skipped,
                "scaler": self.scaler.state_dict() if self.scaler is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["precision"] != self.precision:
            raise ValueError(f"a state saved in {state['precision']}, this run trains in "
                             f"{self.precision}")
        self.skipped = int(state["skipped"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
