"""A batch-size warm-up that follows the measured critical batch size along training
(`sweep.schedule=along`, gnsweep.schedule.AlongBatch): the curve, its rounding, the learning
rate of eq. 2.7, the loop that draws those sizes, and the curve read from a branch sweep."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest

from gnsweep import store
from gnsweep.config import Config, ConfigError, SweepConfig, TaskConfig, TrainConfig
from gnsweep.runs import RunSpec, expand_grid
from gnsweep.schedule import AlongBatch, Progress

POINTS = [[100.0, 20.0], [1000.0, 200.0]]


def _expected_size(examples: float, low: int = 4, high: int = 512) -> int:
    """log-log interpolation between (100, 20) and (1000, 200) is B = examples / 5 there."""
    b_crit = 20.0 if examples <= 100 else 200.0 if examples >= 1000 else examples / 5
    return min(high, max(low, 2 ** math.floor(math.log2(b_crit))))


@pytest.mark.parametrize("examples", [0, 50, 100, 316, 640, 999, 1000, 5000])
def test_the_curve_interpolated_in_log_and_rounded_down_to_a_power_of_two(examples):
    schedule = AlongBatch([(e, b) for e, b in POINTS], 1.0, 30.0, 4, 512)
    size = schedule.next_batch_size(Progress(0, examples, None, 1.0))
    assert size == _expected_size(examples)
    assert schedule.learning_rate() == pytest.approx(1.0 / (1.0 + 30.0 / size))  # eq. 2.7
    # In samples for a task counting 4 examples per sample (tokens per window), lr alike.
    tokens = AlongBatch([(e, b) for e, b in POINTS], 1.0, 30.0, 1, 512)
    assert tokens.next_batch_size(Progress(0, 640, None, 4.0)) == 32  # 128 examples / 4
    assert tokens.learning_rate() == pytest.approx(1.0 / (1.0 + 7.5 / 32))


def test_a_run_draws_the_sizes_of_the_curve():
    """The training loop asks the schedule before each step: every logged batch size and
    learning rate is the rule's at the examples seen before that step."""
    from gnsweep.training import build_run, run

    config = Config(task=TaskConfig(name="linreg", options={"dim": 8}),
                    sweep=SweepConfig(batch_sizes=[4, 512], learning_rates=[0.1],
                                      targets=[1e-9], max_steps=40, schedule="along",
                                      along_points=POINTS, eps_max=0.5, adaptive_lr_noise=30.0))
    (spec,) = [s for s in expand_grid(config) if s.along]
    assert spec.run_id == "along_lr0.5_bn30_s0"
    state = build_run(config, spec)
    run(state)
    sizes = np.asarray(state.rows["batch_size"], float)
    seen = np.concatenate([[0.0], np.asarray(state.rows["examples"], float)[:-1]])
    assert list(sizes) == [_expected_size(e) for e in seen]
    assert len(set(sizes)) >= 3
    np.testing.assert_allclose(state.rows["lr"], 0.5 / (1.0 + 30.0 / sizes))


