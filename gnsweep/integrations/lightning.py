"""`NoiseScaleCallback` for PyTorch Lightning: B_simple (eq. 2.9) logged with `self.log`.

    trainer = lightning.Trainer(callbacks=[NoiseScaleCallback()])

One process: per-example gradient norms (b_small = 1) from hooks on the model's layers
(micro-batches of `accumulate_grad_batches` for layers without them and for models with batch
statistics). Under a DDP strategy (`strategy="ddp"`, `"ddp_spawn"`, several devices): each
rank's own gradient, read by hooks on the parameters before the all-reduce (b_small = one
rank's batch, b_big = the global batch); examples are counted from the batch Lightning hands
the step (a tensor, or a tuple, list or dict of tensors). Gradient accumulation is honoured:
Lightning scales each micro-batch's loss so that `.grad` holds the step's mean, and the
measurement covers the whole accumulated step. The measurement runs in
`on_before_optimizer_step`, before Lightning clips gradients; under `precision="16-mixed"` the
loss scale is divided out (statistics in fp32). A run that cannot be measured logs
`b_simple` NaN, said once.

Logged per optimizer step (`on_step=True`): `b_simple`, `g2` (|G|^2), `trace_sigma` (tr Sigma),
and `b_noise` (eq. 2.8) when `hessian_every > 0`. They reach `trainer.callback_metrics` and
every attached logger. Inside a sweep (`gnsweep launch task=script`, `gnsweep.current_run()`
not None) each optimizer step is also the run's metrics row, and training ends once the run
has what it needs (`should_stop()`): a Lightning script needs only the callback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from torch import nn
from torch.optim import Optimizer

from gnsweep import NoiseScaleMonitor
from gnsweep.integrations._common import (
    TOKENS,
    Units,
    Watched,
    cannot_measure,
    measure_step,
    metrics,
    torch_optimizer,
)
from gnsweep.run_handle import current_run
from gnsweep.training.backward import in_task_units

__all__ = ["NoiseScaleCallback"]
log = logging.getLogger("gnsweep.integrations")


class NoiseScaleCallback(pl.Callback):
    """Measures and logs the gradient noise scale during `Trainer.fit`.

    `method`: None (auto) picks `"ddp"` under a multi-process DDP strategy, micro-batches for
    a model with batch statistics, else `"per_example"`; `"microbatch"` needs
    `accumulate_grad_batches >= 2`. `every`, `ema_fraction`, `ema_steps`, `ema_examples`,
    `hessian_every`, `hessian_microbatches`: as for `gnsweep.NoiseScaleMonitor` (by default
    the window is the last `DEFAULT_EMA_FRACTION` of the examples seen, as in gnsweep's
    sweeps). B_noise
    (`hessian_every > 0`) needs `loss_fn(outputs, targets)`, batches `(inputs, targets)` and a
    `forward(inputs)` returning the outputs `loss_fn` takes; it runs on one process only.
    `prog_bar`: also show `b_simple` in the progress bar.

    `examples`: what B counts. `"tokens"` (default): a causal LM's tokens where the batch (a
    mapping) says so (2-d `input_ids` with `labels` of the same shape: the `attention_mask`'s
    ones, else every id; said once), samples elsewhere; None: samples (the batch's first
    dimension); an int: examples a sample, e.g. `examples=512` for tokens of 512-token
    sequences; a function of the batch Lightning hands the step, e.g.
    `lambda batch: batch["input_ids"].numel()`.
    B_simple, B_noise and tr(Sigma) are then logged in that unit, and `ema_examples` counts it.

    Where per-example norms cannot attribute a layer's gradient to examples (positions
    `wpe(torch.arange(T))`, an input without the batch dimension), method auto measures with
    micro-batches from the first step on: that needs `accumulate_grad_batches >= 2` (said
    once, and b_simple NaN, without it); an explicit `method="per_example"` stops measuring
    there, said once.
    """

    def __init__(self, *, method: str | None = None, every: int = 1,
                 ema_fraction: float | None = None, ema_steps: float = 0.0,
                 ema_examples: float | None = None, hessian_every: int = 0,
                 loss_fn: Any = None, hessian_microbatches: int = 2,
                 prog_bar: bool = False,
                 examples: int | str | Callable[[Any], int] | None = TOKENS) -> None:
        super().__init__()
        self.units = Units(examples)
        self.method, self.every = method, every
        self.ema_fraction, self.ema_steps, self.ema_examples = ema_fraction, ema_steps, \
            ema_examples
        self.hessian_every, self.loss_fn = hessian_every, loss_fn
        self.hessian_microbatches, self.prog_bar = hessian_microbatches, prog_bar
        self.monitor: NoiseScaleMonitor | None = None
        self._watched: Watched | None = None
        self._batch: Any = None
        self.unavailable: str | None = None
        """Why this run cannot be measured (b_simple is logged as NaN), or None."""
        self._said: set[str] = set()  # reasons b_simple was logged NaN, said once each
        self._values: dict[str, float] = {}
        self._logged_step = 0
        self._loss_sum: Any = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        distributed = (isinstance(model, nn.parallel.DistributedDataParallel)
                       and trainer.world_size > 1)
        if distributed and self.hessian_every:
            self._cannot("B_noise (hessian_every > 0) runs on one process only; set "
                         "hessian_every=0 under a DDP strategy")
            return
        # Lightning calls training_step, not forward: count each batch ourselves (any batch
        # with a tensor: tuple, list, dict). Under DDP each rank's gradient is read from
        # parameter hooks (`all_reduced_grads`): DDP all-reduces .grad behind them.
        self._watched = Watched(pl_module)
        try:
            self.monitor = NoiseScaleMonitor(
                self._watched, self.method or "auto", every=self.every,
                ema_fraction=self.ema_fraction, ema_steps=self.ema_steps,
                ema_examples=self.ema_examples, loss_fn=self.loss_fn,
                hessian_every=self.hessian_every, hessian_microbatches=self.hessian_microbatches,
                all_reduced_grads=distributed)
        except ValueError as err:
            self._cannot(str(err))
            return
        self.monitor.accumulation_hint = "accumulate_grad_batches >= 2"  # its own words
        reason = cannot_measure(self.monitor, trainer.accumulate_grad_batches,
                                "accumulate_grad_batches")
        if reason is not None:
            self._cannot(reason)
            return
        inner = torch_optimizer(trainer.optimizers[0]) if trainer.optimizers else None
        if inner is not None:  # B_simple_P from the micro-batches of gradient accumulation
            self.monitor.precondition(inner)

    def _cannot(self, reason: str) -> None:
        """Say once, loudly, why nothing is measured; b_simple is logged as NaN."""
        if self.monitor is not None:
            self.monitor.close()
        self.monitor, self._watched = None, None
        self.unavailable = reason
        log.error("noise scale: NoiseScaleCallback cannot measure this run, b_simple is logged "
                  "as NaN: %s", reason)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.monitor is None:
            return
        if self._watched is not None:
            self._watched.count(batch)
        self.units.add(batch)
        self._batch = batch

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.accumulate()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Optimizer) -> None:
        # Once per optimizer step, before clipping; with several optimizers, at the first one.
        if trainer.optimizers and optimizer is not trainer.optimizers[0]:
            return
        estimate = None
        if self.monitor is not None:
            batch = self._batch if self.hessian_every else None
            # 16-mixed: .grad is unscaled by now, the norms captured in backward are not.
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() \
                else 1.0
            units, per_sample = self.units.take()
            estimate, reason = measure_step(
                self.monitor, trainer.accumulate_grad_batches, "accumulate_grad_batches",
                batch=batch, loss_scale=scale, grads_unscaled=True, examples=units)
            estimate = in_task_units(estimate, per_sample)
            if reason is not None:
                self._cannot(reason)
        self._values = metrics(estimate, with_b_noise=self.hessian_every > 0, said=self._said)
        for name, value in self._values.items():
            pl_module.log(name, value, on_step=True, on_epoch=False,
                          prog_bar=self.prog_bar and name == "b_simple")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """Inside a sweep (`gnsweep.current_run()`): each optimizer step's row (the loss of its
        batch, averaged over the ranks, the learning rate, the noise scale); training ends once
        the run has what it needs."""
        run = current_run()
        if run is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        # Lightning hands each micro-batch's loss divided by accumulate_grad_batches: their
        # sum over the step is the step's batch-mean loss.
        self._loss_sum = self._loss_sum + loss.detach().float()
        step = trainer.global_step
        if step < 1 or step == self._logged_step:
            return  # a micro-batch of a step not yet taken
        self._logged_step = step
        loss, self._loss_sum = self._loss_sum, 0.0
        if trainer.world_size > 1:
            loss = trainer.strategy.reduce(loss, reduce_op="mean")
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else float("nan")
        run.log(step, None, float(loss), lr=lr, **self._values)
        if run.should_stop():
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor, self._watched, self._batch = None, None, None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if self.monitor is not None:
            self.monitor.close()
        self.monitor = None
