"""The Hugging Face callback, for real: a Trainer with the callback added logs a finite B_simple
(log history and the TensorBoard integration), and at fixed parameters (lr = 0) the pooled
estimate matches linreg's closed-form truth. Models are built from configs: no downloads."""

from __future__ import annotations

import math
import os

import pytest
import torch
from locations import HELPERS
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gnsweep.integrations.transformers import NoiseScaleCallback  # noqa: E402
from gnsweep.tasks import linreg  # noqa: E402

TRUTH_OPTIONS = linreg.Options(dim=64, condition=4.0)
BATCH, BATCHES = 256, 300  # ~1.5% sampling error: 6% is four standard errors


class LinRegModel(nn.Module):
    """A plain torch model as the Trainer takes it: keyword inputs, the loss in the output."""

    def __init__(self, task: linreg.LinReg) -> None:
        super().__init__()
        self.task = task
        self.linear = task.model()

    def forward(self, x, labels=None):
        out = self.linear(x)
        return {"loss": self.task.output_loss(out, labels), "logits": out}


def _rows(task: linreg.LinReg, n: int, seed: int = 0) -> list[dict]:
    x, y = task.sample(n, torch.Generator().manual_seed(seed))
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def _args(tmp_path, **kwargs) -> transformers.TrainingArguments:
    options = dict(output_dir=str(tmp_path / "out"), num_train_epochs=1, report_to="none",
                   save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=5,
                   dataloader_num_workers=0, seed=0)
    options.update(kwargs)
    return transformers.TrainingArguments(**options)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_transformers_matches_the_closed_form_truth(tmp_path, accumulate):
    task = linreg.make(TRUTH_OPTIONS, seed=0)
    model = LinRegModel(task)
    truth = task.truth(model.linear)
    # The batch gradient's norm is about sqrt(truth.g2 + tr Sigma / B); clipping at a tenth of
    # it shows that the measurement is taken before the Trainer clips.
    clip = 0.1 * math.sqrt(truth.g2 + truth.trace_sigma / BATCH)
    callback = NoiseScaleCallback(ema_steps=math.inf)
    args = _args(tmp_path, learning_rate=0.0, per_device_train_batch_size=BATCH // accumulate,
                 gradient_accumulation_steps=accumulate, max_grad_norm=clip)
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=_rows(task, BATCH * BATCHES),
                                   callbacks=[callback])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "b_simple" in entry]
    assert len(logged) == BATCHES // 5
    last = logged[-1]
    assert last["b_simple"] == pytest.approx(truth.b_simple, rel=0.06)
    assert last["g2"] == pytest.approx(truth.g2, rel=0.06)
    assert last["trace_sigma"] == pytest.approx(truth.trace_sigma, rel=0.06)


