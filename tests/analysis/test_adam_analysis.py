"""The analysis of an adaptive optimizer's sweep: B_crit / B_simple_P beside B_crit / B_simple,
the noise scale against the temperature eps/B, and Li et al.'s surge form of eps_opt(B)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.analysis.lr import eps_opt, eps_opt_surge, fit_lr, fit_lr_table
from gnsweep.analysis.temperature import fit_temperature
from gnsweep.cli import app

BATCHES = (4, 8, 16, 32, 64, 128, 256)
LRS = (0.1, 0.2, 0.4, 0.8)
S_MIN, E_MIN = 40.0, 1280.0  # B_crit 32


def _steps(batch: int, lr: float) -> float:
    """S_min + E_min/B at the best rate 0.4, a bowl around it."""
    return (S_MIN + E_MIN / batch) * math.exp(0.3 * math.log(lr / 0.4) ** 2)


def _sweep(root, negative_precond: bool = False):
    """A sweep folder by hand whose B_simple is 10 B/eps (T = eps/B: exponent -1 exactly) and
    B_simple_P twice that; the loss falls log-linearly through the target 0.5.
    `negative_precond`: B_simple_P logged negative on every other row (as logs did before it
    was NaN while its window's G^T P G was not resolved above zero)."""
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(yaml.safe_dump({
        "sweep": {"targets": [0.5]}, "train": {"optimizer": "adam"},
        "analysis": {"loss": "smoothed", "bootstrap": 0}}))
    for b in BATCHES:
        for lr in LRS:
            path = paths.run_dir(root, f"b{b:05d}_lr{lr:g}_s0")
            store.write_json(path / paths.RUN_CONFIG, {"run": {
                "batch_size": b, "learning_rate": lr, "seed": 0}})
            last = int(_steps(b, lr)) + 5
            step = np.arange(1, last + 1, dtype=float)
            loss = np.exp(np.interp(step, [0.0, _steps(b, lr)], [0.0, math.log(0.5)],
                                    right=math.log(0.49)))
            n = len(step)
            rows = {f.name: [math.nan] * n for f in store.METRICS_SCHEMA}
            rows.update(step=step.astype(int).tolist(), examples=(step * b).astype(int).tolist(),
                        loss=loss.tolist(), loss_smooth=loss.tolist(),
                        b_simple=[10.0 * b / lr] * n, b_simple_precond=[
                            -3.0 * b / lr if negative_precond and i % 2 else 20.0 * b / lr
                            for i in range(n)])
            store.write_table(path / paths.METRICS, store.metrics_table(rows))
            store.write_status(path, "done")
    return root


@pytest.mark.parametrize("negative_precond", [False, True])
def test_analyze_writes_ratio_precond_and_temperature(tmp_path, negative_precond):
    """Non-positive B_simple_P rows are no batch size: analyze skips them as NaN rows, so the
    tables are those of the positive rows alone."""
    sweep = _sweep(tmp_path / "s", negative_precond)
    result = CliRunner().invoke(app, ["analyze", str(sweep)])
    assert result.exit_code == 0, result.output
    fits = pq.read_table(sweep / "fits.parquet").to_pandas().iloc[0]
    assert fits["b_crit"] == pytest.approx(E_MIN / S_MIN, rel=0.1)
    # B_simple_P is twice B_simple on every run: the ratio halves, on the same best runs.
    assert fits["b_simple_precond_mean"] == pytest.approx(2 * fits["b_simple_mean"])
    assert fits["ratio_precond"] == pytest.approx(fits["ratio"] / 2)
    front = pq.read_table(sweep / "front.parquet").to_pandas()
    assert (front["b_simple_precond_at_target"] == 2 * front["b_simple_at_target"]).all()
    temperature = pq.read_table(sweep / "temperature.parquet").to_pandas().iloc[0]
    assert temperature["exponent"] == pytest.approx(-1.0, abs=1e-9)
    assert temperature["exponent_precond"] == pytest.approx(-1.0, abs=1e-9)
    assert temperature["n_runs"] == len(BATCHES) * len(LRS)
    assert temperature["refused"] == ""


def test_temperature_refuses_too_few_runs_or_one_temperature():
    rows = pd.DataFrame({"target": 0.5, "reached": True, "batch_size": [8, 16, 32],
                         "learning_rate": [0.1, 0.2, 0.4],  # one T = 1/80
                         "b_simple_at_target": [5.0, 6.0, 7.0]})
    out = fit_temperature(rows).iloc[0]
    assert math.isnan(out["exponent"]) and "one temperature" in out["refused"]
    out = fit_temperature(rows.iloc[:2]).iloc[0]
    assert math.isnan(out["exponent"]) and "needs 3" in out["refused"]
    # A noisy negative B_simple is left out, never logged: the slope of the rest.
    rows = pd.DataFrame({"target": 0.5, "reached": True, "batch_size": [8, 16, 32, 64],
                         "learning_rate": 0.1, "b_simple_at_target": [1.0, 2.0, -3.0, 8.0]})
    out = fit_temperature(rows).iloc[0]
    assert out["n_runs"] == 3 and out["exponent"] == pytest.approx(-1.0)


def test_surge_form_recovers_its_peak_and_wins_over_saturation():
    b = np.array(BATCHES, float)
    surge = eps_opt_surge(b, 0.01, 32.0) * np.exp(0.02 * np.sin(b))  # peaks at B = 32
    fit = fit_lr(b, surge, "surge")
    assert fit.b_noise == pytest.approx(32.0, rel=0.05)
    assert fit.eps_max == pytest.approx(0.01, rel=0.05)
    front = pd.DataFrame({"target": 0.5, "batch_size": b, "lr_opt": surge, "lr_on_edge": False})
    table = fit_lr_table(front, [0.5])
    assert set(table["model"]) == {"sgd", "power", "surge"}
    assert (table["form"] == "surge").all()
    # eq. 2.7's saturation: the surge form loses (it must fall after its peak).
    saturating = eps_opt(b, 0.01, 32.0) * np.exp(0.02 * np.sin(b))
    front["lr_opt"] = saturating
    table = fit_lr_table(front, [0.5])
    assert (table["form"] != "surge").all() and (table["form"] != "").all()


@pytest.mark.parametrize("name,task", [("linreg_adam", "linreg"), ("chars_adam_small", "chars")])
def test_adam_experiments_compose(name, task):
    """The bundles behind docs/noise.md's table train with Adam on the task they name."""
    from gnsweep.compose import compose

    config = compose([f"+experiment={name}"])
    assert config.task.name == task and config.train.optimizer == "adam"
    assert len(config.sweep.batch_sizes) >= 3  # enough for a fit of eq. 2.11
