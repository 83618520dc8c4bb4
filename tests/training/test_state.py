"""A run's state (`gnsweep.training.TrainState`) saved at a step boundary and loaded into a
freshly built run continues exactly as the uninterrupted run: every logged number bit for bit.
This is what stopping and resuming a run relies on; a part whose state is missing from
`state_dict()` (the data's generator, the optimizer's momentum, the noise EMAs, the probes'
schedule, the adaptive batch size, the smoothed loss) changes some later row."""

from __future__ import annotations

import io
import itertools
import math
import os
import sys

import numpy as np
import pytest
import torch

from gnsweep.config import Config, NoiseConfig, SweepConfig, TaskConfig, TrainConfig
from gnsweep.runs import RunSpec
from gnsweep.training import StopRequested, TrainState, build_run, run

# Linreg has the exact truth (eval loss, B_simple) logged; Adam and momentum SGD carry optimizer
# state; B_noise every 3 steps and probes at log-spaced points carry their own clocks; the
# adaptive run's batch size and learning rate follow the measured noise scale.
CASES = {
    "grid": (Config(task=TaskConfig(name="linreg", options={"dim": 8}),
                    sweep=SweepConfig(batch_sizes=[16], learning_rates=[0.05], targets=[1e-9],
                                      max_steps=30, eval_every=2),
                    train=TrainConfig(optimizer="adam"),
                    noise=NoiseConfig(hessian_every=3, probe_per_octave=1.0, probe_batches=2,
                                      probe_batch_size=16)),
             RunSpec(batch_size=16, learning_rate=0.05)),
    "adaptive": (Config(task=TaskConfig(name="linreg", options={"dim": 8}),
                        sweep=SweepConfig(batch_sizes=[4, 64], learning_rates=[0.05],
                                          targets=[1e-9], max_steps=30,
                                          schedule="adaptive", exchange_rates=[50],
                                          adaptive_min_change=0.5),
                        train=TrainConfig(optimizer="momentum"),
                        noise=NoiseConfig(method="microbatch", hessian_every=2)),
                 RunSpec(batch_size=0, learning_rate=0.05, exchange_rate=50.0)),
    # The recipe's parts: AdamW with weight decay, warmup then cosine decay (the lr column),
    # clipping (grad_norm), accumulation in pieces that the micro-batch estimate reuses, and
    # fp16's gradient scaler, whose scale (forced high: it skips steps) must be restored.
    "recipe": (Config(task=TaskConfig(name="linreg", options={"dim": 8}),
                      sweep=SweepConfig(batch_sizes=[16], learning_rates=[0.05], targets=[1e-9],
                                        max_steps=30),
                      train=TrainConfig(optimizer="adamw", weight_decay=0.1, warmup_examples=96,
                                        decay="cosine", decay_examples=400, min_lr_ratio=0.1,
                                        grad_clip=0.5, microbatch_size=4, precision="fp16"),
                      noise=NoiseConfig(method="microbatch", hessian_every=3)),
               RunSpec(batch_size=16, learning_rate=0.05)),
    # Micro-batches asked for a batch that cannot be cut: the run falls back to per-example
    # norms at its first step, and so must the run it is resumed into.
    "fallback": (Config(task=TaskConfig("custom", {"_target_": "protocol_tasks.unsplittable"}),
                        sweep=SweepConfig(batch_sizes=[8], learning_rates=[0.05],
                                          targets=[1e-9], max_steps=20),
                        noise=NoiseConfig(method="microbatch")),
                 RunSpec(batch_size=8, learning_rate=0.05)),
    # noise.every=auto: which steps are measured follows the measured spread, so its state
    # (and the weights of the measurements) must be restored.
    "subset": (Config(task=TaskConfig(name="linreg", options={"dim": 8}),
                      sweep=SweepConfig(batch_sizes=[256], learning_rates=[0.05],
                                        targets=[1e-9], max_steps=60),
                      noise=NoiseConfig(every="auto")),
               RunSpec(batch_size=256, learning_rate=0.05)),
    # A Dataset of 100 items, 16 a step: stopped at step 9 in its second epoch (position 44);
    # the eval loss is the mean over its eval_dataset().
    "dataset": (Config(task=TaskConfig("custom", {"_target_": "protocol_tasks.table", "n": 100}),
                       sweep=SweepConfig(batch_sizes=[16], learning_rates=[0.05],
                                         targets=[1e-9], max_steps=30, eval_every=5)),
                RunSpec(batch_size=16, learning_rate=0.05)),
}


