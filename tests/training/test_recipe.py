"""The training recipe (`config.train`): the learning-rate column against the schedule's
formulas at every step, clipping, weight decay, gradient accumulation against whole batches,
bf16 and fp16 against fp32, and the noise scale measured on unclipped, unscaled gradients."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from locations import HELPERS, ROOT
from typer.testing import CliRunner

from gnsweep.analysis.recipe_warnings import recipe_warnings
from gnsweep.cli import app
from gnsweep.config import Config, NoiseConfig, SweepConfig, TaskConfig, TrainConfig
from gnsweep.runs import RunSpec
from gnsweep.training import TrainState, build_run, run
from gnsweep.training.recipe import clip_gradients


def _run(task: TaskConfig, batch: int, lr: float, steps: int, train: TrainConfig,
         noise: NoiseConfig | None = None, **sweep) -> TrainState:
    torch.set_num_threads(1)
    config = Config(task=task, sweep=SweepConfig(batch_sizes=[batch], learning_rates=[lr],
                                                  targets=[1e-9], max_steps=steps, **sweep),
                    train=train, noise=noise or NoiseConfig())
    state = build_run(config, RunSpec(batch_size=batch, learning_rate=lr))
    run(state)
    return state


LINREG = TaskConfig("linreg", {"dim": 4})


# ---- the learning-rate schedule: the logged rate is the formula at every step ------------------


def _cosine(p: float, r: float) -> float:
    return r + (1 - r) * (1 + math.cos(math.pi * p)) / 2


# The formulas written out per case, as a function of the step s (1, 2, ...) and the examples
# e = 8 s after it (batch 8), peak 0.1; 40 steps.
SCHEDULES = {
    "warmup_steps": (TrainConfig(warmup_steps=10), {},
                     lambda s, e: min(1, s / 10)),
    "warmup_examples_cosine": (
        TrainConfig(warmup_examples=100, decay="cosine", decay_examples=260, min_lr_ratio=0.1),
        {}, lambda s, e: min(1, e / 100) * _cosine(min(1, max(0, (e - 100) / 160)), 0.1)),
    # No horizon given: the step budget (40 steps), decay from the end of a 5-step warmup.
    "warmup_steps_linear": (
        TrainConfig(warmup_steps=5, decay="linear"), {},
        lambda s, e: min(1, s / 5) * (1 - max(0, (s - 5) / 35))),
    # An example budget is the horizon; two drops by sqrt(0.01) at 1/3 and 2/3 of it.
    "step": (TrainConfig(decay="step", min_lr_ratio=0.01), {"max_examples": 240},
             lambda s, e: 1 if e < 80 else 0.1 if e < 160 else 0.01),
    # Warmup in steps, decay in examples: the decay starts where the warmup ends (4 x 8).
    "mixed_units": (TrainConfig(warmup_steps=4, decay="cosine", decay_examples=272), {},
                    lambda s, e: min(1, s / 4) * _cosine(min(1, max(0, (e - 32) / 240)), 0)),
}


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_the_lr_column_is_the_schedules_formula_at_every_step(case):
    train, sweep, formula = SCHEDULES[case]
    state = _run(LINREG, 8, 0.1, 40, train, **sweep)
    steps = np.asarray(state.rows["step"])
    examples = np.asarray(state.rows["examples"])
    assert len(steps) == 30 if case == "step" else 40
    expected = [0.1 * formula(s, e) for s, e in zip(steps, examples, strict=True)]
    np.testing.assert_allclose(state.rows["lr"], expected, rtol=1e-12, atol=1e-15)


# ---- clipping and weight decay -----------------------------------------------------------------


def test_clipping_scales_the_gradient_to_the_norm_and_returns_the_norm_before():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_gradients([a, b], 1.0) == pytest.approx(5.0)
    torch.testing.assert_close(a.grad, torch.tensor([0.6, 0.0]))
    torch.testing.assert_close(b.grad, torch.tensor([0.8]))
    assert clip_gradients([a, b], 2.0) == pytest.approx(1.0)  # below the bound: untouched
    torch.testing.assert_close(b.grad, torch.tensor([0.8]))


def test_a_clipped_run_logs_the_unclipped_norm_and_measures_the_unclipped_noise():
    plain = _run(LINREG, 16, 0.1, 3, TrainConfig())
    clipped = _run(LINREG, 16, 0.1, 3, TrainConfig(grad_clip=1e-3))
    # Step 1 starts from the same parameters and batch: the same gradient before clipping.
    assert clipped.rows["grad_norm"][0] == pytest.approx(plain.rows["grad_norm"][0], rel=1e-6)
    assert clipped.rows["grad_norm"][0] > 1e-3
    for name in ("g2_step", "trace_sigma_step", "b_simple"):
        assert clipped.rows[name][0] == pytest.approx(plain.rows[name][0], rel=1e-6), name
    # ...and the clipped step moved the parameters by lr x 1e-3 at most.
    fresh = build_run(clipped.config, clipped.spec)
    moved = sum(float((p - q).detach().norm() ** 2) for p, q in zip(
        _after_one_step(clipped.config, clipped.spec).parameters(), fresh.model.parameters(),
        strict=True)) ** 0.5
    assert moved == pytest.approx(0.1 * 1e-3, rel=1e-4)


def _after_one_step(config: Config, spec: RunSpec) -> torch.nn.Module:
    one = Config(task=config.task, sweep=SweepConfig(
        batch_sizes=config.sweep.batch_sizes, learning_rates=config.sweep.learning_rates,
        targets=[1e-9], max_steps=1), train=config.train)
    state = build_run(one, spec)
    run(state)
    return state.model


# ---- accumulation: pieces of at most microbatch_size samples ----------------------------------


DIGITS = TaskConfig("digits")


def test_accumulation_in_four_pieces_logs_the_whole_batch_losses():
    # auto measures from the pieces (`ride_accumulation`): the same as a whole batch split
    # into 4 micro-batches only to measure.
    whole = _run(DIGITS, 64, 0.4, 50, TrainConfig(), NoiseConfig(method="microbatch"))
    pieces = _run(DIGITS, 64, 0.4, 50, TrainConfig(microbatch_size=16))
    assert pieces.monitor.method == "microbatch"
    np.testing.assert_allclose(pieces.rows["loss"], whole.rows["loss"], rtol=1e-5)
    np.testing.assert_allclose(pieces.rows["b_simple"], whole.rows["b_simple"], rtol=1e-3)


def test_the_micro_batch_noise_estimate_reuses_the_pieces_and_matches_linregs_closed_form():
    # At (nearly) fixed parameters: a tiny rate; a plain mean of the measurements (ema_steps
    # far beyond the run). noise.microbatches=2 would give b_small 32: the pieces give 16.
    state = _run(TaskConfig("linreg", {"dim": 8}), 64, 1e-7, 300,
                 TrainConfig(microbatch_size=16),
                 NoiseConfig(method="microbatch", microbatches=2, ema_fraction=0.0,
                             ema_steps=1e9))
    assert set(state.rows["b_small"]) == {16.0} and set(state.rows["b_big"]) == {64.0}
    assert state.rows["b_simple"][-1] == pytest.approx(state.rows["b_simple_true"][-1], rel=0.1)


def test_auto_rides_the_accumulation_pieces_and_matches_linregs_closed_form():
    # A step cut into pieces by train.microbatch_size: method auto measures from them from the
    # first step (no per-example hooks), b_small the piece; nearly fixed parameters and a
    # plain mean of the measurements, against the closed form at the run's parameters.
    state = _run(TaskConfig("linreg", {"dim": 8}), 64, 1e-7, 300,
                 TrainConfig(microbatch_size=16), NoiseConfig(ema_fraction=0.0, ema_steps=1e9))
    assert state.monitor.choice is not None
    assert state.monitor.choice["method"] == "microbatch"
    assert "train.microbatch_size=16" in state.monitor.choice["reason"]
    assert set(state.rows["b_small"]) == {16.0} and set(state.rows["b_big"]) == {64.0}
    assert state.rows["b_simple"][-1] == pytest.approx(state.rows["b_simple_true"][-1], rel=0.1)


@pytest.mark.distributed
def test_accumulation_under_two_ddp_processes_logs_the_whole_batch_losses(tmp_path):
    out = tmp_path / "losses.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(HELPERS / "ddp_accumulation.py"), str(out)],
                          env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads(out.read_text())
    assert len(losses["whole"]) == 50
    np.testing.assert_allclose(losses["pieces"], losses["whole"], rtol=1e-5)


# ---- precision -------------------------------------------------------------------------------


def test_bf16_reaches_the_digits_targets_and_measures_b_simple_as_fp32_does():
    config = Config(task=DIGITS, sweep=SweepConfig(batch_sizes=[64], learning_rates=[0.8],
                                                    targets=[0.3, 0.1], max_steps=600),
                    train=TrainConfig(precision="bf16"))
    state = build_run(config, RunSpec(batch_size=64, learning_rate=0.8))
    assert run(state).reason == "target"
    # B_simple at fixed parameters (a tiny rate, a plain mean of 100 steps' measurements).
    noise = NoiseConfig(ema_fraction=0.0, ema_steps=1e9)
    b16 = _run(DIGITS, 64, 1e-9, 100, TrainConfig(precision="bf16"), noise)
    b32 = _run(DIGITS, 64, 1e-9, 100, TrainConfig(), noise)
    assert b16.rows["b_simple"][-1] == pytest.approx(b32.rows["b_simple"][-1], rel=0.1)
    assert b16.rows["loss"][0] != b32.rows["loss"][0]  # bf16 did round the forward pass


def test_fp16_skips_overflowed_steps_uncounted_and_measures_unscaled_gradients():
    config = Config(task=DIGITS, sweep=SweepConfig(batch_sizes=[32], learning_rates=[0.4],
                                                    targets=[1e-9], max_steps=20),
                    train=TrainConfig(precision="fp16", microbatch_size=8),
                    noise=NoiseConfig(method="microbatch"))
    state = build_run(config, RunSpec(batch_size=32, learning_rate=0.4))
    # A loss scale of 2^40 overflows fp16's gradients (max 65504): the scaler halves it each
    # skipped step until they fit.
    assert state.precision.scaler is not None
    state.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    run(state)
    steps, skipped = state.rows["step"], state.rows["skipped_steps"]
    assert steps == list(range(1, 21))  # every logged row an optimizer step
    # At least the 2^40 -> 2^16 skips before step 1 (fp16's range), more where it overflows
    # later; the scale halved once per skip (it grows only after 2000 clean steps).
    assert skipped[0] >= 20 and all(b >= a for a, b in itertools.pairwise(skipped))
    assert state.rows["examples"][-1] == 20 * 32  # skipped steps' examples do not count
    assert state.precision.loss_scale == 2.0 ** (40 - skipped[-1])
    fp32 = _run(DIGITS, 32, 0.4, 1, TrainConfig(microbatch_size=8),
                NoiseConfig(method="microbatch"))
    # The first counted step is the fp32 run's first (no update before it), measured after
    # dividing out the loss scale: |G|^2 agrees to fp16's rounding, not 2^50 apart.
    assert state.rows["g2_step"][0] == pytest.approx(fp32.rows["g2_step"][0], rel=0.05)
    assert state.rows["grad_norm"][0] == pytest.approx(fp32.rows["grad_norm"][0], rel=0.05)


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("override, says", [
    ("train.warmup_steps=10", "both set"),
    ("train.grad_clip=-1", "train.grad_clip"),
    ("train.microbatch_size=-1", "train.microbatch_size"),
    ("train.precision=fp64", "train.precision"),
])
def test_bad_recipe_settings_are_one_line_and_exit_2_with_nothing_run(tmp_path, override, says):
    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, ["launch", "sweep=tiny", "train.warmup_examples=100",
                                      override, "--sweep-dir", str(out), "-q"])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()


# ---- the analysis says where the schedule, not the batch size, decides --------------------------


def _tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    fits = pd.DataFrame({"target": [0.5, 0.2], "s_min": [20.0, 60.0], "e_min": [400.0, 3000.0]})
    front = pd.DataFrame({"target": [0.5, 0.5, 0.2, 0.2], "batch_size": [8, 128, 8, 128],
                          "steps": [70, 24, 400, 80], "examples": [560, 3072, 3200, 10240]})
    return fits, front


@pytest.mark.parametrize("train, expected", [
    # S_min 20 < 30 steps at 0.5; at 0.2 S_min is 60, but no best run reached it in 30 steps.
    (TrainConfig(warmup_steps=30), ["target 0.5: S_min 20 steps falls inside the warmup"]),
    # E_min 400 < 500 at 0.5; at 0.2 none of the best runs had seen <= 500 examples.
    (TrainConfig(warmup_examples=500), ["target 0.5: E_min 400 examples falls inside"]),
    # Shorter than every E_min and every best run's examples: nothing to say.
    (TrainConfig(warmup_examples=350), []),
    # No fit at 0.5 (refused: NaN): the best runs inside the warmup are named instead.
    (TrainConfig(warmup_steps=25), ["target 0.5: reached inside the warmup (25 steps) at batch "
                                    "sizes 128"]),
    (TrainConfig(decay="cosine", decay_examples=5000),
     ["target 0.2: reached after the decay's horizon (train.decay_examples=5000) at batch sizes "
      "128"]),
    (TrainConfig(decay="cosine"), []),  # the budget is the horizon: no run passes it
])
def test_recipe_warnings_per_target(train, expected):
    fits, front = _tables()
    if train.warmup_steps == 25:
        fits.loc[0, ["s_min", "e_min"]] = math.nan
    warnings = recipe_warnings(Config(train=train), fits, front)
    assert len(warnings) == len(expected)
    for warning, start in zip(warnings, expected, strict=True):
        assert warning.startswith(start), warning


def test_analyze_warns_when_s_min_falls_inside_the_warmup(tiny_sweep):
    # The tiny sweep's folder, read as if trained with a 1000-step warmup: every target's S_min
    # is far below it, and analyze and the report's warnings say so.
    config = yaml.safe_load((tiny_sweep / "config.yaml").read_text())
    config["train"] = {**config.get("train", {}), "warmup_steps": 1000}
    (tiny_sweep / "config.yaml").write_text(yaml.safe_dump(config))
    for path in (tiny_sweep / "runs").glob("*/config.json"):  # runs agree with their sweep
        record = json.loads(path.read_text())
        record["config"]["train"]["warmup_steps"] = 1000
        path.write_text(json.dumps(record))
    result = CliRunner().invoke(app, ["analyze", str(tiny_sweep)])
    assert result.exit_code == 0, result.output
    fits = json.loads((tiny_sweep / "fits.json").read_text())
    inside = [w for w in fits["warnings"] if "falls inside the warmup (1000 steps)" in w]
    assert len(inside) == len(config["sweep"]["targets"])


def test_the_recipe_bench_prints_both_ratios(monkeypatch, capsys):
    from gnsweep.bench import recipe as bench

    monkeypatch.setattr(bench, "BATCH_SIZES", (32,))
    result = bench.main(["--quick"])
    row = result["rows"][0]
    assert row["batch"] == 32 and row["pieces"] > 0 and row["bf16"] > 0
    assert "pieces" in capsys.readouterr().out


def test_a_run_takes_the_gpu_of_its_local_rank_when_cuda_is_present(monkeypatch):
    from gnsweep.training import placement

    # No GPU on this machine: CUDA's presence is the one thing faked.
    assert placement() == (1, 0, torch.device("cpu")) or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert placement() == (1, 0, torch.device("cuda", 1))


def test_auto_measures_what_per_example_norms_miss_on_the_pieces_with_no_extra_pass(
        monkeypatch):
    # With train.microbatch_size, noise.method=auto measures on the accumulation pieces (4 of
    # 8), not a second split into noise.microbatches: 4 forward passes a step, and the estimate
    # of the 4-way split.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    task = TaskConfig("custom", {"_target_": "protocol_tasks.uncovered"})
    forwards: list[int] = []
    original = build_run

    def counting(config: Config, spec: RunSpec) -> TrainState:
        state = original(config, spec)
        state.model.register_forward_hook(lambda *_: forwards.append(1))
        return state

    monkeypatch.setattr(sys.modules[__name__], "build_run", counting)
    pieces = _run(task, 32, 0.05, 10, TrainConfig(microbatch_size=8),
                  NoiseConfig(microbatches=2))
    # 4 a step, and no per-example hooks (nor their layout check's forward).
    assert len(forwards) == 4 * 10
    split = _run(task, 32, 0.05, 10, TrainConfig(),
                 NoiseConfig(method="microbatch", microbatches=4))
    np.testing.assert_allclose(pieces.rows["b_simple"], split.rows["b_simple"], rtol=1e-6)
    assert all(math.isfinite(b) for b in pieces.rows["b_simple"])
    # ...which is not what a 2-way split measures: the pieces, not noise.microbatches, count.
    halves = _run(task, 32, 0.05, 10, TrainConfig(),
                  NoiseConfig(method="microbatch", microbatches=2))
    assert not np.allclose(halves.rows["b_simple"], split.rows["b_simple"], rtol=1e-3)
