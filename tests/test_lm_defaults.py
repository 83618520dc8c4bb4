"""A nanoGPT-style LM (tests/lm_task.py: positions as `wpe(torch.arange(T))`, tied embeddings, B
in tokens) with gnsweep's defaults: the noise scale is measured on nearly every step, the
method used is recorded, and a run whose B_simple is missing is said, never passed in silence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lm_task
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from gnsweep.cli import app
from gnsweep.measure import NoiseScaleMonitor, measure_noise_scale

runner = CliRunner()
# Plain SGD: with Adam a measured step also comes in micro-batches (for B_simple_P), and at 4
# sequences those are single sequences, whose positions per-example norms do see whole.
LM = ["task=custom", "task._target_=lm_task.make", "sweep.learning_rates=[0.003]",
      "sweep.targets=[1.6,1.4]"]


def _status(run_dir) -> dict:
    return json.loads((run_dir / "status.json").read_text())


@pytest.mark.slow
def test_auto_measures_the_lm_with_broadcast_positions(tmp_path):
    # B=4 sequences: the positions' output (16, 32) lacks the batch (NaN on every step before,
    # then micro-batches); B=16 = T: shapes alone took positions for examples (wrong numbers
    # before).
    import pandas as pd

    result = runner.invoke(app, ["launch", "-q", *LM, "sweep.batch_sizes=[4,16]",
                                 "sweep.max_steps=30", "--sweep-dir", str(tmp_path / "lm")])
    assert result.exit_code == 0, result.output
    assert "B_simple is NaN" not in result.output
    for run in ("b00004_lr0.003_s0", "b00016_lr0.003_s0"):
        run_dir = tmp_path / "lm" / "runs" / run
        b_simple = pd.read_parquet(run_dir / "metrics.parquet")["b_simple"].to_numpy()
        finite = sum(math.isfinite(v) for v in b_simple) / len(b_simple)
        assert finite >= 0.9, (run, finite)
        status = _status(run_dir)
        # Per-example norms see the positions (their output expanded along the batch): the
        # sweep's timed choice keeps the cheaper method, never refused for the positions.
        assert status["noise_method"]["method"] in ("per_example", "microbatch")
        assert "cannot attribute" not in status["noise_method"]["reason"]
        assert status["b_simple_nan_share"] <= 0.1


@pytest.mark.slow
def test_explicit_per_example_is_accepted_at_launch(tmp_path):
    """Before, per_example was refused here (the positions lack the batch dimension); now the
    positions are measured per example through their output expanded along the batch."""
    result = runner.invoke(app, ["launch", "-q", *LM, "sweep.batch_sizes=[4]",
                                 "sweep.max_steps=3", "noise.method=per_example",
                                 "--sweep-dir", str(tmp_path / "x")])
    assert result.exit_code == 0, result.output
    assert "cannot attribute" not in result.output


def _one_step(monitor: NoiseScaleMonitor, task, model, batch, pieces: int) -> None:
    model.zero_grad(set_to_none=True)
    for part in batch.chunk(pieces):
        (task.loss(model, part) * (len(part) / len(batch))).backward()
        monitor.accumulate()
    monitor.step()


@pytest.mark.parametrize("method", ["auto", "per_example"])
@pytest.mark.parametrize("sequences", [8, 16])
def test_monitor_in_a_plain_loop_measures_the_positions_per_example(method, sequences):
    """Own loop, one backward a step: the positions `wpe(torch.arange(T))` (T = 16) are measured
    per example, with 8 sequences and with as many as positions (T = B, where shapes alone took
    positions for examples): B_simple equals micro-batches of one sequence each (per-example
    gradients themselves) at the same parameters; before, auto switched to micro-batches and
    an explicit per_example raised."""
    torch.manual_seed(0)
    task = lm_task.make(0)
    model = task.model()
    batches = [task.sample(sequences, torch.Generator().manual_seed(s)) for s in range(3)]
    monitor = NoiseScaleMonitor(model, method, ema_steps=math.inf)
    for batch in batches:
        _one_step(monitor, task, model, batch, 1)
    monitor.close()
    assert monitor.method == "per_example" and not monitor.needs_microbatches
    assert "wpe" in monitor.sources[0].describe()
    expected = measure_noise_scale(model, None, batches, method="microbatch",
                                   microbatches=sequences, task_loss=task.loss)
    assert monitor.b_simple == pytest.approx(expected.b_simple, rel=1e-4)


@pytest.mark.slow
def test_a_run_without_b_simple_is_said_by_launch_and_status(tmp_path):
    # One sample a step: no spread to measure, B_simple NaN on every step.
    sweep = tmp_path / "one"
    result = runner.invoke(app, ["launch", "-q", "task=custom", "task._target_=protocol_tasks.make",
                                 "sweep.batch_sizes=[1]", "sweep.learning_rates=[0.1]",
                                 "sweep.targets=[0.5]", "sweep.max_steps=10",
                                 "--sweep-dir", str(sweep)])
    assert result.exit_code == 0, result.output
    line = "B_simple is NaN on more than 10% of the steps of 1 run(s): b00001_lr0.1_s0 (100%)"
    assert line in result.output
    assert _status(sweep / "runs" / "b00001_lr0.1_s0")["b_simple_nan_share"] == 1.0
    shown = runner.invoke(app, ["status", str(sweep)])
    assert shown.exit_code == 0 and line in shown.output
    # The raw loss: ten one-sample steps never fill the smoothing window, so a smoothed reach
    # would not be counted at all.
    analyzed = runner.invoke(app, ["analyze", str(sweep), "--targets", "10", "--loss", "raw"])
    assert analyzed.exit_code == 0, analyzed.output
    assert line in analyzed.output  # among the warnings, which the report shows too


# -- one meaning per window, whatever the unit -------------------------------------------------


def _curves(batch_sizes: list[int], samples: list[int], loss: np.ndarray):
    import pandas as pd

    from gnsweep.analysis.steps import curves_from_frames

    runs = pd.DataFrame({"run_id": [f"r{i}" for i in range(len(batch_sizes))],
                         "batch_size": batch_sizes, "learning_rate": 0.1, "seed": 0,
                         "state": "done", "samples": samples})
    steps = np.arange(1, len(loss) + 1)
    metrics = pd.concat([pd.DataFrame({"run_id": f"r{i}", "step": steps, "loss": loss,
                                       "examples": steps * b})
                         for i, b in enumerate(batch_sizes)])
    return curves_from_frames(runs, metrics)


def test_the_smoothing_window_is_the_same_training_in_tokens_and_in_examples():
    """4 samples a step, counted as 4 examples or as 64 tokens (16 a sample): the same loss
    curve reaches each target at the same step. (The smallest window was 64 of the unit: 16
    steps in examples, 1 step in tokens.)"""
    from gnsweep.analysis.steps import steps_to_target

    rng = np.random.default_rng(0)
    x = np.arange(200)
    loss = 2.0 * np.exp(-x / 40) + 0.5 + 0.15 * rng.standard_normal(len(x))
    curves = _curves([4, 64], [4, 4], loss)
    table = steps_to_target(curves, None, [1.5, 1.0, 0.8])
    for target, rows in table.groupby("target"):
        examples, tokens = rows.sort_values("batch_size")["steps"].to_numpy()
        assert examples == pytest.approx(tokens, rel=1e-9), target
        assert tokens * 64 == pytest.approx(rows["examples"].max())


def test_a_target_is_never_reached_in_the_first_step():
    """Below the target after one update (interpolation put it at 0.95 steps), or before any
    (0 steps, log S infinite): one step, the least a run takes."""
    from gnsweep.analysis.steps import steps_to_target

    loss = np.array([3.0, 0.9, 0.95, 0.92, 0.9, 0.88, 0.87, 0.86])
    table = steps_to_target(_curves([8], [8], loss), None, [5.0, 1.0], loss="raw")
    assert table["reached"].all()
    assert table["steps"].tolist() == [1.0, 1.0]


def test_the_default_loss_ema_means_samples_in_any_unit():
    from gnsweep.compose import compose, in_task_units

    grid = ["task=custom", "task._target_=lm_task.make", "sweep.batch_sizes=[4]",
            "sweep.learning_rates=[0.1]", "sweep.targets=[1]"]
    config = compose(grid)
    assert in_task_units(config, 16.0, grid).sweep.loss_ema_examples == 128 * 16
    assert in_task_units(config, 1.0, grid).sweep.loss_ema_examples == 128
    given = [*grid, "sweep.loss_ema_examples=512"]
    assert in_task_units(compose(given), 16.0, given).sweep.loss_ema_examples == 512


# -- defaults that do not surprise --------------------------------------------------------------


def test_a_custom_sweep_is_named_after_its_task(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["launch", "--dry-run", *LM, "sweep.batch_sizes=[4]"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("sweep lm_task.make: task lm_task.make")
    assert f"-> {Path('runs') / 'lm_task.make'}" in result.output


@pytest.mark.slow
def test_launch_says_where_max_steps_binds_and_dry_run_lists_states(tmp_path):
    sweep = tmp_path / "tok"
    # 3 tokens a sample: 5 steps x 2 x 3 = 30 < 100 tokens, 5 x 8 x 3 = 120 >= 100.
    grid = ["task=custom", "task._target_=protocol_tasks.tokens", "sweep.learning_rates=[0.1]",
            "sweep.targets=[0.01]", "sweep.max_steps=5", "sweep.max_examples=100",
            "--sweep-dir", str(sweep)]
    result = runner.invoke(app, ["launch", "-q", *grid, "sweep.batch_sizes=[2,8]"])
    assert result.exit_code == 0, result.output
    assert ("note: sweep.max_steps=5 ends runs at batch sizes 2 before sweep.max_examples=100"
            in result.output)
    shown = runner.invoke(app, ["launch", "--dry-run", *grid, "sweep.batch_sizes=[2,8,32]"])
    assert shown.exit_code == 0, shown.output
    states = {line.split()[0]: line.split()[-1] for line in shown.output.splitlines()
              if line.startswith("b0")}
    assert states == {"b00002_lr0.1_s0": "done", "b00008_lr0.1_s0": "done",
                      "b00032_lr0.1_s0": "pending"}
    assert "3 runs: 2 done, 1 pending" in shown.output
