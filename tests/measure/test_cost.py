"""What measuring costs and what it gives: `noise.method=none` trains without measuring,
`noise.every=k` measures exactly every k-th step, `noise.every=auto` measures only the steps
B_simple's precision needs, and `b_simple_se` is the standard error of B_simple."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import torch

from gnsweep.config import Config, NoiseConfig, SweepConfig, TaskConfig
from gnsweep.measure import NoiseScaleMonitor
from gnsweep.noise import AUTO_MAX_EVERY, MeasureSchedule, NoiseScaleEma, pooled_variance_growth
from gnsweep.runs import RunSpec
from gnsweep.tasks import linreg
from gnsweep.training import build_run, run


def _linreg_run(noise: NoiseConfig, steps: int = 40, batch: int = 16):
    config = Config(task=TaskConfig(name="linreg", options={"dim": 8}),
                    sweep=SweepConfig(batch_sizes=[batch], learning_rates=[0.05],
                                      targets=[1e-9], max_steps=steps),
                    noise=noise)
    state = build_run(config, RunSpec(batch_size=batch, learning_rate=0.05))
    run(state)
    return state


def test_method_none_trains_the_same_steps_and_logs_no_noise_scale():
    off = _linreg_run(NoiseConfig(method="none"))
    on = _linreg_run(NoiseConfig(method="per_example"))
    # The same training (per-example norms leave the gradient alone), nothing measured.
    np.testing.assert_array_equal(off.rows["loss"], on.rows["loss"])
    assert all(math.isnan(v) for v in off.rows["b_simple"])
    assert all(math.isnan(v) for v in off.rows["b_simple_se"])
    assert off.monitor.schedule.measured == 0 and off.monitor.schedule.steps == 40
    assert not off.monitor.in_use.handles  # no hook at all
    assert all(math.isfinite(v) for v in on.rows["b_simple"][1:])


def test_every_k_measures_exactly_every_kth_step():
    task = linreg.make(linreg.Options(dim=8), seed=0)
    model = task.model()
    monitor = NoiseScaleMonitor(model, "per_example", every=3, ema_examples=512)
    generator = torch.Generator().manual_seed(0)
    measured = []
    for step in range(10):
        x, y = task.sample(8, generator)
        model.zero_grad()
        task.output_loss(model(x), y).backward()
        before = monitor.ema.seen_steps
        monitor.step()
        if monitor.ema.seen_steps != before:  # a measurement was folded in
            measured.append(step)
    assert measured == [0, 3, 6, 9]
    assert monitor.schedule.measured == 4 and monitor.schedule.share == 0.4
    # Each measurement folded in the 3 steps it stands for (the window is in progress).
    assert monitor.ema.seen_steps == 1 + 3 + 3 + 3 and monitor.ema.seen_examples == 80


def test_b_simple_se_is_the_spread_of_b_simple_over_repeats():
    """Equal weights (a window that pools everything): 40 noisy single estimates of
    tr(Sigma) = 100 and |G|^2 = 1, correlated; b_simple_se against the spread of B_simple over
    400 repeats."""
    rng = random.Random(0)
    values, errors = [], []
    for _ in range(400):
        ema = NoiseScaleEma(ema_examples=math.inf)
        for _ in range(40):
            z = rng.gauss(0, 1)
            g2 = 1.0 + 0.5 * z
            trace = 100.0 + 20.0 * (0.6 * z + 0.8 * rng.gauss(0, 1))
            estimate = ema._fold(g2, trace, 1.0, 16.0, math.nan, math.nan, 16.0, 1.0)
        values.append(estimate.b_simple)
        errors.append(estimate.b_simple_se)
    spread = statistics.stdev(values)
    # Delta method: (0.2^2 + 0.5^2 - 2 * 0.6 * 0.2 * 0.5) / 40 -> relative 0.0663.
    assert abs(statistics.median(errors) / spread - 1) < 0.15
    assert abs(spread / 100 - 0.0663) < 0.015


def _schedule_share(noise_sd: float, steps: int = 2000, every: int | str = "auto",
                    pooled: int = 1, seed: int = 1) -> float:
    """`every=auto` over `steps` steps of constant batch 64, window 0.2 of training, with single
    estimates of relative spread `noise_sd` about a steady B_simple of 50."""
    return _scheduled(noise_sd, steps, every, pooled, seed)[0]


def _scheduled(noise_sd: float, steps: int, every: int | str, pooled: int,
               seed: int) -> tuple[float, float]:
    """(share of steps measured, B_simple at the end) of `_schedule_share`'s run."""
    rng = random.Random(seed)
    ema = NoiseScaleEma(ema_fraction=0.2)
    schedule = MeasureSchedule(every, pooled)
    since = 0.0
    for _ in range(steps):
        measured = schedule.next
        since += 64
        if measured:
            g2 = 1.0 + noise_sd * rng.gauss(0, 1)
            ema._fold(g2, 50.0 * (1 + 0.1 * rng.gauss(0, 1)), 1.0, 64.0, 0, 0, since, 1,
                      since / 64)
            since = 0.0
        schedule.advance(measured, ema, since, 64)
    return schedule.share, ema._ratio_now()


