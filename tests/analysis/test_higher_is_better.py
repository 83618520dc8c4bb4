"""Targets in either direction: a metric that rises to its targets (cartpole's return).

Ground truth by construction: at the best learning rate the metric rises linearly,
m = u / (a + c/B) after u updates, so it first reaches a target T after S = T (a + c/B) =
S_min + E_min/B updates with S_min = a T and E_min = c T (eq. 2.11); the row logged at step s
holds the metric measured before update s (u = s - 1), as the training loop logs it; B_crit = c / a
(eq. 2.12) at every target. Other learning rates rise 1.3x slower; one run diverges.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from gnsweep import paths, store, tasks
from gnsweep.analysis.pipeline import analyze_tables
from gnsweep.analysis.steps import steps_to_target
from gnsweep.cli import app
from gnsweep.folder import read_results
from gnsweep.targets import FALLING, RISING

A, C = 2.0, 400.0
B_CRIT = C / A
BATCHES = [16, 32, 64, 128, 256, 512, 1024]
LRS = [0.5, 1.0, 2.0]
TARGETS = [50.0, 100.0, 200.0]
WARMUP = 5
"""Steps before the first episode ends: the metric is NaN there."""


def _state(batch: int, lr: float) -> str:
    return "diverged" if (batch, lr) == (16, 2.0) else "done"


def _curve(batch: int, lr: float) -> pd.DataFrame:
    rate = 1.0 / (A + C / batch) / (1.0 if lr == 1.0 else 1.3)
    last = math.ceil(max(TARGETS) / rate) + 2
    step = np.arange(1, last + 1)
    metric = np.where(step <= WARMUP, np.nan, (step - 1) * rate)
    return pd.DataFrame({"step": step, "metric": metric, "loss": 1.0 / step,
                         "loss_smooth": 1.0 / step, "b_simple": B_CRIT})


def _tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    runs, metrics = [], []
    for batch in BATCHES:
        for lr in LRS:
            run_id = f"b{batch:05d}_lr{lr:g}_s0"
            runs.append({"run_id": run_id, "batch_size": batch, "learning_rate": lr, "seed": 0,
                         "state": _state(batch, lr)})
            metrics.append(_curve(batch, lr).assign(run_id=run_id))
    return pd.DataFrame(runs), pd.concat(metrics, ignore_index=True)


def _check_fits(fits: pd.DataFrame) -> None:
    assert sorted(fits["target"]) == TARGETS
    for fit in fits.itertuples(index=False):
        assert fit.refused == ""
        # Step counts are whole steps (up to one step late): a relative error below 1%.
        assert fit.b_crit == pytest.approx(B_CRIT, rel=0.01)
        assert fit.s_min == pytest.approx(A * fit.target, rel=0.02)
        assert fit.e_min == pytest.approx(C * fit.target, rel=0.01)
        assert fit.ratio == pytest.approx(1.0, rel=0.01)


def test_rising_metric_recovers_the_hyperbola():
    runs, metrics = _tables()
    analysis = analyze_tables(runs, metrics, TARGETS, loss="metric", direction=RISING)
    _check_fits(analysis.fits)
    steps = analysis.steps
    best = steps[(steps["learning_rate"] == 1.0) & (steps["batch_size"] == 64)]
    for row in best.itertuples(index=False):
        # Interpolated between logged rows: exact on a straight line.
        assert row.steps == pytest.approx(row.target * (A + C / 64))
    # The best value reached is the metric's largest, not its smallest.
    run = steps[steps["run_id"] == "b00064_lr1_s0"].iloc[0]
    assert run["min_loss"] == pytest.approx(metrics.loc[metrics["run_id"] == run["run_id"],
                                                        "metric"].max())
    assert not steps.loc[steps["state"] == "diverged", "reached"].any()


def test_direction_matters():
    """Read as a loss, the same rising curve is 'below' every target at its first value."""
    runs, metrics = _tables()
    steps = steps_to_target(metrics, runs, TARGETS, loss="metric")
    reached = steps[steps["reached"]]
    # The first logged value (row WARMUP + 1, measured after WARMUP updates) 'reaches' them all.
    assert (reached["steps"] == WARMUP).all()


def _write_sweep(folder) -> None:
    from gnsweep.config import Config

    runs, metrics = _tables()
    config = Config.from_dict({"task": {"name": "cartpole"},
                               "sweep": {"name": "uphill", "batch_sizes": BATCHES,
                                         "learning_rates": LRS, "targets": TARGETS}})
    store.write_text(folder / paths.SWEEP_CONFIG, yaml.safe_dump(config.to_dict()))
    for run in runs.itertuples(index=False):
        path = paths.run_dir(folder, run.run_id)
        store.write_json(path / paths.RUN_CONFIG, {"run": {
            "batch_size": run.batch_size, "learning_rate": run.learning_rate, "seed": 0}})
        store.write_status(path, run.state)
        curve = metrics[metrics["run_id"] == run.run_id]
        n = len(curve)
        rows: dict[str, list] = {f.name: [math.nan] * n for f in store.METRICS_SCHEMA}
        rows.update(step=curve["step"].tolist(),
                    examples=(curve["step"] * run.batch_size).tolist(),
                    loss=curve["loss"].tolist(), loss_smooth=curve["loss_smooth"].tolist(),
                    lr=[run.learning_rate] * n, b_simple=curve["b_simple"].tolist(),
                    metric=curve["metric"].tolist())
        store.write_table(path / paths.METRICS, store.metrics_table(rows))


@pytest.fixture
def uphill_sweep(tmp_path, monkeypatch):
    """A cartpole sweep folder written by hand (no training: the curves above), analysed
    through the prepared registry entry; gymnasium is not needed to analyse."""
    entry = dataclasses.replace(tasks.REGISTRY["cartpole"], requires=())
    monkeypatch.setitem(tasks.REGISTRY, "cartpole", entry)
    folder = tmp_path / "cartpole"
    _write_sweep(folder)
    return folder


def test_analyze_and_compare_a_higher_is_better_sweep(uphill_sweep, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["analyze", str(uphill_sweep)])
    assert result.exit_code == 0, result.output
    _check_fits(read_results(uphill_sweep).fits)
    out = tmp_path / "compare"
    result = runner.invoke(app, ["compare", str(uphill_sweep), "--out", str(out)])
    assert result.exit_code == 0, result.output
    table = store.read_table(out / paths.COMPARE).to_pandas()
    assert set(table["unit"]) == {"environment steps"}
    assert set(table["metric"]) == {"return"} and table["higher_is_better"].all()
    assert (out / "bcrit_vs_noise_scale.png").is_file()


def test_a_loss_option_is_refused_for_a_metric_task(uphill_sweep):
    result = CliRunner().invoke(app, ["analyze", str(uphill_sweep), "--loss", "raw"])
    assert result.exit_code == 2
    assert "targets are values of its return" in result.output


def test_a_loss_task_logs_no_metric_and_reads_nan():
    """The loop logs no metric for a loss task: metrics_table fills it with NaN."""
    rows: dict[str, list] = {f.name: [1.0, 2.0] for f in store.METRICS_SCHEMA}
    rows["metric"] = []
    table = store.metrics_table(rows)
    assert table.schema.equals(store.METRICS_SCHEMA)
    assert np.isnan(table.column("metric").to_numpy()).all()
    del rows["eval_loss"]
    with pytest.raises(KeyError):  # only the optional columns may be missing
        store.metrics_table(rows)


def test_metrics_without_a_metric_column_read_as_nan(tiny_sweep, tmp_path):
    """Files written before the metric column existed still load, with metric NaN."""
    import shutil

    from gnsweep.folder import load_curves

    old = tmp_path / "old"
    shutil.copytree(tiny_sweep, old)
    for path in old.glob("runs/*/metrics.parquet"):
        table = store.read_table(path)
        store.write_table(path, table.drop_columns(["metric"]))
    curves = load_curves(old)
    assert len(curves.columns["metric"]) == len(curves.columns["loss"]) > 0
    assert np.isnan(curves.columns["metric"]).all()
    assert np.isfinite(curves.columns["loss"]).all()


def test_prepared_cartpole_entry_matches_the_task():
    cartpole = pytest.importorskip("gnsweep.tasks.cartpole")
    entry = tasks.REGISTRY["cartpole"]
    assert entry.metric == cartpole.Cartpole.metric_name
    assert entry.higher_is_better == cartpole.Cartpole.higher_is_better
    assert entry.options is cartpole.Options
    assert entry.description == cartpole.DESCRIPTION


def test_task_config_declares_direction_unit_and_stop(monkeypatch):
    from gnsweep.config import TaskConfig

    digits = tasks.about(TaskConfig("digits"))
    assert (digits.metric, digits.higher_is_better, digits.unit) == ("loss", False, "examples")
    assert digits.hardest(TARGETS) == 50.0
    assert digits.reached(40.0, 50.0) and not digits.reached(60.0, 50.0)
    entry = dataclasses.replace(tasks.REGISTRY["cartpole"], requires=())
    monkeypatch.setitem(tasks.REGISTRY, "cartpole", entry)
    cartpole = tasks.about(TaskConfig("cartpole"))
    assert (cartpole.metric, cartpole.higher_is_better) == ("return", True)
    assert cartpole.unit == "environment steps"
    assert cartpole.hardest(TARGETS) == 200.0
    assert cartpole.reached(200.0, 200.0) and not cartpole.reached(150.0, 200.0)
    assert not cartpole.reached(math.nan, 50.0)  # no episode ended yet: nothing reached


def test_best_run_is_picked_at_the_hardest_target_in_its_direction():
    """Batch 8 has two learning rates: 0.1 reaches the easier target first, 0.3 alone reaches
    the hardest. For a return (rising) the hardest is the largest target; for a loss the
    smallest: the same front picks opposite runs."""
    import pandas as pd

    from gnsweep.report.views import best_runs
    from gnsweep.targets import hardest, in_training_order, reached

    runs = pd.DataFrame({"run_id": ["a", "b"], "batch_size": [8, 8],
                         "learning_rate": [0.1, 0.3], "seed": [0, 0], "state": ["done"] * 2})
    metrics = pd.DataFrame({"run_id": ["a", "b"], "step": [1, 1], "loss_smooth": [1.0, 1.0]})
    front = pd.DataFrame({"batch_size": [8, 8], "target": [100.0, 200.0],
                          "learning_rate": [0.1, 0.3]})
    assert best_runs(runs, metrics, front, RISING)["run_id"].tolist() == ["b"]
    assert best_runs(runs, metrics, front, FALLING)["run_id"].tolist() == ["a"]
    assert hardest([100.0, 200.0], True) == 200.0 and hardest([0.3, 0.1], False) == 0.1
    assert in_training_order([0.1, 0.3], False) == [0.3, 0.1]
    assert reached(201.0, 200.0, True) and not reached(0.2, 0.1, False)
