"""The exact expected SGD dynamics of linreg (gnsweep.linreg_exact) against sampled SGD runs and
against closed forms derived by hand (docs/truth.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gnsweep.linreg_exact import Problem, exact_truth, simulate_sgd


def _problem(noise: float = 0.5, bias: float = 0.7) -> tuple[Problem, np.ndarray]:
    delta0 = np.array([1.2, -0.8, 1.5, bias])
    return Problem.linreg(np.array([1.0, 0.3, 0.05]), delta0, noise), delta0


@pytest.mark.parametrize(("fraction", "batch"), [(0.3, 4), (0.5, 2)])
def test_recursion_matches_sampled_sgd(fraction, batch):
    """E[delta_i^2] and the expected loss of 40,000 explicit SGD runs, within 4.5 standard
    errors at every step, and the bias coordinate's own fourth moment is needed to get there.
    (Learning rates well inside the stability limit: near it the fourth moments, hence the
    standard errors, blow up.)"""
    problem, delta0 = _problem()
    lr = fraction * problem.max_stable_lr(batch)
    steps, runs = 25, 40_000
    _, pop, delta = simulate_sgd(problem, delta0, lr, batch, steps, runs,
                                 np.random.default_rng(0))
    exact = problem.moments(lr, batch, steps)
    se = pop[:, 1:].std(0) / math.sqrt(runs)
    assert np.all(np.abs(pop[:, 1:].mean(0) - problem.loss(exact[1:])) < 4.5 * se)
    sq = delta ** 2
    assert np.all(np.abs(sq.mean(0) - exact[-1]) < 4.5 * sq.std(0) / math.sqrt(runs))
    # Treating the bias input as Gaussian (fourth moment 3 instead of 1) is measurably wrong.
    wrong = Problem(problem.h, np.where(problem.a < 0, 1.0, problem.a), problem.m0, problem.noise)
    wrong_m = wrong.moments(lr, batch, steps)[-1]
    assert abs(sq[:, -1].mean() - wrong_m[-1]) > 6 * sq[:, -1].std() / math.sqrt(runs)


def test_loss_floor_matches_the_scalar_fixed_point():
    """Without a bias, the stationary m_i = lr (u + s^2) / (B (2 - lr h_i (1 + 1/B))) with
    u = h.m, so u = s^2 k / (1 - k), k = sum_i lr h_i / (B (2 - lr h_i (1 + 1/B))): the loss
    settles at 0.5 s^2 / (1 - k), above the floor s^2/2, and tends to it as lr -> 0."""
    lam = np.array([1.0, 0.4, 0.1])
    problem = Problem.linreg(lam, np.array([1.0, -1.0, 2.0]), 0.5, bias=False)
    for lr, batch in [(0.5, 4), (0.1, 1), (1.2, 64)]:
        k = float(np.sum(lr * lam / (batch * (2 - lr * lam * (1 + 1 / batch)))))
        floor = 0.5 * 0.25 / (1 - k)
        curve = problem.loss_curve(lr, batch, 4000)
        assert curve[-1] == pytest.approx(floor, rel=1e-9)
        assert floor > problem.floor
    assert problem.loss_curve(0.002, 8, 40_000)[-1] == pytest.approx(problem.floor, rel=1e-3)


def test_stability_limit_is_two_over_the_largest_eigenvalue_at_large_batch():
    problem, _ = _problem()
    top = 2 / problem.h.max()
    assert problem.max_stable_lr(1e9) == pytest.approx(top, rel=1e-6)
    assert np.isfinite(problem.loss_curve(0.99 * top, 1e9, 3000)[-1])
    assert problem.loss_curve(0.99 * top, 1e9, 3000)[-1] < problem.loss(problem.m0)
    assert problem.loss_curve(1.01 * top, 1e9, 3000)[-1] > 1e6
    # Gradient noise lowers the limit at small batches.
    assert problem.max_stable_lr(1) < 0.7 * top


def test_one_direction_without_label_noise_in_closed_form():
    """h = 1, Gaussian, no label noise: m' = ((1 - lr)^2 + 2 lr^2 / B) m, minimised by
    lr* = 1 / (1 + 2/B) with factor rho* = 2 / (B + 2) per step, and B_noise = 2 (eq. 2.8):
    one step of lr* keeps 1 - 1/(1 + B_noise/B) of the loss, the paper's dL_opt (eq. 2.7)."""
    problem = Problem.linreg(np.array([1.0]), np.array([2.0]), 0.0, bias=False)
    target = problem.loss(problem.m0) * 1e-3
    for batch in (1, 4, 32):
        steps, lr = problem.best_steps(batch, [target])
        rho = 2 / (batch + 2)
        assert lr[0] == pytest.approx(1 / (1 + 2 / batch), rel=2e-3)
        n = math.ceil(math.log(1e-3) / math.log(rho))
        before, after = rho ** (n - 1), rho ** n
        assert steps[0] == pytest.approx(n - 1 + (before - 1e-3) / (before - after), rel=1e-3)
        assert problem.b_noise(problem.m0) == pytest.approx(2.0)


def test_limits_and_the_hyperbola():
    """S(B) at the best lr approaches the GD limit S_min at large B and E_min / B at small B
    (lr = eta B, examples as time); the hyperbola S_min + E_min / B (eq. 2.11) describes the
    exact S(B) between them within a few per cent."""
    lam = np.logspace(0, -2, 8)
    problem = Problem.linreg(lam, np.random.default_rng(1).standard_normal(9) / np.sqrt(
        np.append(lam, 1.0)), 0.5)
    target = 2 * problem.floor
    s_min, e_min = problem.s_min(target), problem.e_min(target)
    big = problem.best_steps(1e7, [target])[0][0]
    assert big == pytest.approx(s_min, rel=0.01)
    small = problem.best_steps(0.01, [target], max_steps=2_000_000)[0][0]
    assert 0.01 * small == pytest.approx(e_min, rel=0.02)
    truth = exact_truth(problem, [2, 4, 8, 16, 32, 64, 128, 256, 1024], [target])
    fit = truth.per_target[0]
    assert fit.rmse_log < 0.05
    assert fit.b_crit_fit == pytest.approx(e_min / s_min, rel=0.25)


def test_noise_scales_are_ratios_of_expectations():
    """At a point mass (m = delta^2 of one parameter vector) they equal the task's closed forms
    (tasks/linreg.py docstring), written out here independently."""
    problem, delta = _problem(noise=0.6, bias=0.9)
    lam, c = problem.h[:-1], delta[-1]
    grad = problem.h * delta
    s2 = float(delta[:-1] @ (lam * delta[:-1])) + c * c + 0.36
    trace = s2 * problem.h.sum() + grad @ grad - 2 * c * c
    htrace = s2 * (problem.h ** 2).sum() + grad @ (problem.h * grad) - 2 * c * c
    m = delta ** 2
    assert problem.b_simple(m) == pytest.approx(trace / (grad @ grad))
    assert problem.b_noise(m) == pytest.approx(htrace / (grad @ (problem.h * grad)))
