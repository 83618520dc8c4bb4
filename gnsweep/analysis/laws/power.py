"""Power laws across scale, fitted in log space: `y = c * N^a * D^b` (or one of N, D alone),
least squares on log y, with bootstrap intervals on every coefficient.

Each draw refits the law on one draw of every point (a cell's bootstrap of its optimum, or its
standard error) and adds the misfit of the law: sigma^2 drawn as RSS / chi^2(dof), then the
coefficients' normal spread sigma^2 (X^T X)^-1 given it (the posterior of a linear regression,
Student-t intervals in the limit). A residual bootstrap would be far too narrow with the three
to ten cells a family has. Seeded: reruns agree.

The form is the data's (`select_form`): a variable's exponent is kept where its interval
excludes 0 or it lowers the leave-one-out error (`loo_rmse`), else the law is refitted without
it.

Pure numpy; no files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

INTERVAL = (2.5, 97.5)
"""Percentiles of the bootstrap: a 95% interval."""


class LawRefused(ValueError):
    """The points cannot support the law; the message says why."""


@dataclass(frozen=True)
class PowerLaw:
    """A fitted `c * N^a * D^b` (the variables it has)."""

    quantity: str
    variables: tuple[str, ...]
    """"N", "D" or both, in that order."""
    log_coef: np.ndarray
    """(log c, exponents...) in the order of `variables`."""
    draws: np.ndarray = field(repr=False)
    """Bootstrap draws of log_coef, shape (n, 1 + len(variables))."""
    n_points: int
    rmse_log: float

    @property
    def names(self) -> tuple[str, ...]:
        return ("c", *(EXPONENT[v] for v in self.variables))

    @property
    def form(self) -> str:
        """`c * N^a * D^b` naming only the variables kept (`c` alone: a constant)."""
        return " * ".join(["c", *(f"{v}^{EXPONENT[v]}" for v in self.variables)])

    def coefficients(self) -> dict[str, dict[str, float]]:
        """name -> {value, low, high}; c in the quantity's unit, exponents as they are."""
        low, high = (np.percentile(self.draws, q, axis=0) for q in INTERVAL)
        out = {}
        for k, name in enumerate(self.names):
            value, lo, hi = self.log_coef[k], low[k], high[k]
            if k == 0:
                value, lo, hi = math.exp(value), math.exp(lo), math.exp(hi)
            out[name] = {"value": float(value), "low": float(lo), "high": float(hi)}
        return out

    def predict(self, n: float, d: float) -> tuple[float, float, float]:
        """(value, low, high) at (N, D): the law and the 95% interval of its draws."""
        row = _row(self.variables, n, d)
        value = math.exp(float(row @ self.log_coef))
        with np.errstate(over="ignore"):  # a draw far out gives inf: the interval says so
            spread = np.exp(self.draws @ row)
        low, high = np.percentile(spread, INTERVAL)
        return value, float(min(low, value)), float(max(high, value))


EXPONENT = {"N": "a", "D": "b", "L": "g"}
"""Step Law's names: lr = c N^a D^b, B = c D^b; and B_crit = c L^g for Kaplan et al. 2020's
B_crit(L) = B* / L^(1/alpha_B) against the target loss L (g = -1/alpha_B)."""


def _row(variables: tuple[str, ...], n: float, d: float) -> np.ndarray:
    """(1, log N?, log D?) -- a law in the target loss L has no D, and L takes D's place."""
    return np.array([1.0, *(math.log(n if v == "N" else d) for v in variables)])