def test_auto_measures_few_steps_where_single_estimates_are_precise_and_all_where_not():
    precise = _schedule_share(0.05)
    assert 1 / AUTO_MAX_EVERY <= precise < 0.15
    assert _schedule_share(3.0) > 0.9  # B_simple's own error is large: every step counts


def test_a_run_pooled_with_others_measures_fewer_steps_within_the_variance_it_may_add():
    """One of 8 whose median a sweep reads: its B_simple's variance over 150 repeats may grow
    to `pooled_variance_growth(8)` (6.2x) that of every step; measured, it grows less, on a
    third of the steps, where the run alone measures nearly every step."""
    def spread(every, pooled):
        runs = [_scheduled(1.0, 600, every, pooled, seed) for seed in range(150)]
        return (statistics.mean(r[0] for r in runs),
                statistics.pvariance([r[1] for r in runs]))
    _, every_step = spread(1, 1)
    alone_share, _ = spread("auto", 1)
    pooled_share, pooled = spread("auto", 8)
    assert alone_share > 0.9 and pooled_share < 0.5
    assert 1 < pooled / every_step < pooled_variance_growth(8)


def test_auto_is_a_config_value_and_the_monitor_default_stays_every_step():
    assert NoiseConfig(every="auto").every == "auto"
    assert NoiseConfig(every="AUTO").every == "auto"
    assert NoiseConfig(every=3).every == 3
    task = linreg.make(linreg.Options(dim=8), seed=0)
    assert NoiseScaleMonitor(task.model()).schedule.every == 1


def test_norm_layers_on_a_model_of_norm_layers_only_is_the_full_estimator():
    """A model whose only parameters are LayerNorm scales and biases: `norm_layers` measures
    every parameter, so its per-step norms equal per-example norms' on the same batches."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(6), torch.nn.Tanh(), torch.nn.LayerNorm(6))
    target = torch.randn(6)
    pairs = {}
    for method in ("norm_layers", "per_example"):
        monitor = NoiseScaleMonitor(model, method, ema_examples=math.inf)
        generator = torch.Generator().manual_seed(1)
        values = []
        for _ in range(5):
            x = torch.randn(32, 6, generator=generator) * 3 + 1
            model.zero_grad()
            (model(x) - target).pow(2).sum(1).mean().backward()
            e = monitor.step()
            values.append((e.sq_norm_small, e.sq_norm_big, e.b_simple))
        monitor.close()
        assert monitor.measures == method
        pairs[method] = values
    np.testing.assert_allclose(pairs["norm_layers"], pairs["per_example"], rtol=1e-12)


def test_norm_layers_hooks_only_the_norm_layers_and_refuses_a_model_without_them():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 1))
    monitor = NoiseScaleMonitor(model, "norm_layers")
    assert {id(p) for p in monitor.params} == {id(p) for p in model[1].parameters()}
    monitor.close()
    try:
        NoiseScaleMonitor(torch.nn.Linear(4, 1), "norm_layers")
    except ValueError as err:
        assert "LayerNorm" in str(err)
    else:
        raise AssertionError("a model without norm layers was not refused")


def test_status_says_measurement_was_off_or_what_share_was_measured():
    from gnsweep.runs import measurement_note
    from gnsweep.training import train

    config = Config(task=TaskConfig(name="linreg", options={"dim": 8}),
                    sweep=SweepConfig(batch_sizes=[16], learning_rates=[0.05], targets=[1e-9],
                                      max_steps=12),
                    noise=NoiseConfig(method="none"))
    result = train(config, RunSpec(batch_size=16, learning_rate=0.05), None)
    assert result.noise_measured == {"method": "none", "every": "auto", "steps": 12,
                                     "measured": 0, "share": 0.0}
    rows = [{"noise": result.noise_measured},
            {"noise": {"method": "per_example", "every": 4, "steps": 100, "measured": 25}}]
    note = measurement_note(rows)
    assert note is not None and "noise.method=none" in note and "25% of 100 steps" in note
    assert measurement_note([{"noise": None}]) is None
