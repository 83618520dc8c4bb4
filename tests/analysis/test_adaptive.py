"""Adaptive batch size (appendix D): the schedule B = sqrt(r B_noise), the eq. 2.7 learning rate,
gamma of a noise-scale path, the gains at equal S, the config and an end-to-end digits sweep."""

import math
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from gnsweep import paths
from gnsweep.analysis.adaptive import (
    adaptive_examples,
    fixed_examples,
    gamma_of_path,
    predicted_gain,
)
from gnsweep.config import Config, ConfigError, SweepConfig, TrainConfig
from gnsweep.noise import NoiseEstimate
from gnsweep.runs import RunSpec, expand_grid
from gnsweep.schedule import AdaptiveBatch, Progress, eps_of_batch

runner = CliRunner()


def _progress(b_simple: float, b_noise: float = math.nan, per_sample: float = 1.0) -> Progress:
    nan = math.nan
    estimate = NoiseEstimate(b_small=nan, b_big=nan, sq_norm_small=nan, sq_norm_big=nan,
                             g2_step=nan, trace_sigma_step=nan, g2=nan, trace_sigma=nan,
                             b_simple=b_simple, b_noise=b_noise)
    return Progress(step=1, examples=8, estimate=estimate, examples_per_sample=per_sample)


# ---- gamma (appendix D) -------------------------------------------------------------------


def test_gamma_of_a_constant_path_is_one():
    assert gamma_of_path(np.full(50, 37.0), np.ones(50)) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 3.0])
def test_gamma_of_a_power_law_path_has_its_closed_form(p):
    # B_noise = s^p over S_min in [0, 1], uniform weights: <s^(p/2)>^2 / <s^p>
    # = (1/(p/2 + 1))^2 / (1/(p + 1)) = 4 (p + 1) / (p + 2)^2 (8/9 for a path growing like s).
    n = 200_000
    s = (np.arange(n) + 0.5) / n  # midpoint rule
    assert gamma_of_path(7.0 * s**p, np.ones(n)) == pytest.approx(4 * (p + 1) / (p + 2) ** 2,
                                                                  rel=1e-6)


def test_gamma_weights_are_s_min_weights_and_bad_rows_carry_none():
    # Two halves of S_min, B_noise 1 and 9: <sqrt B>^2/<B> = ((1 + 3)/2)^2 / 5 = 0.8; the
    # weights, not the number of rows, decide the halves; NaN and negative rows are dropped.
    b = np.array([1.0, 9.0, 9.0, math.nan, -4.0])
    w = np.array([2.0, 1.0, 1.0, 5.0, 5.0])
    assert gamma_of_path(b, w) == pytest.approx(0.8)
    rng = np.random.default_rng(0)
    assert gamma_of_path(rng.lognormal(0, 2, 100), rng.random(100)) <= 1.0  # Cauchy-Schwarz


# ---- the fronts at equal S ----------------------------------------------------------------


def test_gains_at_equal_steps_follow_the_two_fronts():
    s_min, e_min = 10.0, 1000.0
    for s in (12.0, 20.0, 50.0):
        e_fixed = fixed_examples(s, s_min, e_min)
        assert (s / s_min - 1) * (e_fixed / e_min - 1) == pytest.approx(1.0)  # eq. 2.11
        assert e_fixed == pytest.approx(s * e_min / (s - s_min))  # B = E_min/(S - S_min)
        gamma = 0.6
        e_adaptive = adaptive_examples(s, s_min, e_min, gamma)
        assert (s / s_min - 1) * (e_adaptive / e_min - 1) == pytest.approx(gamma)
        assert predicted_gain(s, s_min, gamma) == pytest.approx(e_fixed / e_adaptive)
        assert predicted_gain(s, s_min, 1.0) == pytest.approx(1.0)
    assert math.isnan(fixed_examples(9.0, s_min, e_min))  # faster than S_min: no fixed B


