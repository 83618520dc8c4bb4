"""Lag-free smoothing of whole logged curves: centred local-linear fits, and the first step at
which a smoothed loss reaches a target.

A causal EMA (what a training loop can compute) lags: its value at step s describes the loss some
fixed number of examples earlier, which adds that many examples to every E and inflates E_min and
B_crit (DESIGN.md). The analysis has each run's whole curve, so it can smooth with a window centred
on every point instead. Here each point's value is the least-squares line through the raw points
within `x +- half_width(x)` (a box kernel), evaluated at `x`:

- a straight stretch of curve is reproduced exactly, so the only bias is from curvature,
  about `f''(x) h^2 / 6` for half-width h, and it is symmetric: no lag;
- at the ends of a run the window is cut to what exists (near the start nothing precedes step
  0; at the end the run stopped), and the local line still has no first-order bias there.

`half_width(x) = max(fraction * x, min_half_width)`: a window that is a fixed share of the
run so far follows training (the same span in log x everywhere, so curvature bias is alike for
short and long runs), and `min_half_width` keeps a few points in it early on (give it in
examples / B steps so that every batch size averages the same number of examples).

Pure numpy: prefix sums make a whole curve O(n).
"""

from __future__ import annotations

import numpy as np

SMOOTHING_FRACTION = 0.2
"""Default half-width of the analysis's centred loss smoother, as a fraction of the steps so far
(docs/truth.md: S/S_exact 0.99-1.09 on linreg at 0.2; the analysis refits at half and double)."""
MIN_WINDOW_EXAMPLES = 64.0
"""The smallest half-width, in examples (divided by B for steps): a few points early on."""


def centred_fit(x: np.ndarray, y: np.ndarray, fraction: float, min_half_width: float = 0.0
                ) -> np.ndarray:
    """Centred local-linear smoothing of y(x) (x increasing); NaN y are skipped.

    Each output is the value at x_i of the least-squares line through the finite (x_j, y_j) with
    |x_j - x_i| <= max(fraction * |x_i|, min_half_width); a window with one point gives that
    point, an empty one NaN.
    """
    x = np.asarray(x, float)
    y = np.asarray(y, float)
    if fraction < 0 or min_half_width < 0:
        raise ValueError("need fraction >= 0 and min_half_width >= 0")
    if len(x) == 0:
        return np.empty(0)
    ok = np.isfinite(y) & np.isfinite(x)
    xs, ys = x[ok], y[ok]
    half = np.maximum(fraction * np.abs(x), min_half_width)
    lo = np.searchsorted(xs, x - half, side="left")
    hi = np.searchsorted(xs, x + half, side="right")
    # Centre x on each window's own point to keep the sums well conditioned.
    def sums(values: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(values)])

    c1, cx, cy = sums(np.ones_like(xs)), sums(xs), sums(ys)
    cxx, cxy = sums(xs * xs), sums(xs * ys)
    n = c1[hi] - c1[lo]
    sx, sy = cx[hi] - cx[lo], cy[hi] - cy[lo]
    sxx, sxy = cxx[hi] - cxx[lo], cxy[hi] - cxy[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        mx, my = sx / n, sy / n
        var = sxx / n - mx * mx
        cov = sxy / n - mx * my
        slope = np.where(var > 1e-12 * np.maximum(mx * mx, 1.0), cov / var, 0.0)
        out = my + slope * (x - mx)
    return np.where(n > 0, out, np.nan)


def centred_ratio(x: np.ndarray, numerator: np.ndarray, denominator: np.ndarray,
                  fraction: float, min_half_width: float = 0.0) -> np.ndarray:
    """Ratio of two centred local-linear smooths (e.g. tr(Sigma) and |G|^2 per step): B_simple
    (eq. 2.9) or B_noise (eq. 2.8) without the lag of a causal EMA. NaN where the smoothed
    denominator is not positive (the signal lost in the noise)."""
    num = centred_fit(x, numerator, fraction, min_half_width)
    den = centred_fit(x, denominator, fraction, min_half_width)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def first_reach(x: np.ndarray, values: np.ndarray, target: float) -> float:
    """The first x at which `values` (a smoothed curve) falls to `target`, interpolated linearly
    between the last point above and the first at or below it (the exact oracle interpolates
    the same way); NaN if it never does. At the first point already: that x."""
    x = np.asarray(x, float)
    v = np.asarray(values, float)
    below = np.flatnonzero(v <= target)
    if not len(below):
        return float("nan")
    i = int(below[0])
    if i == 0 or not np.isfinite(v[i - 1]):
        return float(x[i])
    frac = (v[i - 1] - target) / (v[i - 1] - v[i])
    return float(x[i - 1] + frac * (x[i] - x[i - 1]))


def interpolate_log_steps(probe_steps: np.ndarray, probe_values: np.ndarray,
                          steps: np.ndarray) -> np.ndarray:
    """Per-step values from sparse probes (e.g. B_noise measured at log-spaced points), linear
    in log(1 + step) between probes and constant beyond the first and the last; NaN probes are
    skipped, and without any finite probe the result is NaN."""
    ps = np.asarray(probe_steps, float)
    pv = np.asarray(probe_values, float)
    ok = np.isfinite(ps) & np.isfinite(pv)
    if not ok.any():
        return np.full(len(np.asarray(steps)), np.nan)
    return np.interp(np.log1p(np.asarray(steps, float)), np.log1p(ps[ok]), pv[ok])


def pooled_probes(probe_steps: np.ndarray, numerator: np.ndarray, denominator: np.ndarray,
                  steps: np.ndarray, octaves: float = 1.0) -> np.ndarray:
    """Per-step noise scale from frozen-parameter probes: each probe's pooled numerator and
    denominator (tr(Sigma) and |G|^2, or tr(H Sigma) and G^T H G, eq. A.2) are smoothed across
    the probes within `octaves` doublings of steps either side (centred local-linear in
    log(1 + step)) before the ratio (eq. 2.9 / 2.8), then interpolated to every step. Pooling
    before the ratio shrinks the upward bias of a ratio with a noisy denominator; measured on
    linreg in docs/noise.md."""
    where = np.log1p(np.asarray(probe_steps, float))
    ratio = centred_ratio(where, numerator, denominator, 0.0, octaves * float(np.log(2.0)))
    return interpolate_log_steps(probe_steps, ratio, steps)


def settled_at_or_below(x: np.ndarray, y: np.ndarray, target: float, fraction: float,
                        min_half_width: float = 0.0) -> bool:
    """Whether the centred smooth of y(x) (`centred_fit`) is at or below `target` at a point
    whose whole window lies inside the data: later points cannot move that value, so the
    analysis will read the target as reached whatever comes after."""
    x = np.asarray(x, float)
    if len(x) == 0:
        return False
    smooth = centred_fit(x, y, fraction, min_half_width)
    whole = x + np.maximum(fraction * np.abs(x), min_half_width) <= x[-1]
    return bool(np.any(whole & (smooth <= target)))
