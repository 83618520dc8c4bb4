"""The pure estimators (eq. A.1, A.2, EMAs, B_simple) against closed-form expectations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gnsweep import noise


def test_a2_inverts_a1_exactly():
    g2, trace = 3.0, 120.0
    for b_small, b_big in [(1, 64), (16, 64), (32, 64), (3.5, 7)]:
        sq_small, sq_big = g2 + trace / b_small, g2 + trace / b_big  # eq. A.1
        got = noise.unbiased_g2_and_trace(sq_small, sq_big, b_small, b_big)
        assert got == pytest.approx((g2, trace), rel=1e-12)
        assert noise.equivalent_norms(*got, b_small, b_big) == pytest.approx((sq_small, sq_big))


def test_a2_rejects_equal_batch_sizes():
    with pytest.raises(ValueError, match="b_small < b_big"):
        noise.unbiased_g2_and_trace(1.0, 1.0, 8, 8)


def test_parts_add_up():
    # Two parameter blocks measured with different batch pairs: G2 and S are sums over blocks.
    a = (2.0 + 50.0 / 1, 2.0 + 50.0 / 32, 1, 32)
    b = (1.0 + 10.0 / 8, 1.0 + 10.0 / 32, 8, 32)
    assert noise.combine_parts([a, b]) == pytest.approx((3.0, 60.0))


def test_ema_is_bias_corrected_and_decay_one_is_the_mean():
    ema = noise.Ema()
    assert math.isnan(ema.value)
    ema.update(5.0, 0.9)
    assert ema.value == pytest.approx(5.0)  # bias correction: no pull towards 0
    mean = noise.Ema()
    for v in [1.0, 2.0, 6.0]:
        mean.update(v, 1.0)
    assert mean.value == pytest.approx(3.0)
    assert noise.ema_decay(64, steps=math.inf) == 1.0
    assert noise.ema_decay(64, examples_scale=128) == pytest.approx(math.exp(-0.5))
    assert noise.ema_decay(64, steps=10, steps_elapsed=5) == pytest.approx(math.exp(-0.5))


def test_negative_single_estimates_are_kept():
    est = noise.NoiseScaleEma(ema_steps=math.inf)
    e = est.update(1.0, 2.0, 1, 8)  # small-batch norm below the big one: S < 0
    assert e.trace_sigma_step < 0 and e.trace_sigma < 0


def _gaussian_gradients(rng, n, dim, g, sigma_diag):
    return g + rng.standard_normal((n, dim)) * np.sqrt(sigma_diag)


def test_b_simple_is_ratio_of_averages_not_average_of_ratios():
    """Simulated per-example gradients with known G and Sigma (eq. A.1): the ratio of the
    smoothed estimates converges to tr(Sigma)/|G|^2; the mean of per-step ratios does not."""
    rng = np.random.default_rng(0)
    dim, b_small, b_big = 20, 4, 16
    g = np.full(dim, 0.3)
    sigma = np.linspace(0.5, 3.0, dim)
    truth = sigma.sum() / (g @ g)
    est = noise.NoiseScaleEma(ema_steps=math.inf)
    ratios = []
    for _ in range(4000):
        per_example = _gaussian_gradients(rng, b_big, dim, g, sigma)
        small = per_example.reshape(b_big // b_small, b_small, dim).mean(1)
        sq_small = float((small ** 2).sum(1).mean())
        sq_big = float((per_example.mean(0) ** 2).sum())
        e = est.update(sq_small, sq_big, b_small, b_big)
        ratios.append(e.trace_sigma_step / e.g2_step)
    assert e.b_simple == pytest.approx(truth, rel=0.05)
    assert abs(np.mean(ratios) / truth - 1) > 0.2


def test_hessian_norms_give_b_noise():
    est = noise.NoiseScaleEma(ema_steps=math.inf)
    est.update(3.0 + 30.0, 3.0 + 30.0 / 8, 1, 8)
    e = est.update_hessian(2.0 + 10.0 / 4, 2.0 + 10.0 / 16, 4, 16)
    assert e is not None
    assert (e.g_h_g, e.trace_h_sigma, e.b_noise) == pytest.approx((2.0, 10.0, 5.0))
    assert e.b_simple == pytest.approx(10.0)


def test_fraction_window_follows_training():
    """ema_fraction f: the decay of an update of n examples is exp(-n / (f * seen)), seen
    counting this update; a constant signal is returned as is."""
    est = noise.NoiseScaleEma(ema_fraction=0.5)
    est.update(3.0 + 30.0, 3.0 + 30.0 / 8, 1, 8, examples=8)
    e = est.update(1.0 + 10.0, 1.0 + 10.0 / 8, 1, 8, examples=8)
    d = math.exp(-8 / (0.5 * 16))
    assert e.g2 == pytest.approx((3.0 * d + 1.0) / (d + 1))
    assert est.window == pytest.approx(0.5 * 16)
    with pytest.raises(ValueError, match="ema_fraction"):
        noise.NoiseScaleEma(ema_fraction=-1)


def test_hessian_ema_runs_on_the_plain_clock():
    """B_noise measured every 5th update of 10 examples: each Hessian fold decays the past by
    the 50 examples since the last one, exp(-50/100), not by one update's exp(-10/100)."""
    for clock, seen in (("examples", 50), ("measurements", 10)):
        est = noise.NoiseScaleEma(ema_examples=100.0, hessian_clock=clock)
        for i in range(6):
            est.update(3.0 + 30.0, 3.0 + 30.0 / 8, 1, 8, examples=10)
            if i % 5 == 0:
                value = 1.0 if i == 0 else 0.0  # G^T H G = value, tr(H Sigma) = 0
                e = est.update_hessian(value, value, 4, 16)
        d = math.exp(-seen / 100)
        assert e is not None and e.g_h_g == pytest.approx(d / (d + 1)), clock


