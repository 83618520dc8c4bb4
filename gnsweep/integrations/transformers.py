"""`NoiseScaleCallback` for the Hugging Face `Trainer`: B_simple (eq. 2.9) in the Trainer's logs.

    trainer = transformers.Trainer(model, args, train_dataset=..., callbacks=[NoiseScaleCallback()])
    # or, so that the report_to integrations (TensorBoard, MLflow, W&B) see the values too:
    NoiseScaleCallback.attach(trainer)

One process: per-example gradient norms (b_small = 1) from hooks on the model's layers
(`nn.Linear`, transformers' `Conv1D`, embeddings, tied weights, norms); parameters of layers
without them (`nn.LSTM`, custom layers) and models with batch statistics (BatchNorm) are
measured from the micro-batches of gradient accumulation (`gradient_accumulation_steps >= 2`;
with one micro-batch they cannot be, and `b_simple` is NaN, said once). Under a multi-process
launch (torchrun, accelerate: DDP), each rank's own gradient is read from hooks on the
parameters before the all-reduce (b_small = one rank's batch, b_big = the global batch).

The measurement covers the whole accumulated step and is taken when its last backward (and DDP's
all-reduce) is over, before the Trainer clips gradients (`max_grad_norm`), which would bias
|G_big|^2. Hooks sit on parameters and layers, never on the model's outputs (under `bf16=True`
accelerate returns fp32 copies of them, off the backward path). Under fp16 the loss scale of
accelerate's gradient scaler is divided out; statistics are in fp32.

The values join every training log entry (`loss`, `learning_rate`, ...) as `b_simple`, `g2`,
`trace_sigma` (and `b_noise` when `hessian_every > 0`) in `trainer.state.log_history`: NaN until
the first measurement, and NaN throughout, said once, where the model cannot be measured.

Inside a sweep (`gnsweep launch task=script`, `gnsweep.current_run()` not None) the callback
also logs each training log entry as the run's metrics row (step, loss, learning rate, grad
norm, the noise scale) and ends training once the run has what it needs (`should_stop()`): a
Trainer script needs only the callback (set `logging_steps=1` for one row a step).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from accelerate.state import GradientState
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gnsweep import NoiseScaleMonitor
from gnsweep.integrations._common import (
    TOKENS,
    Units,
    Watched,
    cannot_measure,
    first_tensor,
    measure_step,
    metrics,
    torch_optimizer,
)
from gnsweep.run_handle import current_run
from gnsweep.training.backward import in_task_units

__all__ = ["NoiseScaleCallback"]
log = logging.getLogger("gnsweep.integrations")


class NoiseScaleCallback(TrainerCallback):
    """Measures the gradient noise scale during `Trainer.train` and adds it to the logs.

    `method`: "auto" (default: per-example norms on one process, each rank's gradient under
    DDP, micro-batches for a model with batch statistics), `"per_example"`, `"microbatch"`
    (needs `gradient_accumulation_steps >= 2`) or `"ddp"`. `every`, `ema_fraction`,
    `ema_steps`, `ema_examples`, `hessian_every`, `hessian_microbatches`: as for
    `gnsweep.NoiseScaleMonitor` (by default the window is the last `DEFAULT_EMA_FRACTION` of
    the examples seen, as in gnsweep's sweeps). B_noise (`hessian_every > 0`, one process)
    re-runs the model on the step's last micro-batch and takes the loss the model returns
    (`outputs.loss`: the batch must carry its labels).

    `examples`: what B counts. `"tokens"` (default): a causal LM's tokens where the batch says
    so (2-d `input_ids` with `labels` of the same shape: the `attention_mask`'s ones, else
    every id; said once), sequences elsewhere; None: sequences (the inputs' first dimension);
    an int: examples a sequence, e.g. `examples=512` for tokens of 512-token sequences; a
    function of the model's inputs (the keyword arguments the Trainer passes, `input_ids`,
    `attention_mask`, ...), e.g. `lambda inputs: int(inputs["attention_mask"].sum())`.
    B_simple, B_noise and tr(Sigma) are then logged in that unit, and `ema_examples` counts it.

    Where per-example norms cannot attribute a layer's gradient to examples (positions
    `wpe(torch.arange(T))`, an input without the batch dimension), method auto measures with
    micro-batches from the first step on: that needs `gradient_accumulation_steps >= 2` (said
    once, and b_simple NaN, without it); an explicit `method="per_example"` stops measuring
    there, said once.
    """

    def __init__(self, *, method: str = "auto", every: int = 1,
                 ema_fraction: float | None = None, ema_steps: float = 0.0,
                 ema_examples: float | None = None, hessian_every: int = 0,
                 hessian_microbatches: int = 2,
                 examples: int | str | Callable[[Any], int] | None = TOKENS) -> None:
        self.units = Units(examples)
        self._accumulation = 1
        self.method, self.every = method, every
        self.ema_fraction, self.ema_steps, self.ema_examples = ema_fraction, ema_steps, \
            ema_examples
        self.hessian_every, self.hessian_microbatches = hessian_every, hessian_microbatches
        self.monitor: NoiseScaleMonitor | None = None
        self.estimate: Any = None
        self.unavailable: str | None = None
        """Why this run cannot be measured (b_simple is logged as NaN), or None."""
        self._said: set[str] = set()  # reasons b_simple was logged NaN, said once each
        self._watched: Watched | None = None
        self._handles: list[Any] = []
        self._scaler: Any = None
        self._inputs: tuple[tuple[Any, ...], list[str], dict[str, Any]] | None = None
        self._queued = False
        self._stepping = False  # the Hessian passes of B_noise run the model again

    @classmethod
    def attach(cls, trainer: Trainer, **options: Any) -> NoiseScaleCallback:
        """A new callback placed first among `trainer`'s callbacks (the Trainer's public
        `callback_handler.callbacks`), so that the values it adds to a log entry reach the
        `report_to` integrations, which the Trainer calls before callbacks given to it."""
        callback = cls(**options)
        trainer.callback_handler.callbacks.insert(0, callback)
        return callback

    # -- TrainerCallback events -----------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if model is None:
            self._cannot("the Trainer passed no model to the callback")
            return
        distributed = args.world_size > 1
        if distributed and self.hessian_every:
            self._cannot("B_noise (hessian_every > 0) runs on one process only; set "
                         "hessian_every=0 under a multi-process launch")
            return
        # accelerate's optimizer wrapper holds fp16's gradient scaler (None otherwise).
        self._scaler = getattr(optimizer, "scaler", None)
        self._watched = Watched(model, call=_call_with_keys)
        try:
            self.monitor = NoiseScaleMonitor(
                self._watched, self.method, every=self.every, ema_fraction=self.ema_fraction,
                ema_steps=self.ema_steps, ema_examples=self.ema_examples,
                loss_fn=_model_loss if self.hessian_every else None,
                hessian_every=self.hessian_every, hessian_microbatches=self.hessian_microbatches,
                all_reduced_grads=distributed)
        except ValueError as err:
            self._cannot(str(err))
            return
        self.monitor.accumulation_hint = "gradient_accumulation_steps >= 2"  # its own words
        self._accumulation = args.gradient_accumulation_steps
        reason = cannot_measure(self.monitor, self._accumulation, "gradient_accumulation_steps")
        if reason is not None:
            self._cannot(reason)
            return
        inner = torch_optimizer(optimizer)
        if inner is not None:  # B_simple_P from the micro-batches of gradient accumulation
            self.monitor.precondition(inner)
        params = self.monitor.params
        # First among the model's hooks: the monitor's own (broadcast parameters) read the
        # batch this one counts.
        self._handles = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True,
                                                         prepend=True),
                         register_multi_grad_hook(params, self._in_backward, mode="any")]

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs:
            return  # evaluation and end-of-training summaries
        values = metrics(self.estimate, with_b_noise=self.hessian_every > 0, said=self._said)
        logs.update(values)
        # The Trainer appended a copy of `logs` to the history just before this event.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)
        run = current_run()
        if run is not None and state.global_step >= 1:  # inside a sweep: the run's row
            extra = {"lr": logs.get("learning_rate"), "grad_norm": logs.get("grad_norm"),
                     **values}
            run.log(state.global_step, None, float(logs["loss"]),
                    **{k: float(v) for k, v in extra.items() if isinstance(v, (int, float))})
            if run.should_stop():
                control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._close()

    # -- hooks on the model ---------------------------------------------------------------

    def _cannot(self, reason: str) -> None:
        """Say once, loudly, why nothing is measured; b_simple is logged as NaN."""
        self._close()
        self.unavailable = reason
        log.error("noise scale: NoiseScaleCallback cannot measure this run, b_simple is logged "
                  "as NaN: %s", reason)

    def _close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.monitor is not None:
            self.monitor.close()
            self.monitor, self._watched, self._inputs = None, None, None

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._watched is None or self._stepping or not module.training \
                or not torch.is_grad_enabled():
            return
        self._watched.count((args, kwargs))
        self.units.add(kwargs if kwargs or not args else args[0])
        if self.hessian_every:
            keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
            rest = {k: v for k, v in kwargs.items() if k not in keys}
            self._inputs = (tuple(args) + tuple(kwargs[k] for k in keys), keys, rest)

    def _in_backward(self, grad: torch.Tensor) -> None:
        # The first parameter gradient of a backward pass; what follows runs when the pass is
        # over. Queued twice: behind DDP's own end-of-backward callback (its all-reduce into
        # .grad), which it queues during the pass.
        if self._stepping or self._queued:
            return
        self._queued = True
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        engine.queue_callback(lambda: engine.queue_callback(self._after_backward))

    def _after_backward(self) -> None:
        self._queued = False
        if self.monitor is None:
            return
        self.monitor.accumulate()
        # The Trainer marks the step's last micro-batch (it clips and steps right after).
        if GradientState().sync_gradients:
            self._stepping = True
            units, per_sample = self.units.take()
            try:
                estimate, reason = measure_step(
                    self.monitor, self._accumulation, "gradient_accumulation_steps",
                    batch=self._hessian_batch(), loss_scale=self._loss_scale(), examples=units)
            finally:
                self._stepping = False
            self.estimate = in_task_units(estimate, per_sample)
            if reason is not None:
                self._cannot(reason)

    def _loss_scale(self) -> float:
        scaler = self._scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return 1.0
        scale = float(scaler.get_scale())
        return scale if scale > 0 and math.isfinite(scale) else 1.0

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
