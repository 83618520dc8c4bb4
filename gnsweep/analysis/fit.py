"""The fit of the steps/examples tradeoff `(S/S_min - 1)(E/E_min - 1) = 1` (eq. 2.11).

With E = B*S this is `S = S_min + E_min/B`. We fit log S against log(S_min + E_min/B) by
nonlinear least squares, so errors are relative: a 10% miss at S = 20 weighs as much as a 10%
miss at S = 2000 (a fit on S itself would be ruled by the small batches' large step counts).
Parameters are log S_min and log E_min, which keeps both positive; standard errors come from the
Jacobian at the optimum, and B_crit = E_min/S_min (eq. 2.12) gets its error by the delta method.

Every fit carries its verdict (`analysis.bounds`): B_crit is an answer only inside the support of
the batch sizes fitted, with an error below its value and S_min, E_min below the fewest steps and
examples measured (the hyperbola's asymptotes); otherwise a bound at the grid's edge or refused,
with the reason. The raw numbers stay in the dataclass for diagnosis; tables show the verdict.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np
from scipy.optimize import least_squares

from gnsweep.analysis.bounds import LOWER_BOUND, UPPER_BOUND, Verdict, judge_scale, refused

Bounds = tuple[np.ndarray, np.ndarray]
"""Batch sizes and the log steps the curve must reach at least there (`fit_hyperbola`)."""
NO_BOUNDS: Bounds = (np.empty(0), np.empty(0))


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
    dof: int = 0
    max_abs_resid_log: float = math.nan
    n_bootstrap: int = 0
    s_min_lo: float = math.nan
    s_min_hi: float = math.nan
    e_min_lo: float = math.nan
    e_min_hi: float = math.nan
    b_crit_lo: float = math.nan
    b_crit_hi: float = math.nan
    """95% bootstrap intervals (NaN without a bootstrap)."""
    status: str = "fit"
    """`analysis.bounds.STATUSES`: fit, lower_bound, upper_bound or refused."""
    reason: str = ""
    """Why B_crit is a bound or refused ("" for a fit); never quotes a runaway value."""
    b_crit_bound: float = math.nan
    """The grid edge B_crit is above (lower_bound) or below (upper_bound); NaN otherwise."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def least_squares_fit(residuals, start: np.ndarray, n_points: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nonlinear least squares: optimum, covariance sigma^2 (J^T J)^-1 (NaN without dof), residuals.
    """
    result = least_squares(residuals, start, method="lm")
    dof = n_points - len(start)
    sigma2 = float(result.fun @ result.fun) / dof if dof > 0 else math.nan
    cov = np.linalg.inv(result.jac.T @ result.jac) * sigma2
    return result.x, cov, result.fun


ASYMPTOTE_SLACK = 1.5
"""S_min above this many times the fewest steps measured (or E_min above the fewest examples) is
non-physical: S >= S_min and E >= E_min at every batch size (eq. 2.11)."""


def judge_hyperbola(s_min: float, e_min: float, b_crit: float, b_crit_se: float,
                    batch_size: np.ndarray, steps: np.ndarray, unit: str = "") -> Verdict:
    """The verdict on a fit of eq. 2.11 to (batch_size, steps) (`analysis.bounds.judge_scale`,
    after S_min and E_min are checked against the asymptotes they must lie below)."""
    b, s = np.asarray(batch_size, float), np.asarray(steps, float)
    if not all(math.isfinite(x) and x > 0 for x in (s_min, e_min)):
        verdict = judge_scale("B_crit", b_crit, b_crit_se, float(b.min()), float(b.max()), unit)
        # A runaway to a bound drives S_min (or E_min) to 0 or inf: the bound is still the answer.
        return verdict if verdict.status in (LOWER_BOUND, UPPER_BOUND) else refused(
            "the fit's S_min or E_min is not a positive finite number: non-physical")
    if s_min > ASYMPTOTE_SLACK * s.min() or e_min > ASYMPTOTE_SLACK * (b * s).min():
        return refused("the fit puts S_min or E_min above the fewest steps or examples measured "
                       "(they are the hyperbola's asymptotes): non-physical; the points do not "
                       "follow eq. 2.11")
    return judge_scale("B_crit", b_crit, b_crit_se, float(b.min()), float(b.max()), unit)


def predict_steps(batch_size: np.ndarray, s_min: float, e_min: float) -> np.ndarray:
    """S(B) = S_min + E_min / B (eq. 2.11 with E = B S)."""
    return s_min + e_min / np.asarray(batch_size, float)


def fit_hyperbola(batch_size: np.ndarray, steps: np.ndarray, bootstrap: int = 0,
                  seed: int = 0, at_least: tuple[np.ndarray, np.ndarray] | None = None
                  ) -> HyperbolaFit:
    """Fit S = S_min + E_min/B (eq. 2.11) on log S; needs >= 3 batch sizes.

    `at_least`: (batch sizes, steps) that the curve must reach at least there: batch sizes that
    did not reach the target in that many steps. Each is a one-sided residual, log steps -
    log S(B) where the curve passes below it and 0 where it passes above (a censored point in
    a Tobit-like least squares): a bound informs the fit without pretending to be a point.

    Standard errors: covariance sigma^2 (J^T J)^-1 of (log S_min, log E_min) with
    sigma^2 = RSS/(n-2), mapped to S_min and E_min by the delta method; log B_crit =
    log E_min - log S_min (eq. 2.12) gets var = var_S + var_E - 2 cov. `bootstrap` > 0 adds 95%
    percentile intervals from that many residual-resampling refits (seeded: reruns agree).
    """
    b = np.asarray(batch_size, float)
    s = np.asarray(steps, float)
    bound_b, bound_s = (np.asarray(x, float) for x in (at_least or NO_BOUNDS))
    usable = np.isfinite(bound_b) & np.isfinite(bound_s) & (bound_b > 0) & (bound_s > 0)
    bounds: Bounds = (bound_b[usable], np.log(bound_s[usable]))
    ok = np.isfinite(b) & np.isfinite(s) & (b > 0) & (s > 0)
    # Reached before the first update (S = 0: the initial loss already meets the target): a
    # point of the front, but one that says nothing about the tradeoff; named, not dropped.
    at_start = np.unique(b[np.isfinite(b) & (s <= 0)])
    b, s = b[ok], s[ok]
    if len(np.unique(b)) < 3:
        start = (f" ({len(at_start)} more met it before the first update, at 0 steps: the "
                 "initial loss already meets it; choose a harder target)"
                 if len(at_start) else "")
        raise FitRefused(f"only {len(np.unique(b))} batch size(s) reached the target after "
                         f"training{start}; the fit needs at least 3")
    try:
        theta, jac, res = _solve(b, np.log(s), bounds)
    except (ValueError, np.linalg.LinAlgError) as err:
        raise FitRefused(f"the fit did not converge ({err})") from None
    dof = len(b) - 2
    # Active bounds add misfit (sigma^2), not points (dof); the points' residuals describe them.
    sigma2 = float(res @ res) / dof if dof > 0 else math.nan
    res = res[:len(b)]
    try:
        cov = np.linalg.inv(jac.T @ jac) * sigma2
    except np.linalg.LinAlgError:
        cov = np.full((2, 2), math.nan)
    # A fit running off along a flat valley can leave log S_min or log E_min beyond exp's range.
    s_min, e_min, b_crit = (_exp(x) for x in (theta[0], theta[1], theta[1] - theta[0]))
    var_log_bcrit = cov[0, 0] + cov[1, 1] - 2 * cov[0, 1]
    b_crit_se = b_crit * math.sqrt(max(var_log_bcrit, 0)) if dof > 0 else math.nan
    verdict = judge_hyperbola(s_min, e_min, b_crit, b_crit_se, b, s)
    fit = HyperbolaFit(
        s_min=s_min, s_min_se=s_min * math.sqrt(max(cov[0, 0], 0)) if dof > 0 else math.nan,
        e_min=e_min, e_min_se=e_min * math.sqrt(max(cov[1, 1], 0)) if dof > 0 else math.nan,
        b_crit=b_crit, b_crit_se=b_crit_se,
        n_points=len(b), rmse_log=float(np.sqrt(np.mean(res**2))), dof=dof,
        max_abs_resid_log=float(np.abs(res).max()), status=verdict.status,
        reason=verdict.reason, b_crit_bound=verdict.bound,
    )
    if bootstrap > 0 and verdict.fitted:
        fit = _bootstrap(fit, b, np.log(s) - res, res, bootstrap, seed, bounds)
    return fit


def _exp(x: float) -> float:
    """exp(x), inf beyond float range (math.exp raises OverflowError), NaN for NaN."""
    return math.exp(x) if x < 700 else (math.inf if x == x else math.nan)


def _solve(b: np.ndarray, log_s: np.ndarray, bounds: Bounds = NO_BOUNDS
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least squares in (log S_min, log E_min); returns the optimum, Jacobian and residuals (the
    points' first, then the bounds' one-sided ones)."""
    bound_b, bound_log_s = bounds

    def residuals(theta: np.ndarray) -> np.ndarray:
        fitted = log_s - np.log(np.exp(theta[0]) + np.exp(theta[1]) / b)
        if not len(bound_b):
            return fitted
        short = bound_log_s - np.log(np.exp(theta[0]) + np.exp(theta[1]) / bound_b)
        return np.concatenate([fitted, np.maximum(short, 0.0)])

    s = np.exp(log_s)
    # Start from the asymptotes: S_min below the fewest steps, E_min below the fewest examples.
    start = np.log([max(s.min() * 0.5, 1e-9), max((b * s).min() * 0.5, 1e-9)])
    result = least_squares(residuals, start, method="lm")
    return result.x, result.jac, result.fun