def test_analysis_of_an_adaptive_run_with_known_answers():
    """A run whose batch size is s at step s and whose loss falls linearly, 1 - x/100 after x
    updates: it reaches 0.5 after S = 50 updates having drawn E = 1 + ... + 50 = 1275 examples.
    With B_simple = s at step s the S_min weights ds/(1 + B_simple/B) are all 1/2, so gamma is
    <sqrt(s)>^2 / <s> over s = 1..50."""
    from gnsweep.analysis.adaptive import analyze_adaptive, split_adaptive
    from gnsweep.analysis.steps import curves_from_frames

    n = 120
    step = np.arange(1, n + 1)
    metrics = pd.DataFrame({"run_id": "r10_lr1_s0", "step": step, "examples": np.cumsum(step),
                            "loss": 1 - (step - 1) / 100, "b_simple": step.astype(float)})
    grid = pd.DataFrame({"run_id": "b00008_lr1_s0", "step": step, "examples": 8 * step,
                         "loss": 1 - (step - 1) / 100, "b_simple": 5.0})
    runs = pd.DataFrame({"run_id": ["b00008_lr1_s0", "r10_lr1_s0"], "batch_size": [8, 60],
                         "learning_rate": [1.0, 1.0], "seed": [0, 0], "state": ["done", "done"],
                         "exchange_rate": [0.0, 10.0]})
    fixed, adaptive = split_adaptive(curves_from_frames(runs, pd.concat([grid, metrics])))
    assert list(fixed.runs["run_id"]) == ["b00008_lr1_s0"] and adaptive is not None
    fits = pd.DataFrame({"target": [0.5], "s_min": [20.0], "e_min": [500.0], "refused": [""]})
    row = analyze_adaptive(adaptive, fits, [0.5]).iloc[0]
    assert row["reached"] and row["steps"] == pytest.approx(50.0)
    assert row["examples"] == pytest.approx(1275.0)
    s = np.arange(1, 51)
    assert row["gamma"] == pytest.approx(np.mean(np.sqrt(s)) ** 2 / np.mean(s))
    assert row["e_fixed"] == pytest.approx(500 * 50 / 30)
    assert row["gain_measured"] == pytest.approx(500 * 50 / 30 / 1275)
    assert row["front_product"] == pytest.approx((50 / 20 - 1) * (1275 / 500 - 1))
    assert row["noise_source"] == "b_simple"


# ---- the schedule and the learning rate ---------------------------------------------------


def test_schedule_sets_sqrt_r_b_noise_within_bounds():
    schedule = AdaptiveBatch(100.0, eps_max=2.0, min_batch=8, max_batch=1024, min_change=0.1)
    assert schedule.next_batch_size(Progress(0, 0, None, 1.0)) == 8  # no estimate yet
    # Before any estimate: B_noise taken at the upper bound (a small, safe first step).
    assert schedule.learning_rate() == pytest.approx(2.0 / (1 + 1024 / 8))
    assert schedule.next_batch_size(_progress(64.0)) == 80  # sqrt(100 * 64)
    assert schedule.learning_rate() == pytest.approx(2.0 / (1 + 64 / 80))  # eq. 2.7
    assert schedule.next_batch_size(_progress(1e9)) == 1024  # the upper bound
    assert schedule.next_batch_size(_progress(0.01)) == 8  # the lower bound
    # B_noise, where measured, wins over B_simple; a negative estimate changes nothing.
    assert schedule.next_batch_size(_progress(1e6, b_noise=400.0)) == 200
    assert schedule.next_batch_size(_progress(-5.0)) == 200


def test_schedule_ignores_changes_below_its_threshold():
    schedule = AdaptiveBatch(100.0, eps_max=1.0, min_batch=1, max_batch=10_000, min_change=0.1)
    assert schedule.next_batch_size(_progress(100.0)) == 100
    assert schedule.next_batch_size(_progress(118.0)) == 100  # sqrt(11800) = 108.6: < 10%
    assert schedule.learning_rate() == pytest.approx(1.0 / (1 + 118 / 100))  # B_noise is new
    assert schedule.next_batch_size(_progress(121.0)) == 110  # 10% exactly: moves
    assert schedule.next_batch_size(_progress(81.0)) == 90  # 90 vs 110: 18% down, moves


def test_schedule_counts_samples_and_splits_over_workers():
    # 16 examples a sample, r and B_noise in examples: sqrt(160 * 2560) = 640 examples = 40.
    schedule = AdaptiveBatch(160.0, eps_max=1.0, min_batch=1, max_batch=10_000, min_change=0)
    assert schedule.next_batch_size(_progress(160.0 * 16, per_sample=16.0)) == 40
    # B_noise / B is unit-free: the learning rate is the same in samples as in examples.
    assert schedule.learning_rate() == pytest.approx(1.0 / (1 + 160.0 / 40))
    # Four DDP workers: a multiple of 4, bounds too.
    four = AdaptiveBatch(10.0, eps_max=1.0, min_batch=6, max_batch=30, min_change=0, world=4)
    assert four.next_batch_size(Progress(0, 0, None, 1.0)) == 8
    assert four.next_batch_size(_progress(50.0)) == 24  # sqrt(500) = 22.4 -> 24
    assert four.next_batch_size(_progress(1e6)) == 28


def test_eps_of_batch_is_eq_2_7():
    assert eps_of_batch(64, 2.0, 64) == pytest.approx(1.0)  # B = B_noise: half of eps_max
    assert eps_of_batch(1e12, 2.0, 64) == pytest.approx(2.0)  # B >> B_noise: eps_max
    assert eps_of_batch(1, 2.0, 99) == pytest.approx(0.02)  # B << B_noise: eps_max B/B_noise


