"""B_crit against the loss: `B_crit(L) = B* / L^(1/alpha_B)` (Kaplan et al. 2020).

A straight line in (log L, log B_crit): log B_crit = log B* - (1/alpha_B) log L, weighted by
1/se(log B_crit)^2 where every target's fit has an error, unweighted otherwise.

Only fitted B_crits enter (a bound or a refusal has `refused` set and a NaN B_crit); a line
whose B* or alpha_B is not a finite number, or whose slope has a standard error larger than
itself, is refused with the reason: extrapolated to L = 1 a noisy slope gives any B* (3e+209 was
seen). B* itself is an extrapolation wherever the targets lie far from L = 1, so its error is
large even for a well-determined slope; it is printed as a factor then.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gnsweep.tables import columns

LOSS_SCALING_COLUMNS = columns("loss_scaling")


def fit_loss_scaling(fits: pd.DataFrame) -> pd.DataFrame:
    """One row: B* and alpha_B with standard errors, from the targets that have a fit."""
    row: dict = dict.fromkeys(LOSS_SCALING_COLUMNS, math.nan)
    row["refused"] = ""
    ok = fits[(fits["refused"].astype(str) == "") & np.isfinite(fits["b_crit"].astype(float))
              & (fits["b_crit"] > 0) & (fits["target"] > 0)]
    if "bcrit_status" in fits:
        ok = ok[ok["bcrit_status"].astype(str).isin(("fit", ""))]
    row["n_targets"] = len(ok)
    if len(ok) < 2:
        bounds = (int(fits["bcrit_status"].astype(str).isin(("lower_bound", "upper_bound")).sum())
                  if "bcrit_status" in fits else 0)
        also = f" ({bounds} more only bound it)" if bounds else ""
        row["refused"] = (f"{len(ok)} target(s) with a fitted B_crit{also}; B_crit(L) needs at "
                          "least 2")
        return pd.DataFrame([row], columns=LOSS_SCALING_COLUMNS)
    x = np.log(ok["target"].to_numpy(float))
    y = np.log(ok["b_crit"].to_numpy(float))
    if np.ptp(x) == 0:
        row["refused"] = "all targets are equal"
        return pd.DataFrame([row], columns=LOSS_SCALING_COLUMNS)
    rel = (ok["b_crit_se"] / ok["b_crit"]).to_numpy(float)
    weighted = bool(np.all(np.isfinite(rel) & (rel > 0)))
    w = 1.0 / rel**2 if weighted else np.ones(len(x))
    design = np.column_stack([np.ones_like(x), x])
    normal = design.T @ (design * w[:, None])
    if not np.all(np.isfinite(normal)) or np.linalg.cond(normal) > 1e12:
        # One target's error dwarfs the others' (a B_crit of 1e11 +- 1e21): the weighted line
        # rests on a single point and its slope is undetermined.
        row["refused"] = ("the targets' B_crit errors leave fewer than 2 points that weigh "
                          "in the line")
        return pd.DataFrame([row], columns=LOSS_SCALING_COLUMNS)
    cov = np.linalg.inv(normal)
    coef = cov @ design.T @ (w * y)
    res = y - design @ coef
    dof = len(x) - 2
    if dof > 0:
        # Scale by the reduced chi^2: the targets' errors are estimates, not known variances.
        cov = cov * float(w @ res**2) / dof
    # Two targets fix the line exactly: its error is then the targets' own B_crit errors carried
    # through (unknown without them), so that two noisy B_crit never give a line to trust.
    se = np.sqrt(np.clip(np.diag(cov), 0, None)) if dof > 0 or weighted \
        else np.full(2, math.nan)
    slope = float(coef[1])
    row["rmse_log"] = float(np.sqrt(np.mean(res**2)))
    why = _unphysical(float(coef[0]), se[0], slope, se[1])
    if why:
        row["refused"] = why
        return pd.DataFrame([row], columns=LOSS_SCALING_COLUMNS)
    b_star = math.exp(coef[0])
    row.update(b_star=b_star, b_star_se=b_star * se[0], alpha_b=-1.0 / slope,
               alpha_b_se=se[1] / slope**2)
    return pd.DataFrame([row], columns=LOSS_SCALING_COLUMNS)


LOG_B_STAR_LIMIT = math.log(1e30)
"""A B* beyond 1e30 (or below 1e-30) examples is no batch size: the line is extrapolated from a
slope the targets do not fix."""


def _unphysical(log_b_star: float, log_b_star_se: float, slope: float, slope_se: float) -> str:
    """Why the line's B* and alpha_B are no answer ("" when they are)."""
    if not (math.isfinite(log_b_star) and math.isfinite(slope)) or slope == 0:
        return "the line's B* or alpha_B is not a finite number: non-physical"
    if abs(log_b_star) > LOG_B_STAR_LIMIT:
        return ("B* lies beyond 1e30 or below 1e-30: the targets' B_crit do not fix the slope "
                "it is extrapolated with")
    if math.isfinite(slope_se) and slope_se > abs(slope):
        return ("the slope's standard error is larger than the slope: the targets' B_crit do "
                "not say how it moves with the loss")
    return ""