def _built(config: Config, spec: RunSpec) -> TrainState:
    """The run at step 0; in fp16 with a loss scale so high that its first steps overflow and
    are skipped (the scaler's state then moves)."""
    state = build_run(config, spec)
    if state.precision.scaler is not None:
        state.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    return state


def _stopped_at(config: Config, spec: RunSpec, step: int) -> TrainState:
    state = _built(config, spec)
    with pytest.raises(StopRequested):
        run(state, should_stop=lambda: state.step >= step)
    assert state.step == step
    return state


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_resumed_from_its_state_logs_the_same_rows_bit_for_bit(case, monkeypatch):
    torch.set_num_threads(1)
    # The custom-task resolver puts the cwd on sys.path and PYTHONPATH: undone after.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    config, spec = CASES[case]
    whole = _built(config, spec)
    result = run(whole)
    assert result.reason == "max_steps" and result.steps == config.sweep.max_steps

    saved = io.BytesIO()
    stopped = _stopped_at(config, spec, 9)
    saved_cpu = stopped.cpu_elapsed
    torch.save(stopped.state_dict(), saved)
    saved.seek(0)
    resumed = _built(config, spec)
    # Only tensors, numbers, strings and containers: what a checkpoint can load safely.
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    assert resumed.step == 9 and len(resumed.rows["step"]) == 9
    run(resumed)

    assert resumed.step == whole.step == config.sweep.max_steps
    assert set(resumed.rows) == set(whole.rows)
    for name, values in whole.rows.items():
        if name == "wall_time":
            continue
        # Bit for bit (NaN where neither run measured).
        np.testing.assert_array_equal(np.asarray(resumed.rows[name], float),
                                      np.asarray(values, float), err_msg=name)
    measured = ("loss", "b_simple", "lr", "batch_size", "grad_norm") + (
        ("b_noise",) if case not in ("fallback", "dataset", "subset") else ())
    for name in measured:
        assert all(math.isfinite(v) for v in whole.rows[name][9:]), name
    assert resumed.monitor.method == whole.monitor.method
    if case == "fallback":
        assert whole.monitor.method == "per_example"
    elif case == "recipe":
        assert whole.rows["skipped_steps"][-1] > 0
        # Up over the warmup's 6 steps (96 examples), then down to 0.1 x 0.05 at 400 examples.
        lr = whole.rows["lr"]
        assert lr[5] == max(lr) == pytest.approx(0.05) and lr[-1] == pytest.approx(0.005)
    elif case == "grid":
        assert np.isfinite(whole.rows["probe_g2"]).sum() >= 3  # probes due after the resume
        assert np.isfinite(whole.rows["eval_loss"]).sum() == 15
    elif case == "subset":
        # Some steps after the resume were left out, and the same ones in both runs.
        assert resumed.monitor.schedule.measured == whole.monitor.schedule.measured < 60
    elif case == "dataset":
        assert resumed.data.state_dict() == {"epoch": 4, "position": 80}  # 480 draws of 100
        # Passes over the data at each step: 16 items a step of 100.
        np.testing.assert_allclose(whole.rows["epoch"], np.arange(1, 31) * 16 / 100)
        assert np.isfinite(whole.rows["eval_loss"]).sum() == 6
    else:
        assert len(set(whole.rows["batch_size"])) > 1  # the size moved with the estimate
    wall = resumed.rows["wall_time"]
    assert all(b >= a for a, b in itertools.pairwise(wall))  # the clock goes on
    # The compute goes on too: the resumed run's CPU seconds hold the first part's.
    assert resumed.cpu_elapsed > saved_cpu > 0 and result.train_cpu_seconds > 0


def test_a_state_of_another_run_is_refused():
    """A state saved with one noise method does not load into a monitor of another."""
    grid_config, grid_spec = CASES["grid"]
    adaptive_config, adaptive_spec = CASES["adaptive"]
    state = build_run(adaptive_config, adaptive_spec).state_dict()
    with pytest.raises(ValueError, match="method"):
        build_run(grid_config, grid_spec).monitor.load_state_dict(state["monitor"])