# ---- config, run ids, grid ----------------------------------------------------------------


@pytest.mark.parametrize("settings, says", [
    ({"schedule": "adaptive"}, "needs exchange rates"),
    ({"exchange_rates": [100]}, "sweep.schedule=constant"),
    ({"schedule": "adaptive", "exchange_rates": [-1]}, "sweep.exchange_rates"),
    ({"schedule": "adaptive", "exchange_rates": [10], "adaptive_min_batch": 64,
      "adaptive_max_batch": 8}, "not a range"),
    ({"schedule": "sometimes"}, "sweep.schedule"),
    ({"schedule": "adaptive", "exchange_rates": [10], "adaptive_min_change": 1.5},
     "adaptive_min_change"),
])
def test_config_refuses_nonsense(settings, says):
    with pytest.raises(ConfigError, match=says):
        SweepConfig(**settings)


@pytest.mark.parametrize("train, says", [
    ({"optimizer": "adam"}, "SGD's"),
    ({"warmup_examples": 100}, "eps\\(B\\)"),
    ({"decay": "cosine"}, "train.decay=constant"),
])
def test_adaptive_refuses_a_recipe_that_sets_its_own_rate(train, says):
    sweep = SweepConfig(schedule="adaptive", exchange_rates=[10])
    with pytest.raises(ConfigError, match=says):
        Config(sweep=sweep, train=TrainConfig(**train))


def test_adaptive_run_ids_are_distinct_and_the_grid_is_pure():
    config = Config(sweep=SweepConfig(batch_sizes=[8, 64], learning_rates=[0.5], seeds=[0, 1],
                                      schedule="adaptive", exchange_rates=[300, 30],
                                      eps_max=2.0))
    specs = expand_grid(config)
    assert specs == expand_grid(config)
    adaptive = [s for s in specs if s.adaptive]
    assert [(s.exchange_rate, s.seed) for s in adaptive] == [(30, 0), (30, 1), (300, 0), (300, 1)]
    assert all(s.learning_rate == 2.0 and s.batch_size == 0 for s in adaptive)
    ids = [s.run_id for s in specs]
    assert len(set(ids)) == len(ids) == 8
    assert RunSpec(0, 2.0, 1, 30.0).run_id == "r30_lr2_s1"
    config.sweep.eps_max = 0.0
    with pytest.raises(ConfigError, match="eps_max"):
        expand_grid(config)


def test_eps_max_comes_from_the_fit_at_the_hardest_target(tmp_path):
    from gnsweep.sweep import resolve_adaptive_lr

    config = Config(sweep=SweepConfig(schedule="adaptive", exchange_rates=[10]))
    with pytest.raises(ConfigError, match=r"sweep\.eps_max"):
        resolve_adaptive_lr(config, tmp_path)
    pq.write_table(pa.table({"target": [0.3, 0.1, 0.03], "eps_max": [1.0, 2.0, math.nan],
                             "b_noise_lr": [40.0, 60.0, math.nan]}),
                   tmp_path / "fits.parquet")
    resolved = resolve_adaptive_lr(config, tmp_path).sweep
    assert (resolved.eps_max, resolved.adaptive_lr_noise) == (2.0, 60.0)  # 0.03 has no lr fit
    config.sweep.eps_max = 5.0
    resolved = resolve_adaptive_lr(config, tmp_path).sweep
    assert (resolved.eps_max, resolved.adaptive_lr_noise) == (5.0, 60.0)  # the flag wins
    config.sweep.adaptive_lr_noise = 7.0
    assert resolve_adaptive_lr(config, tmp_path).sweep.adaptive_lr_noise == 7.0
    # The measured rule needs no B_noise from the fit, and refuses a constant one.
    measured = Config(sweep=SweepConfig(schedule="adaptive", exchange_rates=[10], eps_max=3.0,
                                        adaptive_lr="measured"))
    assert resolve_adaptive_lr(measured, tmp_path / "nowhere").sweep.adaptive_lr_noise == 0
    with pytest.raises(ConfigError, match=r"sweep\.adaptive_lr_noise"):
        SweepConfig(schedule="adaptive", exchange_rates=[10], adaptive_lr="measured",
                    adaptive_lr_noise=5.0)


def test_launch_refuses_an_adaptive_sweep_without_eps_max_with_exit_2(tmp_path):
    from gnsweep.cli import app

    result = runner.invoke(app, ["launch", "sweep=tiny", "sweep.schedule=adaptive",
                                 "sweep.exchange_rates=[10]", "--sweep-dir",
                                 str(tmp_path / "x"), "--dry-run"])
    assert result.exit_code == 2
    assert "eps_max" in result.output and "Traceback" not in result.output


