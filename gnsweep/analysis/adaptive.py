"""Adaptive batch size runs (appendix D) against the fixed-batch fronts.

An adaptive run sets B(s) = sqrt(r B_noise(s)) each step. Appendix D: a schedule that follows
the noise scale reaches a target on the front `(S/S_min - 1)(E/E_min - 1) = gamma`, with
`gamma = <sqrt(B_noise)>^2 / <B_noise>` (averages over S_min, i.e. weighted by
dS_min = dS / (1 + B_noise/B), the weights of `steps._RunningMeans`); gamma <= 1 (Cauchy-Schwarz),
so it never needs more examples than a fixed batch size at the same number of steps.

For each adaptive run and target: S and E (examples actually processed, interpolated at S),
gamma from the run's own measured noise-scale path up to S (B_noise where measured, else
B_simple), and at equal S, against the fixed-batch fit of eq. 2.11 (S_min, E_min):
- E_fixed = E_min S / (S - S_min): the examples a fixed batch size needs to reach it in S steps;
- predicted gain E_fixed / E_pred with E_pred = E_min (1 + gamma / (S/S_min - 1)), i.e.
  (S/S_min) / (S/S_min - 1 + gamma);
- measured gain E_fixed / E, and the run's own front product (S/S_min - 1)(E/E_min - 1), which
  the theory puts at gamma (1 on the fixed-batch front).
Pure: no files, no torch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from gnsweep.analysis.steps import Curves, noise_rows, steps_to_target
from gnsweep.tables import columns
from gnsweep.targets import FALLING, Direction

ADAPTIVE_COLUMNS = columns("adaptive")


def gamma_of_path(b_noise: np.ndarray, weights: np.ndarray) -> float:
    """gamma = <sqrt(B_noise)>^2 / <B_noise>, the averages weighted by `weights` (dS_min).

    Rows with a NaN, zero or negative estimate (no square root) or no weight are left out.
    A constant path gives 1; B_noise growing like s^p under uniform weights 4(p+1)/(p+2)^2."""
    b = np.asarray(b_noise, float)
    w = np.asarray(weights, float)
    ok = np.isfinite(b) & (b > 0) & np.isfinite(w) & (w > 0)
    if not ok.any():
        return math.nan
    b, w = b[ok], w[ok]
    total = float(w.sum())
    return float((w @ np.sqrt(b)) ** 2 / (total * float(w @ b)))


def fixed_examples(steps: float, s_min: float, e_min: float) -> float:
    """E at S on the fixed-batch front (eq. 2.11, S = S_min + E_min/B, E = B S): E_min S / (S -
    S_min); NaN where S <= S_min (no fixed batch size reaches the target that fast)."""
    if not (steps > s_min > 0 and e_min > 0):
        return math.nan
    return e_min * steps / (steps - s_min)


def adaptive_examples(steps: float, s_min: float, e_min: float, gamma: float) -> float:
    """E at S on appendix D's adaptive front (S/S_min - 1)(E/E_min - 1) = gamma."""
    if not (steps > s_min > 0 and e_min > 0 and gamma > 0):
        return math.nan
    return e_min * (1.0 + gamma / (steps / s_min - 1.0))


def predicted_gain(steps: float, s_min: float, gamma: float) -> float:
    """E_fixed / E_adaptive at equal S: (S/S_min) / (S/S_min - 1 + gamma)."""
    if not (steps > s_min > 0 and gamma > 0):
        return math.nan
    x = steps / s_min
    return x / (x - 1.0 + gamma)


def split_adaptive(curves: Curves) -> tuple[Curves, Curves | None]:
    """(the grid's runs, the adaptive runs or None): the fit of eq. 2.11 sees fixed runs only."""
    rate = curves.runs.get("exchange_rate")
    if rate is None or not (rate.to_numpy(float) > 0).any():
        return curves, None
    adaptive = rate.to_numpy(float) > 0
    return subset(curves, ~adaptive), subset(curves, adaptive)