def test_transformers_tiny_gpt2_logs_to_history_and_tensorboard(tmp_path):
    """A tiny GPT-2 built from a config, two micro-batches per step, report_to tensorboard."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (96, 16), generator=generator)
    rows = [{"input_ids": t, "labels": t} for t in tokens]
    args = _args(tmp_path, learning_rate=1e-3, per_device_train_batch_size=8,
                 gradient_accumulation_steps=2, logging_steps=2, report_to="tensorboard")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    NoiseScaleCallback.attach(trainer)  # first, so that report_to integrations see its values
    trainer.train()
    entries = [entry for entry in trainer.state.log_history if "b_simple" in entry]
    assert len(entries) == 3
    # On random tokens |G|^2 is near zero and its window's estimate may be negative: b_simple
    # is then NaN (undetermined, said once), never a negative batch size; positive otherwise.
    for entry in entries:
        determined = entry["g2"] > 0 and entry["trace_sigma"] > 0
        assert entry["b_simple"] > 0 if determined else math.isnan(entry["b_simple"])
    # The Trainer's AdamW: B_simple in its preconditioner, from the two micro-batches; NaN
    # while its window's G^T P G is not resolved above zero (negative here on random tokens),
    # never a negative batch size (before, -4.4e4 was logged as a number).
    precond = [entry["b_simple_precond"] for entry in entries]
    assert all(v > 0 or math.isnan(v) for v in precond)
    events = EventAccumulator(str(next((tmp_path / "out").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert {"train/b_simple", "train/g2", "train/trace_sigma"} <= set(events.Tags()["scalars"])
    assert len(events.Scalars("train/b_simple")) == 3


def test_transformers_b_noise_when_asked(tmp_path):
    task = linreg.make(TRUTH_OPTIONS, seed=0)
    model = LinRegModel(task)
    truth = task.truth(model.linear)
    callback = NoiseScaleCallback(ema_steps=math.inf, hessian_every=1, hessian_microbatches=8)
    args = _args(tmp_path, learning_rate=0.0, per_device_train_batch_size=BATCH)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_rows(task, BATCH * 150),
                                   callbacks=[callback])
    trainer.train()
    last = [entry for entry in trainer.state.log_history if "b_noise" in entry][-1]
    assert last["b_noise"] == pytest.approx(truth.b_noise, rel=0.1)
    assert last["b_simple"] == pytest.approx(truth.b_simple, rel=0.1)


def _gpt2_rows(n: int = 64):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))
    return transformers.GPT2LMHeadModel(config), [{"input_ids": t, "labels": t} for t in tokens]


def test_transformers_bf16_logs_b_simple_with_per_example_norms(tmp_path):
    """bf16 autocast (accelerate returns fp32 logits off the backward path): the hooks sit on
    parameters and layers, so every step is measured; GPT-2's Conv1D, tied and positional
    embeddings have per-example norms, so no accumulation is needed."""
    model, rows = _gpt2_rows()
    args = _args(tmp_path, learning_rate=1e-3, per_device_train_batch_size=8, bf16=True,
                 logging_steps=2)
    callback = NoiseScaleCallback()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   callbacks=[callback])
    trainer.train()
    assert callback.unavailable is None
    entries = [entry for entry in trainer.state.log_history if "b_simple" in entry]
    assert len(entries) == 4 and all(math.isfinite(entry["g2"]) for entry in entries)
    # Random tokens: where the window's |G|^2 is not positive b_simple is NaN, never negative.
    for entry in entries:
        determined = entry["g2"] > 0 and entry["trace_sigma"] > 0
        assert entry["b_simple"] > 0 if determined else math.isnan(entry["b_simple"])
    assert any(entry["b_simple"] > 0 for entry in entries)


def test_transformers_says_once_and_logs_nan_when_it_cannot_measure(tmp_path, caplog):
    """A BatchNorm model with one micro-batch per step: per-example norms are wrong for it and
    there are no micro-batches to measure; the callback says why and logs b_simple NaN."""

    class Bn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

        def forward(self, x, labels=None):
            out = self.net(x).squeeze(-1)
            return {"loss": ((out - labels) ** 2).mean(), "logits": out}

    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    rows = [{"x": x[i], "labels": x[i].sum()} for i in range(32)]
    args = _args(tmp_path, learning_rate=1e-2, per_device_train_batch_size=8, logging_steps=2)
    callback = NoiseScaleCallback()
    trainer = transformers.Trainer(model=Bn(), args=args, train_dataset=rows,
                                   callbacks=[callback])
    with caplog.at_level("ERROR", logger="gnsweep.integrations"):
        trainer.train()
    assert callback.unavailable is not None and "gradient_accumulation_steps" in \
        callback.unavailable
    assert sum("cannot measure" in r.message for r in caplog.records) == 1
    logged = [entry["b_simple"] for entry in trainer.state.log_history if "b_simple" in entry]
    assert len(logged) == 2 and all(math.isnan(v) for v in logged)


@pytest.mark.slow
@pytest.mark.distributed
def test_transformers_under_torchrun_matches_one_process(tmp_path):
    """2 CPU processes under torchrun (DDP, gloo), bf16, two micro-batches per step: each rank's
    gradient is read before the all-reduce; at fixed parameters the pooled B_simple matches one
    process and linreg's closed form (150 steps of 256: ~2% sampling error each)."""
    import json
    import subprocess
    import sys

    script = str(HELPERS / "hf_trainer_ddp.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(*launcher: str) -> dict:
        done = subprocess.run([*launcher, script, "256", "150", str(tmp_path / "out")],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    two = run(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
              "--standalone")
    one = run(sys.executable)
    assert two["unavailable"] is None and one["unavailable"] is None
    assert two["b_simple"] == pytest.approx(one["b_simple"], rel=0.15)
    assert two["b_simple"] == pytest.approx(two["truth"], rel=0.08)
    assert one["b_simple"] == pytest.approx(one["truth"], rel=0.08)


class MarkovGpt(nn.Module):
    """tests/helpers/lm_task.py's nanoGPT-style model (positions wpe(torch.arange(T))) as the
    Trainer takes it."""

    def __init__(self) -> None:
        super().__init__()
        import lm_task

        self.task = lm_task.make(0)
        self.gpt = self.task.model()

    def forward(self, input_ids, labels=None):
        return {"loss": self.task.loss(self.gpt, input_ids)}


def _lm_rows(n: int) -> list[dict]:
    import lm_task

    tokens = lm_task.make(0).sample(n, torch.Generator().manual_seed(0))
    return [{"input_ids": tokens[i]} for i in range(n)]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_transformers_broadcast_positions_are_measured_per_example(tmp_path, accumulate):
    """The positions `wpe(torch.arange(T))` are measured per example (their output expanded
    along the batch): with one micro-batch a step as with two, the callback logs B_simple (NaN
    only at the first log, one measurement in the window at step 1 of two); before, one
    micro-batch a step could not measure."""
    args = _args(tmp_path, learning_rate=1e-3, per_device_train_batch_size=8 // accumulate,
                 gradient_accumulation_steps=accumulate, logging_steps=2)
    callback = NoiseScaleCallback()
    trainer = transformers.Trainer(model=MarkovGpt(), args=args, train_dataset=_lm_rows(64),
                                   callbacks=[callback])
    trainer.train()
    logged = [entry["b_simple"] for entry in trainer.state.log_history if "b_simple" in entry]
    assert callback.unavailable is None
    assert len(logged) > 1 and all(math.isfinite(v) for v in logged[1:])


def test_transformers_examples_give_b_in_tokens(tmp_path):
    """examples= a function of the inputs (16 predicted tokens a sequence): B_simple 16x the
    value in sequences, from the same training (an int: the Lightning test)."""
    logged = {}
    for name, examples in (("sequences", None),
                           ("function", lambda inputs: inputs["input_ids"][:, 1:].numel())):
        args = _args(tmp_path / name, learning_rate=1e-3, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, logging_steps=4)
        callback = NoiseScaleCallback(examples=examples)
        trainer = transformers.Trainer(model=MarkovGpt(), args=args,
                                       train_dataset=_lm_rows(64), callbacks=[callback])
        trainer.train()
        logged[name] = [e["b_simple"] for e in trainer.state.log_history if "b_simple" in e]
    assert logged["sequences"] and all(math.isfinite(v) for v in logged["sequences"])
    assert logged["function"] == pytest.approx([16 * v for v in logged["sequences"]], rel=1e-5)


def test_transformers_inside_a_script_sweep_logs_the_runs_rows_and_stops(tmp_path, monkeypatch):
    """Started by `gnsweep launch task=script` (its GNSWEEP_* environment), the callback writes
    each log entry as the run's row (B_simple included) and ends training on the stop flag."""
    import json

    from gnsweep import paths
    from gnsweep import run_handle as handle

    run_dir = tmp_path / "runs" / "b00032_lr0.05_s0"
    run_dir.mkdir(parents=True)
    for name, value in {"run_dir": run_dir, "batch_size": 32, "learning_rate": 0.05,
                        "max_steps": 1000, "targets": "0.1"}.items():
        monkeypatch.setenv(f"GNSWEEP_{name.upper()}", str(value))
    monkeypatch.setattr(handle, "_current", None)
    task = linreg.make(TRUTH_OPTIONS, seed=0)

    class StopAtTen(transformers.TrainerCallback):  # the sweep's flag, as its runner writes it
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 10:
                (run_dir / paths.SCRIPT_STOP).write_text("stop\n")

    trainer = transformers.Trainer(
        model=LinRegModel(task), args=_args(tmp_path, learning_rate=0.05, logging_steps=1,
                                            per_device_train_batch_size=32),
        train_dataset=_rows(task, 32 * 50), callbacks=[NoiseScaleCallback(), StopAtTen()])
    trainer.train()
    rows = [json.loads(line) for line in (run_dir / paths.SCRIPT_ROWS).read_text().splitlines()
            if line.strip()]
    assert [row["step"] for row in rows] == list(range(1, 11))  # stopped at the flag
    assert all(math.isfinite(row["loss"]) and row["lr"] > 0 for row in rows)
    assert math.isfinite(rows[-1]["b_simple"]) and rows[-1]["b_simple"] > 0


class _TiedLM(nn.Module):
    """An LM whose output layer is the token embedding read functionally (`h @ emb.weight.t()`,
    as several libraries tie weights): the hooks see the embedding's lookup only."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)

    def forward(self, input_ids, labels=None):
        logits = torch.tanh(self.mid(self.emb(input_ids))) @ self.emb.weight.t()
        loss = nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_transformers_functionally_tied_lm_is_measured_or_refused_by_name(tmp_path, caplog,
                                                                          accumulate,
                                                                          monkeypatch):
    """Before, per-example norms missed the tied use and logged a wrong B_simple. Now one
    micro-batch a step: NaN, the error naming emb.weight and gradient_accumulation_steps; two:
    the tied embedding from the micro-batches, a positive B_simple from the second log on."""
    from gnsweep.measure import common

    monkeypatch.setattr(common, "_SAID", set())  # facts said once per process: said here
    torch.manual_seed(0)
    tokens = torch.randint(0, 16, (64, 8), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": t, "labels": t.roll(-1)} for t in tokens]
    args = _args(tmp_path, learning_rate=0.0, per_device_train_batch_size=16 // accumulate,
                 gradient_accumulation_steps=accumulate, logging_steps=1)
    callback = NoiseScaleCallback(ema_steps=math.inf)
    trainer = transformers.Trainer(model=_TiedLM(), args=args, train_dataset=rows,
                                   callbacks=[callback])
    with caplog.at_level("WARNING"):
        trainer.train()
    entries = [entry for entry in trainer.state.log_history if "b_simple" in entry]
    if accumulate == 1:
        assert callback.unavailable is not None
        assert "emb.weight" in callback.unavailable
        assert "gradient_accumulation_steps >= 2" in callback.unavailable
        assert all(math.isnan(entry["b_simple"]) for entry in entries)
    else:
        assert callback.unavailable is None
        assert "emb.weight" in caplog.text  # the split said once, naming the parameter
        # Step 1 found the tied use (not measured), step 2 is the window's one measurement
        # (NaN, said once: no standard error yet), then the ratio of the EMAs.
        assert math.isnan(entries[0]["b_simple"]) and math.isnan(entries[1]["b_simple"])
        assert "until the window holds two measurements" in caplog.text
        assert all(entry["b_simple"] > 0 and entry["b_simple_se"] > 0 for entry in entries[2:])


def test_logged_b_simple_is_nan_while_undetermined(caplog):
    """The callbacks' logged values: a negative |G|^2 estimate or a single measurement gives
    b_simple NaN (never a negative batch size), each reason said once; else the ratio of the
    EMAs with its standard error."""
    from gnsweep.integrations._common import metrics
    from gnsweep.noise import NoiseEstimate

    def estimate(g2: float, se: float) -> NoiseEstimate:
        return NoiseEstimate(1.0, 8.0, 1.0, 1.0, g2, 2.0, g2, 2.0, 2.0 / g2, b_simple_se=se)

    said: set[str] = set()
    with caplog.at_level("WARNING", logger="gnsweep.integrations"):
        negative = [metrics(estimate(-6.28e-5, 1.0), with_b_noise=False, said=said)
                    for _ in range(2)]
        single = metrics(estimate(0.5, math.nan), with_b_noise=False, said=said)
    assert all(math.isnan(m["b_simple"]) and m["g2"] == -6.28e-5 for m in negative)
    assert math.isnan(single["b_simple"]) and single["g2"] == 0.5
    assert caplog.text.count("|G|^2 is -6.28e-05") == 1
    assert caplog.text.count("until the window holds two measurements") == 1
    fine = metrics(estimate(0.5, 0.3), with_b_noise=False, said=said)
    assert fine["b_simple"] == 4.0 and fine["b_simple_se"] == 0.3


def test_a_causal_lms_batch_counts_tokens_by_default(caplog):
    """`examples="tokens"` (the default): token-level labels mark a causal LM, whose B counts
    the attention mask's ones (said once); a classifier's batch counts sequences."""
    from gnsweep.integrations._common import Units

    ids = torch.zeros(4, 8, dtype=torch.long)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[:, 6:] = 0  # two padded positions a sequence
    units = Units("tokens")
    with caplog.at_level("WARNING", logger="gnsweep.integrations"):
        for _ in range(2):
            units.add({"input_ids": ids, "attention_mask": mask, "labels": ids})
    assert units.take() == (48, 6.0)
    assert caplog.text.count("B counts tokens") == 1
    classifier = Units("tokens")
    classifier.add({"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(4)})
    assert classifier.take() == (None, 1.0)
    sequences = Units(None)
    sequences.add({"input_ids": ids, "labels": ids})
    assert sequences.take() == (None, 1.0)


class _Llama(nn.Module):
    """bench.architectures' Llama-style LM (a custom RMSNorm, a broadcast position parameter)
    as the Trainer takes it."""

    def __init__(self) -> None:
        super().__init__()
        from gnsweep.bench.architectures import LlamaLm

        self.lm = LlamaLm()

    def forward(self, input_ids, labels=None):
        from gnsweep.bench.architectures import VOCAB

        logits = self.lm(input_ids)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


def test_transformers_custom_norm_and_broadcast_positions_need_no_accumulation(tmp_path):
    """A custom RMSNorm (by its own forward) and a (1, T, C) position parameter (through its
    expanded view) are per-example: one micro-batch a step measures B_simple, in tokens."""
    from gnsweep.bench.architectures import VOCAB

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (48, 12), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": t, "labels": t.roll(-1)} for t in tokens]
    args = _args(tmp_path, learning_rate=1e-3, per_device_train_batch_size=8, logging_steps=1)
    callback = NoiseScaleCallback()
    trainer = transformers.Trainer(model=_Llama(), args=args, train_dataset=rows,
                                   callbacks=[callback])
    trainer.train()
    assert callback.unavailable is None
    logged = [entry["b_simple"] for entry in trainer.state.log_history if "b_simple" in entry]
    assert len(logged) == 6 and math.isnan(logged[0])  # one measurement: no standard error
    assert all(v > 0 for v in logged[1:])
