"""`NoiseScaleCallback` for PyTorch Lightning: B_simple (eq. 2.9) logged with `self.log`.

    trainer = lightning.Trainer(callbacks=[NoiseScaleCallback()])

One process: per-example gradient norms (b_small = 1) from hooks on the model's layers. Under a
DDP strategy (`strategy="ddp"`, `"ddp_spawn"`, several devices): the DDP communication hook
(b_small = one worker's batch, b_big = the global batch). Gradient accumulation
(`accumulate_grad_batches`) is honoured: Lightning scales each micro-batch's loss so that
`.grad` holds the step's mean, and the measurement covers the whole accumulated step. The
measurement runs in `on_before_optimizer_step`, before Lightning clips gradients.

Logged per optimizer step (`on_step=True`): `b_simple`, `g2` (|G|^2), `trace_sigma` (tr Sigma),
and `b_noise` (eq. 2.8) when `hessian_every > 0`. They reach `trainer.callback_metrics` and
every attached logger.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from torch import nn
from torch.optim import Optimizer

from gnsweep import NoiseScaleMonitor
from gnsweep.integrations._common import Watched, first_tensor, metrics

__all__ = ["NoiseScaleCallback"]
log = logging.getLogger("gnsweep.integrations")


class NoiseScaleCallback(pl.Callback):
    """Measures and logs the gradient noise scale during `Trainer.fit`.

    `method`: None picks `"ddp"` under a multi-process DDP strategy, else `"per_example"`;
    `"microbatch"` needs `accumulate_grad_batches >= 2`. `every`, `ema_steps`, `ema_examples`,
    `hessian_every`, `hessian_microbatches`: as for `gnsweep.NoiseScaleMonitor`. B_noise
    (`hessian_every > 0`) needs `loss_fn(outputs, targets)`, batches `(inputs, targets)` and a
    `forward(inputs)` returning the outputs `loss_fn` takes; it runs on one process only.
    `prog_bar`: also show `b_simple` in the progress bar.
    """

    def __init__(self, *, method: str | None = None, every: int = 1, ema_steps: float = 0.0,
                 ema_examples: float = 2048.0, hessian_every: int = 0,
                 loss_fn: Any = None, hessian_microbatches: int = 2,
                 prog_bar: bool = False) -> None:
        super().__init__()
        self.method, self.every = method, every
        self.ema_steps, self.ema_examples = ema_steps, ema_examples
        self.hessian_every, self.loss_fn = hessian_every, loss_fn
        self.hessian_microbatches, self.prog_bar = hessian_microbatches, prog_bar
        self.monitor: NoiseScaleMonitor | None = None
        self._watched: Watched | None = None
        self._batch: Any = None
        self._warned_dict = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        distributed = (isinstance(model, nn.parallel.DistributedDataParallel)
                       and trainer.world_size > 1)
        method = self.method or ("ddp" if distributed else "per_example")
        if method == "ddp" and self.hessian_every:
            raise ValueError("NoiseScaleCallback: B_noise (hessian_every > 0) runs on one process "
                             "only; set hessian_every=0 under a DDP strategy")
        if method == "ddp":
            # DDP's forward sees every batch, so the monitor counts examples there.
            self._watched, target = None, model
        else:
            # Lightning calls training_step, not forward: count each batch ourselves.
            self._watched = Watched(pl_module)
            target = self._watched
        assert target is not None
        self.monitor = NoiseScaleMonitor(
            target, method, every=self.every, ema_steps=self.ema_steps,
            ema_examples=self.ema_examples, loss_fn=self.loss_fn,
            hessian_every=self.hessian_every, hessian_microbatches=self.hessian_microbatches)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.monitor is None:
            return
        if self._watched is not None:
            self._watched.count(batch)
        elif not isinstance(batch, (tuple, list)) and first_tensor(batch) is not None \
                and not self._warned_dict:
            self._warned_dict = True
            log.warning("noise scale: under DDP the batch must be a tensor or a tuple/list of "
                        "tensors for examples to be counted; got %s", type(batch).__name__)
        self._batch = batch

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.accumulate()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Optimizer) -> None:
        # Once per optimizer step, before clipping; with several optimizers, at the first one.
        if self.monitor is None or (trainer.optimizers and optimizer is not trainer.optimizers[0]):
            return
        batch = self._batch if self.hessian_every else None
        estimate = self.monitor.step(batch=batch)
        for name, value in metrics(estimate, with_b_noise=self.hessian_every > 0).items():
            pl_module.log(name, value, on_step=True, on_epoch=False,
                          prog_bar=self.prog_bar and name == "b_simple")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor, self._watched, self._batch = None, None, None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        # A DDP monitor's close() waits on an all-reduce the other workers may never join.
        if self.monitor is not None and self._watched is not None:
            self.monitor.close()
        self.monitor = None