def test_drift_flags_a_fast_falling_g2():
    """|G|^2 halving every 10 examples with a window of 40: it falls 16x inside the window."""
    falling, steady = (noise.NoiseScaleEma(ema_examples=40.0) for _ in range(2))
    for i in range(200):
        g2 = 0.5 ** (i / 10)
        falling.update(g2 + 1.0, g2 + 1.0 / 8, 1, 8, examples=1)
        steady.update(2.0, 1.0 + 1.0 / 8, 1, 8, examples=1)
    assert falling.drifting and falling.drift < 0.1
    assert not steady.drifting and steady.drift == pytest.approx(1.0)


def test_probe_schedule_is_log_spaced():
    schedule = noise.ProbeSchedule(per_octave=1)
    due = [s for s in range(0, 1000, 4) if schedule.due(s)]
    assert due == [0, 4, 8, 16, 32, 64, 128, 256, 512]


def test_drift_stays_quiet_on_noise_alone():
    """|G|^2 constant (1.0) but each single estimate noisy (B_simple / B = 4, as at small batch
    sizes): the quarter-window EMAs wander, yet a 2x change would not stand out of that noise,
    so the flag must not fire (the former flag fired on noise)."""
    import random

    rng = random.Random(0)
    ema = noise.NoiseScaleEma(ema_fraction=0.2)
    fired = 0
    for _ in range(3000):
        g2 = 1.0 + 4.0 * rng.gauss(0.0, 1.0)
        ema.update(g2 + 8.0, g2 + 1.0, 1, 8, examples=8)
        fired += ema.drifting
    assert fired / 3000 < 0.01


def _drift_by_definition(history, clock, window):
    """|G|^2 now over |G|^2 one window ago from the whole history (the last entry at or before
    the window's start), as `NoiseScaleEma.drift` defines it."""
    then = clock - window
    if not history or then < history[0][0]:
        return math.nan
    (_, past, past_err) = [h for h in history if h[0] <= then][-1]
    (_, now, now_err) = history[-1]
    if max(past_err, now_err) > noise.DRIFT_MAX_RELATIVE_ERROR:
        return math.nan
    return now / past if past > 0 and now > 0 else math.nan


@pytest.mark.parametrize("window", [{"ema_fraction": 0.2}, {"ema_steps": 50.0}])
def test_drift_keeps_a_window_of_history_and_its_answers(window):
    """The drift history is pruned before the window's start (it only moves on): every drift
    equals the definition on the whole history, the history stays about a window long, and a
    state saved and loaded mid-run continues bit for bit."""
    import random

    rng = random.Random(1)
    ema = noise.NoiseScaleEma(**window)
    whole, resumed = [], None
    for i in range(2400):
        g2 = 2.0 ** (-i / 400) * (1.0 + 0.05 * rng.gauss(0.0, 1.0))
        estimate = ema.update(g2 + 1.0 / 8, g2 + 1.0 / 64, 8, 64, examples=64)
        whole.append(ema._history[-1])
        clock = ema.seen_steps if "ema_steps" in window else ema.seen_examples
        expected = _drift_by_definition(whole, clock, ema.window)
        assert estimate.drift == expected or (math.isnan(expected) and math.isnan(estimate.drift))
        if i == 1000:
            resumed = noise.NoiseScaleEma(**window)
            resumed.load_state_dict(ema.state_dict())
        elif resumed is not None:
            assert resumed.update(g2 + 1.0 / 8, g2 + 1.0 / 64, 8, 64, examples=64) == estimate
    assert sum(math.isfinite(h[1]) for h in whole) > 2000 and math.isfinite(estimate.drift)
    assert len(ema._history) < 1200
    assert ema.state_dict() == resumed.state_dict()
