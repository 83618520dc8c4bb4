"""Cartpole in the training loop: batches counted in environment steps, the return logged in
the `metric` column and its targets reached upwards, no loss-growth divergence for a metric
task, seeded runs that repeat exactly, and a tiny real sweep from launch to compare."""

from __future__ import annotations

import math

import numpy as np
import pytest
from typer.testing import CliRunner

from gnsweep import store
from gnsweep.cli import app
from gnsweep.config import Config, SweepConfig, TaskConfig
from gnsweep.runs import RunSpec
from gnsweep.train import Diverged, LossWatch, train

pytest.importorskip("gymnasium")


def _config(targets: list[float], max_steps: int, batch: int = 32) -> Config:
    return Config(task=TaskConfig("cartpole"),
                  sweep=SweepConfig(batch_sizes=[batch], learning_rates=[0.004],
                                    targets=targets, max_steps=max_steps, optimizer="adam"))


def _metrics(tmp_path, config: Config, spec: RunSpec):
    result = train(config, spec, tmp_path)
    return result, store.read_table(tmp_path / store.METRICS).to_pandas()


@pytest.mark.parametrize(("batch", "per_step"), [(32, 32), (20, 20), (26, 24), (4, 4)])
def test_examples_count_environment_steps(batch, per_step, tmp_path):
    """B = 26 with 8 steps per update: 3 environments x (26 // 3 = 8) steps = 24 env steps."""
    result, metrics = _metrics(tmp_path, _config([1e9], max_steps=6, batch=batch),
                               RunSpec(batch, 0.004, 0))
    assert (result.steps, result.reason) == (6, "max_steps")
    assert metrics["examples"].tolist() == [per_step * s for s in range(1, 7)]


def test_the_return_is_logged_and_its_largest_target_stops_the_run(tmp_path):
    """The run stops at the first row whose return reaches max(targets), with no overrun."""
    result, metrics = _metrics(tmp_path, _config([10.0, 25.0], max_steps=400),
                               RunSpec(32, 0.004, 0))
    assert (result.state, result.reason) == ("done", "target")
    metric = metrics["metric"].to_numpy()
    assert metric[-1] >= 25.0
    assert not (metric[:-1] >= 25.0).any()  # NaN (no episode ended yet) reaches nothing
    assert np.isnan(metric[0]) and np.isfinite(metric[-1])
    assert len(metrics) == result.steps


def test_a_metric_task_diverges_only_on_a_non_finite_loss():
    watch = LossWatch(ema_examples=1.0, factor=None)
    watch.update(1.0, 1, 1)
    assert watch.update(-50.0, 1, 2) < 0 and watch.update(1e6, 1, 3) > 3  # A2C loss: any sign
    with pytest.raises(Diverged):
        watch.update(math.nan, 1, 4)
    loss_task = LossWatch(ema_examples=1.0, factor=3.0)
    loss_task.update(1.0, 1, 1)
    with pytest.raises(Diverged):
        loss_task.update(1e6, 1, 2)


def test_a_seed_reproduces_the_run(tmp_path):
    config = _config([1e9], max_steps=40)
    runs = [_metrics(tmp_path / str(i), config, RunSpec(32, 0.004, seed))[1]
            for i, seed in enumerate([3, 3, 4])]
    columns = ["loss", "metric", "examples"]
    assert runs[0][columns].equals(runs[1][columns])
    assert not np.allclose(runs[0]["loss"], runs[2]["loss"])


@pytest.mark.slow
def test_a_tiny_cartpole_sweep_from_launch_to_compare(tmp_path):
    runner = CliRunner()
    sweep = tmp_path / "cartpole"
    result = runner.invoke(app, [
        "launch", "task=cartpole", "sweep=cartpole", "sweep.batch_sizes=[16,64,256]",
        "sweep.learning_rates=[0.004,0.008]", "sweep.targets=[25,40]", "sweep.max_steps=300",
        "--sweep-dir", str(sweep), "--workers", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    for path in sweep.glob("runs/*/metrics.parquet"):
        metrics = store.read_table(path).to_pandas()
        assert np.isfinite(metrics["metric"]).any()
    for command in (["analyze"], ["plot"], ["report"]):
        result = runner.invoke(app, [*command, str(sweep)])
        assert result.exit_code == 0, result.output
    steps = store.read_results(sweep).steps
    assert steps["reached"].any()
    html = (sweep / "report.html").read_text()
    assert "At return 40" in html and "target return" in html and "At loss" not in html
    out = tmp_path / "compare"
    result = runner.invoke(app, ["compare", str(sweep), "--out", str(out)])
    assert result.exit_code == 0, result.output
    table = store.read_table(out / store.COMPARE).to_pandas()
    assert set(table["unit"]) == {"environment steps"} and set(table["metric"]) == {"return"}
    assert (out / "bcrit_vs_noise_scale.png").is_file()