def fit_power_law(quantity: str, variables: tuple[str, ...], n: np.ndarray, d: np.ndarray,
                  y: np.ndarray, point_draws: np.ndarray | None = None, *, bootstrap: int = 200,
                  seed: int = 0) -> PowerLaw:
    """Least squares of log y on (1, log N?, log D?); `point_draws` (n_draws, n_points) are
    draws of log y per point (None: the points are exact but for the fit's residuals).

    Needs more points than coefficients (a residual to judge the fit by) and every variable
    taking at least two values.
    """
    n, d, y = (np.asarray(v, float) for v in (n, d, y))
    for name, values in (("N", n), ("D", d)):
        if name in variables and len(np.unique(values)) < 2:
            raise LawRefused(f"{name} takes one value only")
    k = 1 + len(variables)
    if len(y) <= k:
        raise LawRefused(f"{len(y)} usable cell(s) for {k} coefficients; the fit needs at "
                         f"least {k + 1}")
    design = np.stack([_row(variables, a, b) for a, b in zip(n, d, strict=True)])
    log_y = np.log(y)
    coef, *_ = np.linalg.lstsq(design, log_y, rcond=None)
    residuals = log_y - design @ coef
    dof = len(y) - k
    rss = float(residuals @ residuals)
    unscaled = np.linalg.inv(design.T @ design)
    rng = np.random.default_rng(seed)
    n_draws = max(bootstrap, 1)
    if point_draws is None:
        base = np.broadcast_to(coef, (n_draws, k))
    else:  # one least squares for every draw of the points at once
        rows = point_draws[np.arange(n_draws) % len(point_draws)]
        base = np.linalg.lstsq(design, rows.T, rcond=None)[0].T
    # The misfit: sigma^2 ~ RSS / chi2(dof), then the coefficients' normal spread given it
    # (the posterior of a linear regression), so that few cells give wide intervals.
    sigma = np.sqrt(rss / rng.chisquare(dof, n_draws))
    chol = np.linalg.cholesky(unscaled + 1e-300 * np.eye(k))
    draws = base + sigma[:, None] * (rng.standard_normal((n_draws, k)) @ chol.T)
    if bootstrap <= 0:
        draws[:] = coef
    return PowerLaw(quantity=quantity, variables=variables, log_coef=coef, draws=draws,
                    n_points=len(y), rmse_log=float(np.sqrt(np.mean(residuals ** 2))))


def loo_rmse(variables: tuple[str, ...], n: np.ndarray, d: np.ndarray, y: np.ndarray) -> float:
    """Leave-one-out cross-validated error of the law (root mean square in log y): each point
    predicted by the law fitted without it, by the hat matrix (e_i / (1 - h_ii)). Infinite
    when a point alone determines a coefficient (h_ii = 1)."""
    design = np.stack([_row(variables, a, b) for a, b in zip(n, d, strict=True)])
    log_y = np.log(np.asarray(y, float))
    coef, *_ = np.linalg.lstsq(design, log_y, rcond=None)
    hat = np.einsum("ij,jk,ik->i", design, np.linalg.pinv(design.T @ design), design)
    if (hat > 1 - 1e-9).any():
        return math.inf
    return float(np.sqrt(np.mean(((log_y - design @ coef) / (1 - hat)) ** 2)))


def select_form(quantity: str, variables: tuple[str, ...], n: np.ndarray, d: np.ndarray,
                y: np.ndarray, point_draws: np.ndarray | None = None, *, bootstrap: int = 200,
                seed: int = 0) -> tuple[PowerLaw, list[str]]:
    """The law in the form the data determine: a variable's exponent is kept where its 95%
    interval excludes 0, or where keeping it lowers the leave-one-out error (`loo_rmse`);
    otherwise the law is refitted without it (the least determined first, one at a time).
    Returns the law and one sentence per variable saying why it was kept or left out."""
    law = fit_power_law(quantity, variables, n, d, y, point_draws, bootstrap=bootstrap,
                        seed=seed)
    reasons: dict[str, str] = {}
    by_error: set[str] = set()  # kept for the leave-one-out error alone
    while True:
        coefficients = law.coefficients()
        undetermined = []
        for v in law.variables:
            coef = coefficients[EXPONENT[v]]
            interval = (f"{EXPONENT[v]} = {coef['value']:.3g} [{coef['low']:.3g}, "
                        f"{coef['high']:.3g}]")
            if coef["low"] > 0 or coef["high"] < 0:
                reasons[v] = f"{v} kept: its exponent {interval} excludes 0"
            elif v not in by_error:
                width = max(coef["high"] - coef["low"], 1e-300)
                undetermined.append((abs(coef["value"]) / width, v, interval))
        if not undetermined:
            break
        _, weakest, interval = min(undetermined)
        reduced = tuple(v for v in law.variables if v != weakest)
        with_it, without = loo_rmse(law.variables, n, d, y), loo_rmse(reduced, n, d, y)
        if with_it < without:
            by_error.add(weakest)
            reasons[weakest] = (f"{weakest} kept: its exponent {interval} includes 0, but it "
                                f"lowers the leave-one-out error (rms log {with_it:.3g} with "
                                f"it, {without:.3g} without)")
            continue
        reasons[weakest] = (f"{weakest} left out: its exponent {interval} includes 0 and "
                            f"leaving it out does not raise the leave-one-out error (rms log "
                            f"{with_it:.3g} with it, {without:.3g} without)")
        law = fit_power_law(quantity, reduced, n, d, y, point_draws, bootstrap=bootstrap,
                            seed=seed)
    return law, [reasons[v] for v in variables if v in reasons]
