"""`NoiseScaleCallback` for the Hugging Face `Trainer`: B_simple (eq. 2.9) in the Trainer's logs.

    trainer = transformers.Trainer(model, args, train_dataset=..., callbacks=[NoiseScaleCallback()])

Per-example gradient norms (b_small = 1) from hooks on the model's `nn.Linear`, `nn.Embedding`,
`nn.LayerNorm`, ... layers; parameters of other layers (GPT-2's `Conv1D`, custom norms) are
measured from the micro-batches of gradient accumulation (`gradient_accumulation_steps >= 2`;
with one micro-batch they are left out, with a warning). Gradient accumulation is honoured: the
measurement covers the whole accumulated step and is taken when its last backward ends, before
the Trainer clips gradients (`max_grad_norm`), which would bias |G_big|^2.

The values join every training log entry (`loss`, `learning_rate`, ...) as `b_simple`, `g2`,
`trace_sigma` (and `b_noise` when `hessian_every > 0`): in `trainer.state.log_history` and in
every `report_to` integration (TensorBoard, MLflow, W&B, ...), which see the same log dict.
One process only: under a multi-process launch the callback warns and measures nothing.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch
from accelerate.state import GradientState
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import DefaultFlowCallback

from gnsweep import NoiseScaleMonitor
from gnsweep.integrations._common import Watched, first_tensor, metrics

__all__ = ["NoiseScaleCallback"]
log = logging.getLogger("gnsweep.integrations")


class NoiseScaleCallback(TrainerCallback):
    """Measures the gradient noise scale during `Trainer.train` and adds it to the logs.

    `method`: `"per_example"` (default) or `"microbatch"` (needs
    `gradient_accumulation_steps >= 2`). `every`, `ema_steps`, `ema_examples`,
    `hessian_every`, `hessian_microbatches`: as for `gnsweep.NoiseScaleMonitor`. B_noise
    (`hessian_every > 0`) re-runs the model on the step's last micro-batch and takes the loss
    the model returns (`outputs.loss`: the batch must carry its labels).
    """

    def __init__(self, *, method: str = "per_example", every: int = 1, ema_steps: float = 0.0,
                 ema_examples: float = 2048.0, hessian_every: int = 0,
                 hessian_microbatches: int = 2) -> None:
        self.method, self.every = method, every
        self.ema_steps, self.ema_examples = ema_steps, ema_examples
        self.hessian_every, self.hessian_microbatches = hessian_every, hessian_microbatches
        self.monitor: NoiseScaleMonitor | None = None
        self.estimate: Any = None
        self._watched: Watched | None = None
        self._handles: list[Any] = []
        self._inputs: tuple[tuple[Any, ...], list[str], dict[str, Any]] | None = None
        self._queued = False
        self._stepping = False  # the Hessian passes of B_noise run the model again

    # -- TrainerCallback events -----------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        if args.world_size > 1:
            log.warning("noise scale: NoiseScaleCallback for transformers measures on one "
                        "process; under a %d-process launch it measures nothing (use "
                        "gnsweep.NoiseScaleMonitor(ddp_model, method='ddp') in your own loop)",
                        args.world_size)
            return
        if model is None:
            return
        self._run_first()
        self._watched = Watched(model, call=_call_with_keys)
        self.monitor = NoiseScaleMonitor(
            self._watched, self.method, every=self.every, ema_steps=self.ema_steps,
            ema_examples=self.ema_examples, loss_fn=_model_loss if self.hessian_every else None,
            hessian_every=self.hessian_every, hessian_microbatches=self.hessian_microbatches)
        self._handles = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                         model.register_forward_hook(self._after_forward)]

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs:
            return  # evaluation and end-of-training summaries
        values = metrics(self.estimate, with_b_noise=self.hessian_every > 0)
        logs.update(values)
        # The Trainer appended a copy of `logs` to the history just before this event.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.monitor is not None:
            self.monitor.close()
            self.monitor, self._watched, self._inputs = None, None, None

    # -- hooks on the model ---------------------------------------------------------------

    def _run_first(self) -> None:
        """Move this callback to the front of the Trainer's callback list, so the values it
        adds to a log entry reach the `report_to` integrations, which come first otherwise.
        The Trainer hands callbacks no reference to itself: find the list that holds both this
        callback and the Trainer's `DefaultFlowCallback`."""
        for holder in gc.get_referrers(self):
            if isinstance(holder, list) and any(isinstance(c, DefaultFlowCallback)
                                                for c in holder):
                holder.remove(self)
                holder.insert(0, self)
                return

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._watched is None or self._stepping or not module.training \
                or not torch.is_grad_enabled():
            return
        self._watched.count((args, kwargs))
        if self.hessian_every:
            keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
            rest = {k: v for k, v in kwargs.items() if k not in keys}
            self._inputs = (tuple(args) + tuple(kwargs[k] for k in keys), keys, rest)

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._watched is None or self._stepping or not module.training \
                or not torch.is_grad_enabled():
            return
        tensor = first_tensor(output)
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(self._in_backward)

    def _in_backward(self, grad: torch.Tensor) -> None:
        # Runs when the backward reaches the model's output; what follows must run when it is
        # over, with every .grad accumulated.
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
                self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        if self.monitor is None:
            return
        self.monitor.accumulate()
        # The Trainer marks the step's last micro-batch (it clips and steps right after).
        if GradientState().sync_gradients:
            self._stepping = True
            try:
                self.estimate = self.monitor.step(batch=self._hessian_batch())
            finally:
                self._stepping = False

    def _hessian_batch(self) -> tuple[Any, Any] | None:
        if not self.hessian_every or self._inputs is None:
            return None
        tensors, keys, rest = self._inputs
        assert self._watched is not None
        self._watched.call = lambda inner, *xs: _call_with_keys(inner, *xs, keys=keys,
                                                                 rest=rest)
        first = first_tensor(tensors)
        assert first is not None
        # The model computes its own loss from the labels among the inputs: no targets.
        return tensors, torch.zeros(first.shape[0])


def _call_with_keys(inner: nn.Module, *tensors: Any, keys: list[str] | None = None,
                    rest: dict[str, Any] | None = None) -> Any:
    keys = keys or []
    positional = tensors[:len(tensors) - len(keys)]
    named = dict(zip(keys, tensors[len(positional):], strict=True))
    return inner(*positional, **named, **(rest or {}))


def _model_loss(outputs: Any, targets: Any) -> torch.Tensor:
    loss = outputs["loss"] if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    if loss is None:
        loss = outputs[0]
    return loss
