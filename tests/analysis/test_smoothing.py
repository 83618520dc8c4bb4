"""Centred smoothing of whole curves (gnsweep.analysis.smoothing) against closed forms and against
linreg's exact expected loss curves (gnsweep.linreg_exact)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gnsweep.analysis.smoothing import centred_fit, centred_ratio, first_reach
from gnsweep.linreg_exact import Problem, exact_truth, simulate_sgd


def test_a_straight_line_is_reproduced_everywhere_even_at_the_ends():
    x = np.arange(50.0)
    y = 3.0 - 0.25 * x
    assert centred_fit(x, y, 0.3, 2.0) == pytest.approx(y)


def test_curvature_bias_is_symmetric_and_second_order():
    """y = x^2 under a box window of half-width h (interior, dense points): the local line at x
    is x^2 + (f''/2) Var(u) = x^2 + h^2 / 3 with u uniform on [-h, h]; no first-order (lag)
    term."""
    x = np.linspace(0.0, 100.0, 100_001)
    out = centred_fit(x, x ** 2, 0.0, 5.0)
    inner = (x > 10) & (x < 90)
    assert out[inner] - x[inner] ** 2 == pytest.approx(25.0 / 3.0, rel=1e-3)


def test_nan_values_are_skipped_and_the_ratio_needs_a_positive_denominator():
    x = np.arange(10.0)
    y = np.where(x % 2 == 0, 2.0, np.nan)
    assert centred_fit(x, y, 0.0, 1.5) == pytest.approx(np.full(10, 2.0))
    ratio = centred_ratio(x, np.full(10, 6.0), np.where(x < 5, 2.0, -1.0), 0.0, 0.5)
    assert ratio[:5] == pytest.approx(np.full(5, 3.0))
    assert np.isnan(ratio[5:]).all()


def test_first_reach_interpolates_between_the_crossing_points():
    x = np.array([0.0, 1.0, 2.0, 3.0])
    assert first_reach(x, np.array([4.0, 3.0, 1.0, 0.5]), 2.0) == pytest.approx(1.5)
    assert first_reach(x, np.array([1.0, 3.0]), 2.0) == 0.0
    assert math.isnan(first_reach(x, np.full(4, 5.0), 2.0))


def test_steps_to_target_from_noisy_runs_match_the_exact_expected_curve():
    """Sampled SGD runs (the batch loss logged before each update) at each batch size's exact
    best learning rate: the centred smoother's steps-to-target average within 8% of the exact
    S(B) of the expected loss, where a causal EMA of 256 examples lags by 15% or more at the
    smallest batch (scripts/smoothing_bias.py measures the full grid)."""
    lam = np.logspace(0, -2, 16)
    delta0 = np.random.default_rng(0).standard_normal(17) / np.sqrt(np.append(lam, 1.0))
    problem = Problem.linreg(lam, delta0, 0.5)
    target = 2 * problem.floor
    truth = exact_truth(problem, [4, 32, 256], [target], limits=False)
    rng = np.random.default_rng(1)
    for j, batch in enumerate((4, 32, 256)):
        exact = truth.steps[0, j]
        n = math.ceil(1.5 * exact) + 5
        loss, _, _ = simulate_sgd(problem, delta0, truth.best_lr[0, j], batch, n, 8, rng)
        x = np.arange(n, dtype=float)  # row s: the parameters after s updates
        found = [first_reach(x, centred_fit(x, run[:-1], 0.2, 64 / batch), target)
                 for run in loss]
        assert np.mean(found) / exact == pytest.approx(1.0, abs=0.08), batch
        if batch == 4:
            decay = math.exp(-batch / 256)
            ema = []
            for run in loss:
                total = weight = 0.0
                for s, value in enumerate(run[:-1], start=1):
                    total, weight = decay * total + value, decay * weight + 1
                    if total / weight <= target:
                        ema.append(s)
                        break
            assert np.mean(ema) / exact > 1.15


def test_probes_interpolate_in_log_steps():
    from gnsweep.analysis.smoothing import interpolate_log_steps

    out = interpolate_log_steps(np.array([0.0, 3.0, np.nan]), np.array([1.0, 3.0, 9.0]),
                                np.array([0.0, 1.0, 3.0, 10.0]))
    assert out == pytest.approx([1.0, 2.0, 3.0, 3.0])  # log1p(1) is half of log1p(3)


def test_pooled_probes_recover_a_ratio_that_moves_linearly_in_log_steps():
    from gnsweep.analysis.smoothing import pooled_probes

    """B_simple rising linearly in log(1 + step) while |G|^2 falls as (1 + step)^-p: the pool is
    |G|^2-weighted, so it leans low by a few per cent when |G|^2 falls fast (p = 1: one e-fold
    per e-fold of steps) and hardly at all when it falls slowly (p = 0.3)."""
    steps = np.array([0.0, 1, 2, 4, 8, 16, 32, 64])
    b = 10.0 + 3.0 * np.log1p(steps)
    for p, tolerance in ((1.0, 0.06), (0.3, 0.02)):
        den = (1.0 + steps) ** -p
        out = pooled_probes(steps, b * den, den, steps, octaves=1.0)
        assert out == pytest.approx(b, rel=tolerance)
        assert np.all(out <= b * (1 + 1e-12))
