"""The Lightning callback, for real: a Trainer with the callback added logs a finite B_simple,
and at fixed parameters (lr = 0) the pooled estimate matches linreg's closed-form truth."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from gnsweep.integrations.lightning import NoiseScaleCallback  # noqa: E402
from gnsweep.tasks import linreg  # noqa: E402

# As in test_measure: ~1% sampling error per 600 batches of 256 at this truth point, so with
# 300 batches (~1.5%) a 6% tolerance is four standard errors.
TRUTH_OPTIONS = linreg.Options(dim=64, condition=4.0)
BATCH, BATCHES = 256, 300


class LinRegModule(pl.LightningModule):
    """A user's module as written without gnsweep: training_step calls the layer directly,
    never `self(...)`."""

    def __init__(self, task: linreg.LinReg, lr: float) -> None:
        super().__init__()
        self.task, self.lr = task, lr
        self.linear = task.model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.task.output_loss(self.linear(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _data(task: linreg.LinReg, batches: int, batch: int, seed: int = 0) -> DataLoader:
    x, y = task.sample(batches * batch, torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def _trainer(callback: NoiseScaleCallback, **kwargs) -> pl.Trainer:
    options = dict(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False)
    options.update(kwargs)
    return pl.Trainer(callbacks=[callback], **options)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_matches_the_closed_form_truth(accumulate):
    task = linreg.make(TRUTH_OPTIONS, seed=0)
    module = LinRegModule(task, lr=0.0)  # parameters stay at initialisation
    truth = task.truth(module.linear)
    # ema_steps=inf pools every step with equal weight: an estimate at fixed parameters.
    callback = NoiseScaleCallback(ema_steps=math.inf)
    trainer = _trainer(callback, accumulate_grad_batches=accumulate)
    trainer.fit(module, _data(task, BATCHES, BATCH // accumulate))
    metrics = trainer.callback_metrics
    assert float(metrics["b_simple"]) == pytest.approx(truth.b_simple, rel=0.06)
    assert float(metrics["g2"]) == pytest.approx(truth.g2, rel=0.06)
    assert float(metrics["trace_sigma"]) == pytest.approx(truth.trace_sigma, rel=0.06)


def test_lightning_logs_b_simple_through_its_loggers(tmp_path):
    """Nothing but the callback added: the metrics reach the attached logger (CSV here)."""
    from lightning.pytorch.loggers import CSVLogger

    task = linreg.make(linreg.Options(dim=8), seed=0)
    module = LinRegModule(task, lr=0.1)
    trainer = _trainer(NoiseScaleCallback(), logger=CSVLogger(tmp_path), log_every_n_steps=5,
                       max_epochs=2)
    trainer.fit(module, _data(task, 20, 32))
    assert math.isfinite(float(trainer.callback_metrics["b_simple"]))
    import pandas as pd

    logged = pd.read_csv(next(tmp_path.rglob("metrics.csv")))
    values = logged["b_simple"].dropna()
    assert len(values) >= 5 and values.map(math.isfinite).all()
    assert {"g2", "trace_sigma"} <= set(logged.columns)


def test_lightning_b_noise_when_asked():
    task = linreg.make(TRUTH_OPTIONS, seed=0)

    class WithForward(LinRegModule):
        def forward(self, x):
            return self.linear(x)

    module = WithForward(task, lr=0.0)
    truth = task.truth(module.linear)
    callback = NoiseScaleCallback(ema_steps=math.inf, hessian_every=1, loss_fn=task.output_loss,
                                  hessian_microbatches=8)
    trainer = _trainer(callback)
    trainer.fit(module, _data(task, 150, BATCH))
    assert float(trainer.callback_metrics["b_noise"]) == pytest.approx(truth.b_noise, rel=0.1)


class DictBatches(LinRegModule):
    """The same module fed dict batches ({"x", "y"}), as many data pipelines yield them."""

    def training_step(self, batch, batch_idx):
        return super().training_step((batch["x"], batch["y"]), batch_idx)


def _dict_data(task: linreg.LinReg, batches: int, batch: int) -> DataLoader:
    x, y = task.sample(batches * batch, torch.Generator().manual_seed(0))
    rows = [{"x": x[i], "y": y[i]} for i in range(len(x))]
    return DataLoader(rows, batch_size=batch, shuffle=False)


@pytest.mark.slow
@pytest.mark.distributed
def test_lightning_ddp_with_dict_batches_matches_the_truth():
    """Two CPU processes (gloo), dict batches, accumulation of 2: b_small is one rank's batch
    (its examples counted from the dict), b_big the global batch, and the pooled estimate at
    fixed parameters matches the truth. (The monitor refuses per-example norms when .grad is
    all-reduced, so a value here comes from each rank's own gradient.)"""
    task = linreg.make(TRUTH_OPTIONS, seed=0)
    module = DictBatches(task, lr=0.0)
    truth = task.truth(module.linear)
    callback = NoiseScaleCallback(ema_steps=math.inf)
    trainer = _trainer(callback, strategy="ddp_spawn", devices=2, accumulate_grad_batches=2)
    # Lightning shards the loader: each rank sees BATCH // 4 examples a micro-batch.
    # BATCHES / 2 steps (~2% sampling error): 8% is four standard errors.
    trainer.fit(module, _dict_data(task, 2 * BATCHES, BATCH // 4))
    metrics = trainer.callback_metrics
    assert float(metrics["b_simple"]) == pytest.approx(truth.b_simple, rel=0.08)
    assert float(metrics["g2"]) == pytest.approx(truth.g2, rel=0.08)


def test_lightning_bf16_mixed_matches_the_truth():
    """precision="bf16-mixed" (autocast on the CPU): the hooks' statistics are taken in fp32,
    and the estimate at fixed parameters still matches the closed form."""
    task = linreg.make(TRUTH_OPTIONS, seed=0)
    module = LinRegModule(task, lr=0.0)
    truth = task.truth(module.linear)
    callback = NoiseScaleCallback(ema_steps=math.inf)
    trainer = _trainer(callback, precision="bf16-mixed")
    trainer.fit(module, _data(task, BATCHES, BATCH))
    assert callback.unavailable is None
    assert float(trainer.callback_metrics["b_simple"]) == pytest.approx(truth.b_simple, rel=0.06)


class AdamModule(LinRegModule):
    def __init__(self, task: linreg.LinReg, lr: float, optimizer: str) -> None:
        super().__init__(task, lr)
        self.optimizer_name = optimizer

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


@pytest.mark.parametrize("optimizer,accumulate", [("sgd", 1), ("adamw", 2)])
def test_lightning_logs_b_simple_precond(optimizer, accumulate):
    """SGD with momentum: b_simple_precond is b_simple; AdamW: its own, finite, positive."""
    task = linreg.make(linreg.Options(dim=16, condition=100.0), seed=0)
    callback = NoiseScaleCallback(ema_fraction=0.2)
    trainer = _trainer(callback, accumulate_grad_batches=accumulate)
    trainer.fit(AdamModule(task, 0.01, optimizer), _data(task, 40, 32 // accumulate))
    simple = float(trainer.callback_metrics["b_simple"])
    precond = float(trainer.callback_metrics["b_simple_precond"])
    assert math.isfinite(simple) and precond > 0
    if optimizer == "sgd":
        assert precond == pytest.approx(simple, rel=1e-6)
    else:
        assert precond != pytest.approx(simple, rel=0.05)


class MarkovGptModule(pl.LightningModule):
    """tests/helpers/lm_task.py's nanoGPT-style model (positions wpe(torch.arange(T)))."""

    def __init__(self) -> None:
        super().__init__()
        import lm_task

        self.task = lm_task.make(0)
        self.gpt = self.task.model()

    def training_step(self, batch, batch_idx):
        return self.task.loss(self.gpt, batch[0])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _lm_data(batch: int) -> DataLoader:
    import lm_task

    tokens = lm_task.make(0).sample(64, torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens), batch_size=batch, shuffle=False)


def test_lightning_broadcast_positions_need_accumulation():
    """auto switches to micro-batches at the first step: with one micro-batch a step the
    callback says it needs accumulate_grad_batches >= 2; with two it measures, and
    examples=16 (tokens a sequence) logs B_simple 16x the value in sequences."""
    one = NoiseScaleCallback()
    _trainer(one, accumulate_grad_batches=1).fit(MarkovGptModule(), _lm_data(8))
    assert "accumulate_grad_batches >= 2" in one.unavailable
    values = {}
    for examples in (None, 16):
        callback = NoiseScaleCallback(examples=examples)
        trainer = _trainer(callback, accumulate_grad_batches=2)
        trainer.fit(MarkovGptModule(), _lm_data(4))
        assert callback.unavailable is None
        values[examples] = float(trainer.callback_metrics["b_simple"])
    assert math.isfinite(values[None]) and values[None] != 0
    assert values[16] == pytest.approx(16 * values[None], rel=1e-5)


def test_lightning_inside_a_script_sweep_logs_the_runs_rows_and_stops(tmp_path, monkeypatch):
    """Started by `gnsweep launch task=script` (its GNSWEEP_* environment), the callback writes
    each optimizer step as the run's row (the batch's loss, the rate, B_simple) and ends
    training on the sweep's stop flag; two micro-batches a step give one row a step."""
    import json

    from gnsweep import paths
    from gnsweep import run_handle as handle

    run_dir = tmp_path / "runs" / "b00064_lr0.05_s0"
    run_dir.mkdir(parents=True)
    for name, value in {"run_dir": run_dir, "batch_size": 64, "learning_rate": 0.05,
                        "max_steps": 1000, "targets": "0.1"}.items():
        monkeypatch.setenv(f"GNSWEEP_{name.upper()}", str(value))
    monkeypatch.setattr(handle, "_current", None)
    task = linreg.make(TRUTH_OPTIONS, seed=0)
    losses: list[float] = []

    class Module(LinRegModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            losses.append(float(loss.detach()))
            if self.trainer.global_step == 9 and batch_idx % 2 == 1:  # step 10's last piece
                (run_dir / paths.SCRIPT_STOP).write_text("stop\n")
            return loss

    trainer = _trainer(NoiseScaleCallback(), accumulate_grad_batches=2)
    trainer.fit(Module(task, lr=0.05), _data(task, 100, 32))
    rows = [json.loads(line) for line in (run_dir / paths.SCRIPT_ROWS).read_text().splitlines()
            if line.strip()]
    assert [row["step"] for row in rows] == list(range(1, 11))
    assert trainer.global_step == 10  # stopped at the flag
    # Each row's loss is its step's batch mean: the mean of its two micro-batches' losses.
    means = [(a + b) / 2 for a, b in zip(losses[0::2], losses[1::2], strict=True)]
    assert [row["loss"] for row in rows] == pytest.approx(means[:10], rel=1e-6)
    assert all(row["lr"] == 0.05 for row in rows)
    assert math.isfinite(rows[-1]["b_simple"]) and rows[-1]["b_simple"] > 0