def _bootstrap(fit: HyperbolaFit, b: np.ndarray, fitted_log_s: np.ndarray, res: np.ndarray,
               n: int, seed: int, bounds: Bounds = NO_BOUNDS) -> HyperbolaFit:
    """Residual bootstrap: refit fitted + resampled residuals (scaled to unbiased variance).

    Resampling residuals, not points, keeps every batch size in every resample: with 3 to 10
    points a case bootstrap often draws fewer than 3 distinct batch sizes.
    """
    dof = len(b) - 2
    if dof <= 0:
        return fit
    rng = np.random.default_rng(seed)
    scaled = (res - res.mean()) * math.sqrt(len(b) / dof)
    draws = np.empty((n, 2))
    for i in range(n):
        theta, _, _ = _solve(b, fitted_log_s + rng.choice(scaled, len(b), replace=True),
                             bounds)
        draws[i] = theta
    s_min, e_min = np.exp(draws[:, 0]), np.exp(draws[:, 1])
    b_crit = e_min / s_min
    q = (2.5, 97.5)
    (s_lo, s_hi), (e_lo, e_hi), (c_lo, c_hi) = (np.percentile(x, q) for x in (s_min, e_min,
                                                                             b_crit))
    return replace(fit, n_bootstrap=n, s_min_lo=float(s_lo), s_min_hi=float(s_hi),
                   e_min_lo=float(e_lo), e_min_hi=float(e_hi), b_crit_lo=float(c_lo),
                   b_crit_hi=float(c_hi))
