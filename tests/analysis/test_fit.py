"""The fits recover known laws: eq. 2.11's hyperbola, eps_opt(B) (section 2), B_crit(L).

Ground truth is the formula the points are drawn from; standard errors are checked by how often
their intervals cover the truth over repeated draws.
"""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from gnsweep.analysis.fit import FitRefused, fit_hyperbola, predict_steps
from gnsweep.analysis.loss_scaling import fit_loss_scaling
from gnsweep.analysis.lr import eps_opt, fit_lr

BATCHES = np.array([8, 16, 32, 64, 128, 256, 512, 1024], float)
S_MIN, E_MIN = 800.0, 51_200.0  # B_crit = 64


def draw(rng, sigma=0.05, batches=BATCHES):
    return predict_steps(batches, S_MIN, E_MIN) * np.exp(rng.normal(0, sigma, len(batches)))


def test_exact_points_give_the_truth():
    fit = fit_hyperbola(BATCHES, predict_steps(BATCHES, S_MIN, E_MIN))
    assert fit.s_min == pytest.approx(S_MIN, rel=1e-6)
    assert fit.e_min == pytest.approx(E_MIN, rel=1e-6)
    assert fit.b_crit == pytest.approx(64.0, rel=1e-6)
    assert fit.rmse_log < 1e-6 and fit.dof == 6


def test_noisy_points_recover_the_truth_within_errors():
    fit = fit_hyperbola(BATCHES, draw(np.random.default_rng(1), sigma=0.03))
    for value, se, truth in ((fit.s_min, fit.s_min_se, S_MIN), (fit.e_min, fit.e_min_se, E_MIN),
                             (fit.b_crit, fit.b_crit_se, 64.0)):
        assert abs(value - truth) < 4 * se
        assert se < 0.2 * truth


def test_standard_errors_cover_the_truth_at_the_nominal_rate():
    """95% t-intervals (dof = n - 2) from the delta-method errors cover the truth ~95% of draws."""
    rng = np.random.default_rng(2026)
    n_draws, t = 400, stats.t.ppf(0.975, len(BATCHES) - 2)
    covered = {"s_min": 0, "e_min": 0, "b_crit": 0}
    truth = {"s_min": S_MIN, "e_min": E_MIN, "b_crit": E_MIN / S_MIN}
    for _ in range(n_draws):
        fit = fit_hyperbola(BATCHES, draw(rng, sigma=0.08))
        for name in covered:
            value, se = getattr(fit, name), getattr(fit, f"{name}_se")
            covered[name] += abs(value - truth[name]) <= t * se
    for name, count in covered.items():
        # Binomial sd at 95% over 400 draws is 1.1%; allow for the delta method's curvature.
        assert 0.90 <= count / n_draws <= 0.99, (name, count / n_draws)


def test_bootstrap_intervals_are_seeded_and_bracket_the_estimate():
    steps = draw(np.random.default_rng(3))
    a = fit_hyperbola(BATCHES, steps, bootstrap=300)
    b = fit_hyperbola(BATCHES, steps, bootstrap=300)
    assert a == b and a.n_bootstrap == 300
    for name in ("s_min", "e_min", "b_crit"):
        lo, hi, value, se = (getattr(a, f"{name}_lo"), getattr(a, f"{name}_hi"),
                             getattr(a, name), getattr(a, f"{name}_se"))
        assert lo < value < hi
        # Same order as the asymptotic 95% interval.
        assert 0.4 < (hi - lo) / (2 * 1.96 * se) < 2.5


def test_bootstrap_intervals_cover_the_truth_often():
    rng = np.random.default_rng(7)
    hits = sum(
        (lambda f: f.b_crit_lo <= 64.0 <= f.b_crit_hi)(
            fit_hyperbola(BATCHES, draw(rng, sigma=0.08), bootstrap=150, seed=i))
        for i in range(40))
    # Residual bootstraps with 8 points under-cover a little; far below 80% would be a bug.
    assert hits / 40 >= 0.8


@pytest.mark.parametrize("batches", [[8, 64], [32, 32, 32, 32], []])
def test_fewer_than_three_batch_sizes_are_refused(batches):
    steps = predict_steps(np.array(batches, float), S_MIN, E_MIN)
    with pytest.raises(FitRefused, match="at least 3"):
        fit_hyperbola(np.array(batches, float), steps)


def test_three_batch_sizes_fit_with_one_degree_of_freedom():
    b = np.array([8.0, 64.0, 512.0])
    fit = fit_hyperbola(b, draw(np.random.default_rng(4), batches=b))
    assert fit.dof == 1 and math.isfinite(fit.b_crit_se)