def subset(curves: Curves, keep: np.ndarray) -> Curves:
    """The runs where `keep` is True, with their rows."""
    index = np.flatnonzero(keep)
    lengths = curves.lengths[index]
    rows = (np.concatenate([np.arange(curves.offsets[i], curves.offsets[i + 1]) for i in index])
            if len(index) else np.zeros(0, np.int64)).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Curves(curves.runs.iloc[index].reset_index(drop=True), offsets,
                  {k: v[rows] for k, v in curves.columns.items()})


def analyze_adaptive(curves: Curves, fits: pd.DataFrame, targets: list[float], *,
                     loss: str = "smoothed", ema_examples: float | None = None,
                     direction: Direction = FALLING) -> pd.DataFrame:
    """One row per (adaptive run, target): ADAPTIVE_COLUMNS (module docstring, docs/adaptive.md).

    `curves` holds adaptive runs only (`split_adaptive`), their `batch_size` the mean examples
    per step; `fits` the fixed-batch fits (target, s_min, e_min, refused)."""
    steps = steps_to_target(curves, None, targets, loss=loss, ema_examples=ema_examples,
                            direction=direction)
    fitted = fits[fits["refused"].astype(str) == ""].set_index("target") if len(fits) else None
    step, examples = curves.columns["step"], curves.columns["examples"]
    noise, simple = noise_rows(curves, "noise"), noise_rows(curves, "simple")
    position = {run_id: i for i, run_id in enumerate(curves.runs["run_id"])}
    rows = []
    for row in steps.itertuples(index=False):
        i = position[row.run_id]
        lo, hi = curves.offsets[i], curves.offsets[i + 1]
        run = curves.runs.iloc[i]
        out: dict[str, Any] = dict.fromkeys(ADAPTIVE_COLUMNS, math.nan)
        out.update(run_id=row.run_id, exchange_rate=float(run["exchange_rate"]),
                   eps_max=float(run["learning_rate"]), seed=int(row.seed),
                   target=float(row.target), state=str(row.state), reached=bool(row.reached),
                   noise_source="")
        if row.reached and hi > lo:
            s = float(row.steps)
            x = np.concatenate([[0.0], step[lo:hi]])
            e = float(np.interp(s, x, np.concatenate([[0.0], examples[lo:hi]])))
            use_noise = bool(np.isfinite(noise[lo:hi]).any())
            path = (noise if use_noise else simple)[lo:hi]
            # Examples per step of every row (the batch size in the task's unit) and dS.
            ds = np.diff(x)
            batch = np.diff(np.concatenate([[0.0], examples[lo:hi]])) / np.where(ds > 0, ds, 1)
            upto = np.clip(s - x[:-1], 0.0, ds)  # the part of each row's steps before S
            with np.errstate(invalid="ignore", divide="ignore"):
                weights = upto / (1.0 + path / batch)
            gamma = gamma_of_path(path, weights)
            ok = np.isfinite(path) & (weights > 0)
            out.update(steps=s, examples=e, mean_batch=e / s if s > 0 else math.nan,
                       noise_source="b_noise" if use_noise else "b_simple", gamma=gamma,
                       b_noise_mean=float(weights[ok] @ path[ok] / weights[ok].sum())
                       if ok.any() else math.nan)
            if fitted is not None and row.target in fitted.index:
                s_min = float(fitted.at[row.target, "s_min"])
                e_min = float(fitted.at[row.target, "e_min"])
                e_fixed = fixed_examples(s, s_min, e_min)
                out.update(s_min=s_min, e_min=e_min, e_fixed=e_fixed,
                           e_predicted=adaptive_examples(s, s_min, e_min, gamma),
                           gain_predicted=predicted_gain(s, s_min, gamma),
                           gain_measured=e_fixed / e if e > 0 else math.nan,
                           front_product=(s / s_min - 1.0) * (e / e_min - 1.0))
        rows.append(out)
    frame = pd.DataFrame(rows, columns=ADAPTIVE_COLUMNS)
    frame["reached"] = frame["reached"].astype(bool)
    frame["seed"] = frame["seed"].astype(int)
    return frame.sort_values(["target", "exchange_rate", "seed"],
                             ascending=[direction.ascending, True, True]).reset_index(drop=True)
