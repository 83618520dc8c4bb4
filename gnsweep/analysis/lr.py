"""The optimal learning rate against batch size, and the noise scale it implies.

For SGD the paper's quadratic model gives `eps_opt(B) = eps_max / (1 + B_noise/B)` (section 2);
Adam-like optimizers grow like B^alpha, alpha in [0.5, 1], then level off, which we write as the
saturating power law `eps_opt(B) = eps_max / (1 + (B_noise/B)^alpha)` (alpha = 1 is SGD's law).
Both are fitted on log lr (relative errors) to the refined best learning rate of every batch size
whose best learning rate is not on an edge of the grid: an edge is a bound, not a measurement.

Adam's best learning rate may instead peak and fall (Li et al. 2024, "Surge Phenomenon in
Optimal Learning Rate and Batch Size Scaling"): `eps_opt(B) = eps_max / (1/2 (sqrt(B_noise/B) +
sqrt(B/B_noise)))`, largest at B = B_noise (model "surge"). The forms are compared by AICc on
the log residuals (`aic`), and each target's `form` names the one with the lowest among those
fitted (a refused fit takes no part).

A fit is an answer only inside its physical range (`analysis.bounds`): B_noise inside the
support of the batch sizes fitted with an error below its value, and for the power law alpha in
ALPHA_RANGE with an error below its value; otherwise a bound at the grid's edge, or refused, with
the reason (`status`, `refused`) and NaN parameters.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from gnsweep import lr_law
from gnsweep.analysis.bounds import FIT, REFUSED, judge_scale
from gnsweep.analysis.fit import FitRefused, least_squares_fit
from gnsweep.tables import columns

LR_FIT_COLUMNS = columns("lr_fits")
MODELS = ("sgd", "power", "surge")
RUNAWAY = 1000.0
"""A fitted B_noise more than this factor outside the measured batch sizes is a fit running
off along its flat valley, not a value."""
ALPHA_RANGE = (0.2, 2.0)
"""Plausible exponents of the power law: Adam-like optimizers grow like B^alpha with alpha
between 0.5 and 1 (DESIGN.md), SGD's law is alpha = 1; far outside, the fit is bending a
law with no bend in the points (an alpha of -17 is not an optimizer)."""


@dataclass(frozen=True)
class LrFit:
    model: str
    n_points: int
    eps_max: float
    eps_max_se: float
    b_noise: float
    b_noise_se: float
    alpha: float
    alpha_se: float
    rmse_log: float
    aic: float = math.nan
    """AICc of the fit on log lr (`aicc`): the lower, the better the form."""
    status: str = FIT
    """`analysis.bounds.STATUSES`: whether B_noise (and alpha) stand, bound or are refused."""
    reason: str = ""
    """Why not a fit ("" for one); the parameters are still the raw optimum, for diagnosis."""
    b_noise_bound: float = math.nan
    """The grid edge B_noise is above (lower_bound) or below (upper_bound)."""


def eps_opt(batch_size: np.ndarray, eps_max: float, b_noise: float, alpha: float = 1.0
            ) -> np.ndarray:
    """eps_opt(B) = eps_max / (1 + (B_noise/B)^alpha) (`lr_law.eps_opt`), one per batch size."""
    return np.asarray(lr_law.eps_opt(np.asarray(batch_size, float), eps_max, b_noise, alpha))


def eps_opt_surge(batch_size: np.ndarray, eps_max: float, b_noise: float) -> np.ndarray:
    """eps_opt(B) = eps_max / (1/2 (sqrt(B_noise/B) + sqrt(B/B_noise))) (Li et al. 2024): the
    best learning rate peaks at B = B_noise and falls after it."""
    b = np.asarray(batch_size, float)
    return eps_max / (0.5 * (np.sqrt(b_noise / b) + np.sqrt(b / b_noise)))


def aicc(residuals: np.ndarray, n_params: int) -> float:
    """Akaike's criterion with the small-sample correction, from least-squares residuals
    (Gaussian errors of log lr): n log(RSS/n) + 2k + 2k(k+1)/(n-k-1); NaN for n <= k + 1."""
    n = len(residuals)
    rss = float(residuals @ residuals)
    if n <= n_params + 1:
        return math.nan
    rss = max(rss, 1e-300)  # a perfect fit: the criterion's floor, not -inf
    return n * math.log(rss / n) + 2 * n_params + 2 * n_params * (n_params + 1) / (
        n - n_params - 1)


def fit_lr(batch_size: np.ndarray, lr: np.ndarray, model: str = "sgd") -> LrFit:
    """Fit eps_opt(B) to best learning rates; sgd and surge need >= 3 batch sizes, power
    >= 4."""
    b = np.asarray(batch_size, float)
    y = np.asarray(lr, float)
    ok = np.isfinite(b) & np.isfinite(y) & (b > 0) & (y > 0)
    b, log_y = b[ok], np.log(y[ok])
    n_params = 3 if model == "power" else 2
    if len(np.unique(b)) < n_params + 1:
        raise FitRefused(f"{len(np.unique(b))} batch size(s) with a best learning rate inside "
                         f"the grid; the {model} model needs at least {n_params + 1}")

    def residuals(theta: np.ndarray) -> np.ndarray:
        if model == "surge":  # log(1/2 (e^(u/2) + e^(-u/2))) = log cosh(u/2), u = log(Bn/B)
            u = 0.5 * (theta[1] - np.log(b))
            return log_y - (theta[0] - (np.logaddexp(u, -u) - math.log(2.0)))
        alpha = theta[2] if n_params == 3 else 1.0
        return log_y - (theta[0] - np.logaddexp(0.0, alpha * (theta[1] - np.log(b))))

    # The cost has flat valleys (B_noise far outside the batch range): start from several
    # B_noise across and beyond the measured range and keep the best optimum.
    best = None
    for log_bn in np.log(b.min()) + np.linspace(-2, 2, 9) * max(np.ptp(np.log(b)), 1.0) / 2:
        start = [log_y.max() + 0.5, log_bn] + ([1.0] if n_params == 3 else [])
        try:
            theta, cov, res = least_squares_fit(residuals, np.array(start), len(b))
        except (ValueError, np.linalg.LinAlgError):
            continue
        if best is None or res @ res < best[2] @ best[2] - 1e-12:
            best = (theta, cov, res)
    if best is None:
        raise FitRefused("the learning-rate fit did not converge")
    theta, cov, res = best
    lo, hi = np.log(b.min() / RUNAWAY), np.log(b.max() * RUNAWAY)
    if not (lo < theta[1] < hi and abs(theta[0]) < 700):
        # B_noise runs off far outside the measured batch sizes: the best rates never level
        # off, or never rise, there, so the law has no bend to place (only a bound).
        raise FitRefused(f"the learning-rate fit runs away (B_noise beyond {RUNAWAY:g}x the "
                         "measured batch sizes): the best rates show no bend inside them")
    se = np.sqrt(np.clip(np.diag(cov), 0, None))
    eps_max, b_noise = math.exp(theta[0]), math.exp(theta[1])
    alpha = float(theta[2]) if n_params == 3 else 1.0
    alpha_se = float(se[2]) if n_params == 3 else 0.0
    verdict = judge_scale("B_noise(lr)", b_noise, b_noise * se[1], float(b.min()), float(b.max()))
    reason, status = verdict.reason, verdict.status
    if status in (FIT, REFUSED) and n_params == 3:
        if not ALPHA_RANGE[0] <= alpha <= ALPHA_RANGE[1]:
            status, reason = REFUSED, (
                f"alpha {alpha:.2g} is outside its plausible range {ALPHA_RANGE[0]:g}.."
                f"{ALPHA_RANGE[1]:g}: the best learning rates show no saturating growth")
        elif not alpha_se < alpha:
            status, reason = REFUSED, ("alpha's standard error is larger than its value: the "
                                       "points do not place it")
    return LrFit(model=model, n_points=len(b), eps_max=eps_max, eps_max_se=eps_max * se[0],
                 b_noise=b_noise, b_noise_se=b_noise * se[1], alpha=alpha, alpha_se=alpha_se,
                 rmse_log=float(np.sqrt(np.mean(res**2))), aic=aicc(res, n_params),
                 status=status, reason=reason, b_noise_bound=verdict.bound)


def fit_lr_table(front: pd.DataFrame, targets: list[float]) -> pd.DataFrame:
    """Every model at every target, from the front's `lr_opt` off the grid's edges."""
    rows = []
    for target in targets:
        points = front[(front["target"] == target) & ~front["lr_on_edge"].astype(bool)]
        for model in MODELS:
            row: dict = dict.fromkeys(LR_FIT_COLUMNS, math.nan)
            row.update(target=target, model=model, n_points=len(points), refused="",
                       status=REFUSED)
            try:
                fit = fit_lr(points["batch_size"].to_numpy(), points["lr_opt"].to_numpy(), model)
            except FitRefused as err:
                row["refused"] = str(err)
            else:
                # A bound or a refusal keeps only how well the law ran through the points; its
                # parameters stay NaN and it takes no part in choosing the form.
                row.update(n_points=fit.n_points, status=fit.status, refused=fit.reason,
                           b_noise_bound=fit.b_noise_bound, rmse_log=fit.rmse_log)
                if fit.status == FIT:
                    row.update({k: v for k, v in asdict(fit).items()
                                if k in row and k != "refused"})
            rows.append(row)
        _choose_form(rows[-len(MODELS):])
    return pd.DataFrame(rows, columns=LR_FIT_COLUMNS)


def _choose_form(rows: list[dict]) -> None:
    """Every row of one target gets `form`: the fitted model with the lowest AICc, or "" when
    none was fitted (each refused, or too few points for the criterion)."""
    fitted = [r for r in rows if not r["refused"] and np.isfinite(r["aic"])]
    form = min(fitted, key=lambda r: r["aic"])["model"] if fitted else ""
    for row in rows:
        row["form"] = form