def bowl_grid(b_noise=100.0, eps_max=1.0, lrs=None, curvature=0.7, noise=0.0, seed=0):
    """Best learning rates located by a grid whose steps follow a known bowl around eps_opt(B):
    log S = log S(B) + c (log lr - log eps_opt(B))^2."""
    from gnsweep.analysis.front import best_per_batch

    rng = np.random.default_rng(seed)
    lrs = lrs if lrs is not None else np.geomspace(0.01, 4.0, 13)
    rows = []
    for b in BATCHES:
        best = eps_opt(b, eps_max, b_noise)
        for lr in lrs:
            steps = predict_steps(b, S_MIN, E_MIN) * math.exp(
                curvature * math.log(lr / best) ** 2 + rng.normal(0, noise))
            rows.append({"run_id": f"{b}_{lr}", "batch_size": int(b), "learning_rate": lr,
                         "seed": 0, "target": 1.0, "reached": True, "steps": steps,
                         "b_simple_at_target": np.nan, "b_simple_mean": np.nan})
    return best_per_batch(pd.DataFrame(rows))


def test_refined_best_learning_rate_is_the_bowls_vertex():
    best = bowl_grid()
    inside = best[~best["lr_on_edge"]]
    truth = eps_opt(inside["batch_size"].to_numpy(float), 1.0, 100.0)
    # A parabola in log-log through three points of an exact log-parabola is that parabola.
    np.testing.assert_allclose(inside["lr_opt"], truth, rtol=1e-9)


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_lr_fit_recovers_the_noise_scale(noise):
    best = bowl_grid(noise=noise, seed=5)
    inside = best[~best["lr_on_edge"]]
    fit = fit_lr(inside["batch_size"], inside["lr_opt"], "sgd")
    assert fit.b_noise == pytest.approx(100.0, rel=0.15 if noise else 1e-6)
    assert fit.eps_max == pytest.approx(1.0, rel=0.1 if noise else 1e-6)
    if noise:
        assert abs(fit.b_noise - 100.0) < 4 * fit.b_noise_se


def test_power_law_fit_recovers_alpha():
    b = BATCHES
    lr = eps_opt(b, 3e-3, 200.0, alpha=0.6)
    fit = fit_lr(b, lr, "power")
    assert fit.alpha == pytest.approx(0.6, rel=1e-4)
    assert fit.b_noise == pytest.approx(200.0, rel=1e-3)
    with pytest.raises(FitRefused, match="at least 4"):
        fit_lr(b[:3], lr[:3], "power")


def test_loss_scaling_recovers_the_power_law():
    losses = np.array([3.0, 2.5, 2.2, 2.0])
    b_crit = 2e8 / losses ** (1 / 0.21)
    fits = pd.DataFrame({"target": losses, "b_crit": b_crit, "b_crit_se": 0.05 * b_crit,
                         "refused": ""})
    row = fit_loss_scaling(fits).iloc[0]
    assert row["refused"] == ""
    assert row["b_star"] == pytest.approx(2e8, rel=1e-6)
    assert row["alpha_b"] == pytest.approx(0.21, rel=1e-6)
    one = fit_loss_scaling(fits.iloc[:1]).iloc[0]
    assert "at least 2" in one["refused"]
    # Two targets, one with an error 1e9 times its value (a sweep that only bounds B_crit): one
    # point weighs in the line, whose slope is then undetermined; refused, not raised.
    lopsided = pd.DataFrame({"target": [3.2, 3.0], "b_crit": [5.9e11, 2956.0],
                             "b_crit_se": [1.25e21, 91.3], "refused": ""})
    row = fit_loss_scaling(lopsided).iloc[0]
    assert "fewer than 2 points" in row["refused"] and math.isnan(row["b_star"])


def test_a_b_crit_beyond_the_batch_sizes_is_flagged():
    from gnsweep.analysis.pipeline import fit_quality

    assert fit_quality(64.0, 4.0, pd.Series(BATCHES)) == ""
    assert "above the largest batch size" in fit_quality(5000.0, 100.0, pd.Series([8, 16, 32]))
    assert "relative error" in fit_quality(64.0, 40.0, pd.Series(BATCHES))


@pytest.mark.parametrize("model", ["sgd", "power"])
def test_lr_fit_refuses_best_rates_without_a_bend(model):
    """Best rates exactly proportional to B (the linear-scaling regime, B << B_noise) have no
    bend to place: B_noise runs off along the fit's flat valley, and the fit says so instead of
    returning e^60 (or overflowing)."""
    b = np.array([8, 16, 32, 64, 128, 256])
    with pytest.raises(FitRefused, match="runs away"):
        fit_lr(b, 1e-4 * b, model)
