"""The linear-regression task: its closed-form G, Sigma, H against brute-force Monte Carlo."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.config import ConfigError
from gnsweep.tasks import linreg, make_task


def _monte_carlo(task: linreg.LinReg, model: torch.nn.Linear, n: int) -> dict[str, float]:
    """Per-example gradients written out by hand (`r x~`, in float64), their mean, covariance
    and the empirical Hessian `E[x~ x~^T]`: no use of the task's formulas."""
    x, y = task.sample(n, torch.Generator().manual_seed(7))
    x, y = x.double(), y.double()
    w, b = model.weight.detach().double().reshape(-1), float(model.bias.detach())
    residual = x @ w + b - y
    x_tilde = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
    grads = residual[:, None] * x_tilde
    g = grads.mean(0)
    sigma = torch.cov(grads.T)
    h = x_tilde.T @ x_tilde / n
    return {"loss": float(0.5 * (residual ** 2).mean()), "g2": float(g @ g),
            "trace_sigma": float(sigma.trace()), "g_h_g": float(g @ h @ g),
            "trace_h_sigma": float((h @ sigma).trace())}


@pytest.mark.parametrize("bias", [0.0, 0.8])
def test_truth_matches_monte_carlo(bias):
    task = linreg.make(linreg.Options(dim=6, condition=20.0, noise=0.7), seed=3)
    model = task.model()
    with torch.no_grad():
        model.bias.fill_(bias)
    truth = task.truth(model)
    mc = _monte_carlo(task, model, 400_000)
    for name, value in mc.items():
        assert getattr(truth, name) == pytest.approx(value, rel=0.02), name


def test_truth_at_the_optimum_has_no_signal():
    task = linreg.make(linreg.Options(dim=4), seed=0)
    model = task.model()
    with torch.no_grad():
        model.weight.copy_(task.w_star.float()[None])
        model.bias.zero_()
    truth = task.truth(model)
    assert truth.g2 == pytest.approx(0, abs=1e-10)
    assert truth.loss == pytest.approx(0.5 * 0.25, rel=1e-5)
    # tr(Sigma) = noise^2 tr(H) there.
    assert truth.trace_sigma == pytest.approx(0.25 * float(task.variances.sum() + 1), rel=1e-5)


def test_batches_and_loss():
    task = make_task("linreg", {"dim": 3}, seed=0)
    x, y = task.sample(5, torch.Generator().manual_seed(0))
    assert x.shape == (5, 3) and y.shape == (5,)
    model = task.model()
    loss = task.output_loss(model(x), y)
    assert loss.dim() == 0 and math.isfinite(float(loss.detach()))


@pytest.mark.parametrize("option", [{"dim": 0}, {"condition": 0.5}, {"noise": -1},
                                    {"eval_size": -1}, {"dim": "x"}])
def test_bad_options(option):
    with pytest.raises(ConfigError, match=r"task\."):
        linreg.Options(**option)


def test_sweep_and_listing():
    config = compose(["task=linreg", "sweep=linreg", "noise=hessian"])
    assert config.task.name == "linreg" and config.noise.hessian_every == 50
    result = CliRunner().invoke(app, ["tasks"])
    assert result.exit_code == 0 and "linreg" in result.output
