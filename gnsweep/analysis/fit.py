"""The fit of the steps/examples tradeoff `(S/S_min - 1)(E/E_min - 1) = 1` (eq. 2.11).

With E = B*S this is `S = S_min + E_min/B`. We fit log S against log(S_min + E_min/B) by
nonlinear least squares, so errors are relative: a 10% miss at S = 20 weighs as much as a 10%
miss at S = 2000 (a fit on S itself would be ruled by the small batches' large step counts).
Parameters are log S_min and log E_min, which keeps both positive; standard errors come from the
Jacobian at the optimum, and B_crit = E_min/S_min (eq. 2.12) gets its error by the delta method.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import least_squares


class FitRefused(ValueError):
    """The points cannot support a fit; the message says why."""


@dataclass(frozen=True)
class HyperbolaFit:
    s_min: float
    s_min_se: float
    e_min: float
    e_min_se: float
    b_crit: float
    b_crit_se: float
    n_points: int
    rmse_log: float
    """Root-mean-square residual of log S."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def predict_steps(batch_size: np.ndarray, s_min: float, e_min: float) -> np.ndarray:
    """S(B) = S_min + E_min / B (eq. 2.11 with E = B S)."""
    return s_min + e_min / np.asarray(batch_size, float)


def fit_hyperbola(batch_size: np.ndarray, steps: np.ndarray) -> HyperbolaFit:
    """Fit S = S_min + E_min/B to (batch size, steps) on log S; needs >= 3 batch sizes."""
    b = np.asarray(batch_size, float)
    s = np.asarray(steps, float)
    ok = np.isfinite(b) & np.isfinite(s) & (b > 0) & (s > 0)
    b, s = b[ok], s[ok]
    if len(np.unique(b)) < 3:
        raise FitRefused(f"only {len(np.unique(b))} batch size(s) reached the target; "
                         "the fit needs at least 3")
    log_s = np.log(s)

    def residuals(theta: np.ndarray) -> np.ndarray:
        return log_s - np.log(np.exp(theta[0]) + np.exp(theta[1]) / b)

    start = np.log([max(s.min() * 0.5, 1e-9), max((b * s).min() * 0.5, 1e-9)])
    result = least_squares(residuals, start, method="lm")
    theta, jac, res = result.x, result.jac, result.fun
    dof = len(b) - 2
    sigma2 = float(res @ res) / dof if dof > 0 else math.nan
    try:
        cov = np.linalg.inv(jac.T @ jac) * sigma2
    except np.linalg.LinAlgError:
        cov = np.full((2, 2), math.nan)
    s_min, e_min = math.exp(theta[0]), math.exp(theta[1])
    var_log_bcrit = cov[0, 0] + cov[1, 1] - 2 * cov[0, 1]
    return HyperbolaFit(
        s_min=s_min, s_min_se=s_min * math.sqrt(max(cov[0, 0], 0)) if dof > 0 else math.nan,
        e_min=e_min, e_min_se=e_min * math.sqrt(max(cov[1, 1], 0)) if dof > 0 else math.nan,
        b_crit=e_min / s_min,
        b_crit_se=(e_min / s_min) * math.sqrt(max(var_log_bcrit, 0)) if dof > 0 else math.nan,
        n_points=len(b), rmse_log=float(np.sqrt(np.mean(res**2))),
    )
