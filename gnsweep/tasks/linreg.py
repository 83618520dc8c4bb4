"""Linear regression with anisotropic Gaussian inputs and label noise: the noise scale is known
in closed form at any parameters, so measurements can be checked against the truth.

Data: `x ~ N(0, diag(lam))` with eigenvalues `lam` log-spaced from 1 down to 1/condition,
`y = w*.x + eps`, `eps ~ N(0, noise^2)`. Model: `nn.Linear(dim, 1)` (weights w, bias b), loss
`0.5 * mean((w.x + b - y)^2)`. With `x~ = (x, 1)`, `delta = (w - w*, b)`, the residual is
`r = delta.x~ - eps` and one example's gradient is `g = r x~`, so, writing `q = dw^T diag(lam) dw`,
`c = b`, `s2 = q + c^2 + noise^2` and `H = E[x~ x~^T] = diag(lam, 1)` (Isserlis' theorem for the
fourth moments of Gaussian x):

    G      = H delta                                   (true gradient)
    Sigma  = s2 H + G G^T - 2 c^2 e_b e_b^T             (per-example gradient covariance)
    tr Sigma     = s2 tr H + |G|^2 - 2 c^2
    tr(H Sigma)  = s2 tr H^2 + G^T H G - 2 c^2
    B_simple = tr Sigma / |G|^2  (eq. 2.9),   B_noise = tr(H Sigma) / G^T H G  (eq. 2.8)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gnsweep.tasks.options import LinregOptions

Options = LinregOptions
"""The task's settings (schema in gnsweep.tasks.options, importable without torch)."""


@dataclass(frozen=True)
class Truth:
    """Closed-form quantities at one parameter vector (see the module docstring)."""

    loss: float
    g2: float
    """|G|^2."""
    trace_sigma: float
    """tr(Sigma)."""
    g_h_g: float
    """G^T H G."""
    trace_h_sigma: float
    """tr(H Sigma)."""

    @property
    def b_simple(self) -> float:
        return self.trace_sigma / self.g2

    @property
    def b_noise(self) -> float:
        return self.trace_h_sigma / self.g_h_g


class LinReg:
    def __init__(self, options: Options, seed: int) -> None:
        self.options, self.seed = options, seed
        d = options.dim
        # Input variances from 1 down to 1/condition; the teacher is fixed (seed 0) so that
        # every run of a sweep learns the same function.
        self.variances = torch.logspace(0.0, -math.log10(options.condition), d,
                                        dtype=torch.float64)
        teacher = torch.Generator().manual_seed(0)
        self.w_star = torch.randn(d, generator=teacher, dtype=torch.float64)
        if options.teacher_power:
            self.w_star = self.w_star * self.variances ** (-options.teacher_power / 2)

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Linear(self.options.dim, 1)

    def sample(self, batch_size: int, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, self.options.dim, generator=generator, dtype=torch.float64)
        x = x * self.variances.sqrt()
        y = x @ self.w_star + self.options.noise * torch.randn(
            batch_size, generator=generator, dtype=torch.float64)
        return x.float(), y.float()

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return self.output_loss(model(x), y)

    @staticmethod
    def output_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`0.5 * mean((outputs - targets)^2)`: the `loss_fn(outputs, targets)` form that
        `NoiseScaleMonitor` and the framework integrations take."""
        return 0.5 * (outputs.reshape(targets.shape) - targets).pow(2).mean()

    def eval_loss(self, model: nn.Module) -> float:
        """The exact population loss `E[loss]` at the model's parameters (closed form, no
        sampling noise): `truth(model).loss`."""
        return self.truth(model).loss

    def truth(self, model: nn.Module) -> Truth:
        """Exact loss, |G|^2, tr(Sigma), G^T H G, tr(H Sigma) at the model's parameters."""
        linear = model.module if hasattr(model, "module") else model
        assert isinstance(linear, nn.Linear), "truth() needs the task's own nn.Linear model"
        dw = linear.weight.detach().cpu().double().reshape(-1) - self.w_star
        c = float(linear.bias.detach().double()) if linear.bias is not None else 0.0
        lam = self.variances
        h = torch.cat([lam, lam.new_ones(1)]) if linear.bias is not None else lam
        grad = torch.cat([lam * dw, dw.new_tensor([c])]) if linear.bias is not None else lam * dw
        q = float(dw @ (lam * dw))
        s2 = q + c * c + self.options.noise ** 2
        g2 = float(grad @ grad)
        ghg = float(grad @ (h * grad))
        return Truth(loss=0.5 * s2, g2=g2, trace_sigma=s2 * float(h.sum()) + g2 - 2 * c * c,
                     g_h_g=ghg, trace_h_sigma=s2 * float((h * h).sum()) + ghg - 2 * c * c)

    def precond_truth(self, model: nn.Module, p: torch.Tensor) -> tuple[float, float]:
        """`(G^T P G, tr(P Sigma))` at the model's parameters for a diagonal preconditioner P
        (`p`: its diagonal over (weight, bias), the optimizer's order). From Sigma above:
        `tr(P Sigma) = s2 sum(p h) + G^T P G - 2 c^2 p_b`; B_simple_P is their ratio."""
        linear = model.module if hasattr(model, "module") else model
        assert isinstance(linear, nn.Linear) and linear.bias is not None
        dw = linear.weight.detach().cpu().double().reshape(-1) - self.w_star
        c = float(linear.bias.detach().double())
        lam = self.variances
        h = torch.cat([lam, lam.new_ones(1)])
        grad = torch.cat([lam * dw, dw.new_tensor([c])])
        p = p.detach().cpu().double().reshape(-1)
        s2 = float(dw @ (lam * dw)) + c * c + self.options.noise ** 2
        gpg = float(grad @ (p * grad))
        return gpg, s2 * float((p * h).sum()) + gpg - 2 * c * c * float(p[-1])

    def exact_problem(self) -> Any:
        """This task from its initial parameters as a `gnsweep.linreg_exact.Problem` (the exact
        expected SGD dynamics: the test oracle)."""
        from gnsweep.linreg_exact import Problem

        model = self.model()
        assert isinstance(model, nn.Linear) and model.bias is not None
        d0 = torch.cat([model.weight.detach().double().reshape(-1) - self.w_star,
                        model.bias.detach().double()])
        return Problem.linreg(self.variances.numpy(), d0.numpy(), self.options.noise)


def make(options: Options, seed: int) -> LinReg:
    return LinReg(options, seed)