# ---- end to end ---------------------------------------------------------------------------


@pytest.mark.slow
def test_adaptive_runs_on_digits_end_to_end(tiny_sweep):
    """Adaptive runs beside the tiny digits grid: the batch size follows sqrt(r B_simple), the
    learning rate eq. 2.7, examples are counted per step, and the analysis measures them
    against the fixed-batch fits."""
    from gnsweep.cli import app

    sweep_dir = tiny_sweep
    result = runner.invoke(app, ["launch", "sweep=tiny", "sweep.schedule=adaptive",
                                 "sweep.exchange_rates=[30,300]", "sweep.eps_max=1.0",
                                 "sweep.adaptive_lr=measured",
                                 "--sweep-dir", str(sweep_dir), "--workers", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    for rate in (30, 300):
        path = paths.run_dir(sweep_dir, f"r{rate}_lr1_s0")
        rows = pq.read_table(path / paths.METRICS).to_pandas()
        batch = rows["batch_size"].to_numpy()
        assert (np.diff(rows["examples"].to_numpy()) == batch[1:]).all()  # counted per step
        assert rows["examples"].iloc[0] == batch[0] == 8  # the lower bound before an estimate
        assert len(np.unique(batch)) > 2
        # Step k's size and rate come from the estimate logged after step k - 1.
        prev = rows["b_simple"].to_numpy()[:-1]
        ok = prev > 0
        wanted = np.clip(np.sqrt(rate * prev[ok]), 8, 128)
        assert (np.abs(batch[1:][ok] - wanted) <= 0.1 * batch[1:][ok] + 1).all()
        lr = rows["lr"].to_numpy()[1:][ok]
        assert lr == pytest.approx(1.0 / (1 + prev[ok] / batch[1:][ok]), rel=1e-9)
    result = runner.invoke(app, ["analyze", str(sweep_dir)])
    assert result.exit_code == 0, result.output
    assert "adaptive batch size" in result.output
    table = pd.read_parquet(sweep_dir / "adaptive.parquet")
    fits = pd.read_parquet(sweep_dir / "fits.parquet")
    steps = pd.read_parquet(sweep_dir / "steps.parquet")
    assert not steps["run_id"].str.startswith("r").any()  # not in the fits of eq. 2.11
    assert len(table) == 2 * len(fits)
    reached = table[table["reached"]]
    assert len(reached)
    assert ((reached["gamma"] > 0) & (reached["gamma"] <= 1)).all()
    on_fit = reached[np.isfinite(reached["e_fixed"])]
    for row in on_fit.itertuples():
        assert row.gain_measured == pytest.approx(row.e_fixed / row.examples)
        assert row.gain_predicted == pytest.approx(row.e_fixed / row.e_predicted)
    result = runner.invoke(app, ["report", str(sweep_dir)])
    assert result.exit_code == 0, result.output
    assert "Adaptive batch size" in (sweep_dir / "report.html").read_text()
    shutil.rmtree(sweep_dir / "figures", ignore_errors=True)
    # Without the grid's runs there is no fit to measure them against: one line says what to do.
    only = sweep_dir.parent / "adaptive-only"
    shutil.copytree(sweep_dir, only)
    for path in (only / "runs").glob("b*"):
        shutil.rmtree(path)
    result = runner.invoke(app, ["analyze", str(only)])
    assert result.exit_code == 2
    assert "only adaptive runs (2)" in result.output and "gnsweep launch" in result.output
    assert "Traceback" not in result.output


def test_dry_run_shows_adaptive_runs_as_what_they_are(tmp_path):
    from gnsweep.cli import app

    result = runner.invoke(app, ["launch", "sweep=tiny", "sweep.schedule=adaptive",
                                 "sweep.exchange_rates=[30]", "sweep.eps_max=2",
                                 "sweep.adaptive_lr=measured",
                                 "--sweep-dir", str(tmp_path / "x"), "--dry-run"])
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("r30_")]
    assert line.split()[1:] == ["adaptive", "r=30", "eps_max", "2", "0", "pending"]
    assert not (tmp_path / "x").exists()


def test_a_fixed_lr_noise_replaces_the_measured_one_in_eq_2_7():
    schedule = AdaptiveBatch(100.0, eps_max=2.0, min_batch=8, max_batch=1024, lr_noise=20.0)
    assert schedule.learning_rate() == pytest.approx(2.0 / (1 + 20 / 8))  # before an estimate
    assert schedule.next_batch_size(_progress(64.0)) == 80
    assert schedule.learning_rate() == pytest.approx(2.0 / (1 + 20 / 80))
    assert RunSpec(0, 2.0, 0, 30.0, 20.0).run_id == "r30_lr2_bn20_s0"
