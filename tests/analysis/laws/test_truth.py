"""Laws across scale against exact truth.

1. linreg's exact SGD dynamics (`gnsweep.linreg_exact`) give the expected loss after D examples
   at any (B, lr): a fixed-budget family over D whose exact fixed-budget critical batch size
   B_crit(D) is computed by bisection. The law fitted from a noisy coarse grid must hold the
   exact exponent in its 95% interval and predict the held-out largest budget within a factor
   1.5. Plain SGD at a fixed budget loses nothing to a smaller batch: the exact best batch size
   is the smallest, so every cell's B_opt is on the grid's edge and no B_opt law is fitted.
2. A landscape built with known optima B_opt = 0.5 D^0.5, lr_opt = 2 N^-0.5 D^0.2 (so the
   truth is known exactly, not taken from the code) and a skewed, non-quadratic valley: the
   fitted exponents must hold the true ones in their intervals, the held-out cell within 15%.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from gnsweep.analysis.laws.family import fixed_budget_laws
from gnsweep.linreg_exact import Problem

NOISE = 0.002
"""Relative noise on each run's final loss (seed-to-seed spread of a language model's final
loss is about 0.1-0.3%)."""
TOLERANCE = 0.01
BUDGETS = [2 ** k for k in range(12, 17)]


def _problem() -> Problem:
    rng = np.random.default_rng(0)
    lam = np.logspace(0, -2, 16)
    w = rng.standard_normal(16)
    return Problem.linreg(lam, np.concatenate([-w, [0.0]]), 0.5)


@pytest.fixture(scope="module")
def linreg_family() -> tuple[pd.DataFrame, np.ndarray]:
    problem = _problem()
    rng = np.random.default_rng(1)
    rows = []
    for d in BUDGETS:
        for b in [2.0 ** j for j in range(0, 12)]:
            if b > d / 8:
                continue
            top = problem.max_stable_lr(b)
            lrs = 0.95 * top * 2.0 ** (-np.arange(0, 12, 0.5))
            losses = problem.budget_loss(lrs, b, d) * (1 + NOISE * rng.standard_normal(len(lrs)))
            rows += [(1.0, float(d), b, lr, loss) for lr, loss in zip(lrs, losses, strict=True)]
    exact = np.array([problem.fixed_budget_bcrit(d, TOLERANCE) for d in BUDGETS])
    return pd.DataFrame(rows, columns=["N", "D", "batch_size", "learning_rate", "loss"]), exact


def test_exact_fixed_budget_optimum_is_the_smallest_batch():
    problem = _problem()
    best = [problem.best_budget_loss(b, 2 ** 13)[0] for b in (1, 2, 4, 8, 16, 32, 64)]
    assert np.all(np.diff(best) > 0)


def test_linreg_bcrit_law_recovers_the_exact_exponent(linreg_family):
    runs, exact = linreg_family
    result = fixed_budget_laws(runs, tolerance=TOLERANCE, bootstrap=300)
    # Every cell's best batch size is the grid's smallest: an edge, never a point of a law.
    assert result.cells["edge"].all()
    assert {r["quantity"] for r in result.refused} == {"batch_size", "learning_rate"}
    law = result.law("b_crit")
    assert law is not None and law.law.variables == ("D",)
    exact_exponent = np.polyfit(np.log(BUDGETS), np.log(exact), 1)[0]
    b = law.law.coefficients()["b"]
    assert b["low"] <= exact_exponent <= b["high"], (b, exact_exponent)
    assert b["high"] - b["low"] < 0.7  # an interval that says something
    held = law.held_out
    assert held["D"] == BUDGETS[-1]
    assert 1 / 1.5 < held["predicted"] / exact[-1] < 1.5, (held, exact[-1])
    # Each cell's B_crit from a grid in factors of 2 with noisy losses: within a factor 1.5.
    measured = result.cells.sort_values("D")["b_crit"].to_numpy()
    assert np.all(np.abs(np.log(measured / exact)) < math.log(1.5)), (measured, exact)


def _synthetic(rng: np.random.Generator) -> pd.DataFrame:
    rows = []
    for n in (1e6, 4e6, 16e6):
        for d in (1e8, 4e8, 16e8):
            b_opt, lr_opt = 0.5 * d ** 0.5, 2 * n ** -0.5 * d ** 0.2
            for b in 2.0 ** np.arange(9, 18):
                for lr in lr_opt * 2.0 ** np.arange(-4.3, 4, 1):
                    u, v = math.log(b / b_opt), math.log(lr / lr_opt)
                    shape = 1 + 0.01 * u * u + 0.02 * v * v + 0.003 * u * v + 0.001 * u ** 3
                    loss = 3 * (n / 1e6) ** -0.1 * shape * (1 + 0.001 * rng.standard_normal())
                    rows.append((n, d, b, lr, loss))
    return pd.DataFrame(rows, columns=["N", "D", "batch_size", "learning_rate", "loss"])


def test_known_optima_laws_recover_their_exponents():
    result = fixed_budget_laws(_synthetic(np.random.default_rng(2)), tolerance=0.005,
                               bootstrap=300)
    assert not result.cells["edge"].any()
    truth = {"batch_size": {"b": 0.5}, "learning_rate": {"a": -0.5, "b": 0.2}}
    for quantity, exponents in truth.items():
        law = result.law(quantity)
        # The form the data determine: B_opt does not depend on N, so N is left out.
        assert law is not None and law.law.form == ("c * D^b" if quantity == "batch_size"
                                                    else "c * N^a * D^b")
        coefficients = law.law.coefficients()
        assert set(coefficients) == {"c", *exponents}
        for name, value in exponents.items():
            assert coefficients[name]["low"] <= value <= coefficients[name]["high"], (
                quantity, name, coefficients[name])
        held = law.held_out
        true = (0.5 * held["D"] ** 0.5 if quantity == "batch_size"
                else 2 * held["N"] ** -0.5 * held["D"] ** 0.2)
        assert abs(held["predicted"] / true - 1) < 0.15
        assert held["predicted_low"] <= held["predicted"] <= held["predicted_high"]
    loss = result.held_out_loss
    assert loss is not None and loss["excess"] < 0.005


def test_a_step_law_shaped_grid_recovers_step_laws_exponents():
    """Optima at Step Law's B = 0.58 D^0.571, lr = 1.79 N^-0.713 D^0.307 (4 x 4 cells), a valley
    steeper towards large learning rates, divergence beyond, learning rates 2^0.5 apart, 0.1%
    noise and Step Law's 0.25% tolerance: every cell is located and the exponents recovered."""
    rng = np.random.default_rng(5)
    rows = []
    for n in (5e7, 1e8, 2e8, 4e8):
        for d in (1e9, 2e9, 4e9, 8e9):
            b_opt, lr_opt = 0.58 * d ** 0.571, 1.79 * n ** -0.713 * d ** 0.307
            for b in 2.0 ** np.arange(14, 23):
                for lr in lr_opt * 2.0 ** np.arange(-3.2, 3, 0.5):
                    u, v = math.log(b / b_opt), math.log(lr / lr_opt)
                    shape = 1 + 0.004 * u * u + 0.01 * v * v + 0.02 * max(v, 0) ** 3
                    loss = (2 + (n / 1e8) ** -0.2) * shape * (1 + 1e-3 * rng.standard_normal())
                    rows.append((n, d, b, lr, loss if v < 2.2 else math.nan))
    runs = pd.DataFrame(rows, columns=["N", "D", "batch_size", "learning_rate", "loss"])
    result = fixed_budget_laws(runs, tolerance=0.0025, bootstrap=200)
    assert not result.cells["edge"].any()
    truth = {"batch_size": {"b": 0.571}, "learning_rate": {"a": -0.713, "b": 0.307}}
    for quantity, exponents in truth.items():
        law = result.law(quantity)
        assert law is not None
        coefficients = law.law.coefficients()
        assert set(coefficients) == {"c", *exponents}, law.form_reason
        for name, value in exponents.items():
            assert coefficients[name]["low"] <= value <= coefficients[name]["high"]
        assert abs(law.held_out["ratio"] - 1) < 0.2
    # Following the laws at the held-out scale costs less than 0.2% of its best loss.
    loss = result.held_out_loss
    assert loss is not None and loss["excess"] < 0.002