def test_the_curve_comes_from_a_branch_sweeps_most_local_fit(tmp_path):
    from gnsweep.analysis.along import ALONG_COLUMNS
    from gnsweep.branching import resolve_along

    rows = []
    for at, fraction, b_crit, refused in [(800, 0.9, 50.0, ""), (800, 0.8, 70.0, ""),
                                          (3200, 0.9, math.nan, "only 2 batch sizes"),
                                          (3200, 0.8, 120.0, ""), (9000, 0.9, math.nan, "x")]:
        row = dict.fromkeys(ALONG_COLUMNS, math.nan)
        row.update(at_examples=at, at_step=at // 32, target=fraction, b_crit=b_crit,
                   refused=refused, quality="", n_runs=4, n_batch_sizes=3)
        rows.append(row)
    store.write_frame(tmp_path / "along.parquet", pd.DataFrame(rows, columns=ALONG_COLUMNS),
                      store.RESULT_SCHEMAS["along"])
    config = Config(sweep=SweepConfig(schedule="along", along_from=str(tmp_path)))
    resolved = resolve_along(config, tmp_path / "elsewhere")
    assert resolved.sweep.along_points == [[800.0, 50.0], [3200.0, 120.0]]
    # Through the CLI: the grid and one along run per seed.
    from typer.testing import CliRunner

    from gnsweep.cli import app

    shown = CliRunner().invoke(app, [
        "launch", "--dry-run", "--sweep-dir", str(tmp_path / "grid"), "sweep.schedule=along",
        f"sweep.along_from={tmp_path}", "sweep.eps_max=0.5", "sweep.adaptive_lr_noise=30",
        "sweep.batch_sizes=[16,64]", "sweep.learning_rates=[0.1]", "sweep.seeds=[0,1]"])
    assert shown.exit_code == 0, shown.output
    assert shown.output.count("along B_crit") == 2 and "6 runs" in shown.output
    with pytest.raises(ConfigError, match=r"no along\.parquet"):
        resolve_along(dataclasses.replace(config, sweep=SweepConfig(
            schedule="along", along_from=str(tmp_path / "none"))), tmp_path)


@pytest.mark.parametrize(("settings", "expected"), [
    ({"along_from": "x"}, "sweep.schedule is not along"),
    ({"schedule": "along"}, "needs sweep.along_from"),
])
def test_along_settings_are_checked(settings, expected):
    with pytest.raises(ConfigError, match=expected):
        SweepConfig(**settings)
    along = SweepConfig(schedule="along", along_from="x")
    with pytest.raises(ConfigError, match=r"eq\. 2\.7"):
        Config(sweep=along, train=TrainConfig(optimizer="adam"))
    with pytest.raises(ConfigError, match=r"drop train\.warmup"):
        Config(sweep=along, train=TrainConfig(warmup_examples=100))
    assert RunSpec(0, 0.5, 1, lr_noise=30.0, along=True).run_id == "along_lr0.5_bn30_s1"


def test_along_runs_are_measured_against_the_fastest_fixed_batch_and_the_front():
    """A run whose raw loss falls by 0.1 a step from 1.0, 8 examples a step then 16: the target
    0.45 is crossed after 5.5 updates (raw loss logged at step s is the loss after s - 1), with
    8*5 + 16*0.5 = 48 examples; the front's S at 48 examples is S_min E / (E - E_min)."""
    from gnsweep.analysis.along import compare_schedule
    from gnsweep.analysis.steps import curves_from_frames

    steps = np.arange(1, 11)
    examples = np.cumsum(np.where(steps <= 5, 8, 16))
    curves = curves_from_frames(
        pd.DataFrame([{"run_id": "along_s0", "batch_size": 12, "learning_rate": 0.5, "seed": 0,
                       "state": "done"}]),
        pd.DataFrame({"run_id": "along_s0", "step": steps, "examples": examples,
                      "loss": 1.0 - 0.1 * (steps - 1)}))
    front = pd.DataFrame({"target": [0.45, 0.45], "batch_size": [8, 64],
                          "learning_rate": [0.1, 0.4], "steps": [9.0, 4.0],
                          "examples": [72.0, 256.0]})
    fits = pd.DataFrame({"target": [0.45], "s_min": [3.0], "e_min": [24.0], "refused": [""]})
    (row,) = compare_schedule(curves, front, [0.45], fits=fits, loss="raw").itertuples()
    assert row.steps == pytest.approx(5.5) and row.examples == pytest.approx(48.0)
    assert (row.best_batch, row.best_steps) == (64, 4.0)
    assert row.steps_ratio == pytest.approx(5.5 / 4.0)
    assert row.examples_ratio == pytest.approx(48.0 / 256.0)
    assert row.front_steps == pytest.approx(3.0 * 48.0 / (48.0 - 24.0))
    assert row.front_ratio == pytest.approx(5.5 / 6.0)
