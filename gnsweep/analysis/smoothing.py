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
samples / samples-per-step steps so that every batch size averages the same number of samples,
and a task counting tokens the same training as one counting examples).

Pure numpy: prefix sums make a whole curve O(n).
"""

from __future__ import annotations

import itertools

import numpy as np

SMOOTHING_FRACTION = 0.2
"""Default half-width of the analysis's centred loss smoother, as a fraction of the steps so far
(docs/truth.md: S/S_exact 0.99-1.09 on linreg at 0.2; the analysis refits at half and double)."""
CHUNK_ROWS = 16_384
"""Rows per vectorised pass of `centred_fit_runs` (whole runs): arrays that stay in cache."""
MIN_WINDOW_EXAMPLES = 64.0
"""The smallest half-width, in samples: rows of the batch's first dimension (a language model's
sequences), divided by the samples a step for steps. Counted in samples, not in the task's unit,
so it means the same training for a task in tokens as for one in examples (64 tokens would be a
quarter step at 16 sequences of 16 tokens); for a task whose unit is its samples they agree."""
MIN_REACH_UPDATES = 1.0
"""A target is never read as reached before this many updates: a crossing interpolated inside
the first step (a branch run of a language model at a few sequences read 0.38-0.98 steps), or a
loss already at the target before any update, counts as reached at one step, the least a run
can take (and log S stays finite). Rows are never dropped: sparse logging and short tables keep
their first rows."""


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


def centred_fit_runs(x: np.ndarray, y: np.ndarray, offsets: np.ndarray, fraction: float,
                     min_half_width: np.ndarray | float = 0.0) -> np.ndarray:
    """`centred_fit` on every run of a flat array: run i owns rows offsets[i]:offsets[i+1] and
    its own `min_half_width[i]` (or one for all). See `RunSmoother`."""
    return RunSmoother(x, y, offsets).fit(fraction, min_half_width)


class RunSmoother:
    """`centred_fit` on every run of a flat array (run i owns rows offsets[i]:offsets[i+1]) at
    any window: the prefix sums, which do not depend on the window, are built once, so the
    analysis's three windows (default, half and double) cost one pass each over them. The same
    numbers as a call per run: the same prefix sums (restarted at each run) and window edges."""

    def __init__(self, x: np.ndarray, y: np.ndarray, offsets: np.ndarray) -> None:
        self.x = x = np.asarray(x, float)
        self.y = y = np.asarray(y, float)
        self.offsets = offsets = np.asarray(offsets, np.int64)
        starts, ends = offsets[:-1], offsets[1:]
        self.lengths = ends - starts
        run_of_row = np.repeat(np.arange(len(starts)), self.lengths)
        # Runs whose x is not finite and non-decreasing take the one-run path (centred_fit
        # filters x as well as y; the shared prefix sums need every row's x in order).
        step_back = np.flatnonzero(~(x[1:] >= x[:-1])) + 1  # row i+1 < row i, or a NaN
        self.odd = odd = np.zeros(len(starts), bool)
        odd[run_of_row[step_back[~np.isin(step_back, starts)]]] = True
        odd[run_of_row[~np.isfinite(x)]] = True
        # Runs in chunks of about CHUNK_ROWS rows: the gathers below stay in cache.
        bounds = sorted({0, *(np.flatnonzero(np.diff(ends // CHUNK_ROWS)) + 1).tolist(),
                         len(starts)})
        self.chunks = [(first, last, self._sums(first, last),
                        bool(np.isfinite(y[offsets[first]:offsets[last]]).all()))
                       for first, last in itertools.pairwise(bounds)]

    def _sums(self, first: int, last: int) -> list[np.ndarray]:
        """Prefix sums of (1, x, y, x^2, xy) over each run's finite points of runs first..last,
        restarted at each run (as centred_fit's over its filtered arrays: adding 0.0 changes
        no partial sum); run i's occupy slots start_i - a0 + (i - first) .. end_i - a0 + ..."""
        a0, b0 = int(self.offsets[first]), int(self.offsets[last])
        xc, yc = self.x[a0:b0], self.y[a0:b0]
        ok = np.isfinite(yc)
        xs = np.where(ok, xc, 0.0)
        ys = np.where(ok, yc, 0.0)
        columns = (ok.astype(float), xs, ys, xs * xs, xs * ys)
        sums = [np.zeros(b0 - a0 + last - first) for _ in range(5)]
        lengths = self.lengths[first:last]
        if len(lengths) and lengths[0] > 0 and (lengths == lengths[0]).all() \
                and not self.odd[first:last].any():
            # Runs of one length (a grid's, usually): run i's slots are row i of a
            # (runs, length + 1) array; one cumsum along the rows per sum, the same numbers.
            shape = (last - first, int(lengths[0]))
            for total, values in zip(sums, columns, strict=True):
                grid = total.reshape(shape[0], shape[1] + 1)
                np.cumsum(values.reshape(shape), axis=1, out=grid[:, 1:])
            return sums
        for i, (a, b) in enumerate(zip((self.offsets[first:last] - a0).tolist(),
                                       (self.offsets[first + 1:last + 1] - a0).tolist(),
                                       strict=True)):
            if b > a and not self.odd[first + i]:
                for total, values in zip(sums, columns, strict=True):
                    np.cumsum(values[a:b], out=total[a + i + 1:b + i + 1])
        return sums

    def fit(self, fraction: float, min_half_width: np.ndarray | float = 0.0) -> np.ndarray:
        """Every run's centred local-linear smooth at half-width max(fraction * |x|,
        min_half_width[run])."""
        if fraction < 0 or np.any(np.asarray(min_half_width) < 0):
            raise ValueError("need fraction >= 0 and min_half_width >= 0")
        min_half = np.broadcast_to(np.asarray(min_half_width, float), self.lengths.shape)
        out = np.full(len(self.x), np.nan)
        # Runs logged at the same steps with the same smallest half-width (the runs of one
        # batch size) have the same window edges: searched once.
        edges: dict[tuple[int, float], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for first, last, sums, dense in self.chunks:
            self._fit_chunk(first, last, sums, dense, fraction, min_half, out, edges)
        for i in np.flatnonzero(self.odd):
            a, b = self.offsets[i], self.offsets[i + 1]
            out[a:b] = centred_fit(self.x[a:b], self.y[a:b], fraction, float(min_half[i]))
        return out

    def _fit_chunk(self, first: int, last: int, sums: list[np.ndarray], dense: bool,
                   fraction: float, min_half: np.ndarray, out: np.ndarray,
                   edges: dict[tuple[int, float], tuple[np.ndarray, np.ndarray, np.ndarray]]
                   ) -> None:
        a0, b0 = int(self.offsets[first]), int(self.offsets[last])
        if b0 <= a0:
            return
        xc = self.x[a0:b0]
        lo = np.zeros(b0 - a0, np.int64)
        hi = np.zeros(b0 - a0, np.int64)
        for i, (a, b) in enumerate(zip((self.offsets[first:last] - a0).tolist(),
                                       (self.offsets[first + 1:last + 1] - a0).tolist(),
                                       strict=True)):
            if b > a and not self.odd[first + i]:
                run = xc[a:b]
                key = (b - a, float(min_half[first + i]))
                seen = edges.get(key)
                if seen is None or not np.array_equal(seen[0], run):
                    half = np.maximum(fraction * np.abs(run), min_half[first + i])
                    seen = edges[key] = (run, np.searchsorted(run, run - half, side="left"),
                                         np.searchsorted(run, run + half, side="right"))
                lo[a:b] = seen[1] + (a + i)
                hi[a:b] = seen[2] + (a + i)
        c1, cx, cy, cxx, cxy = sums
        # Every y finite (`dense`): each window counts its rows, hi - lo (exact either way).
        n = (hi - lo).astype(float) if dense else c1[hi] - c1[lo]
        sx, sy = cx[hi] - cx[lo], cy[hi] - cy[lo]
        sxx, sxy = cxx[hi] - cxx[lo], cxy[hi] - cxy[lo]
        with np.errstate(invalid="ignore", divide="ignore"):
            mx, my = sx / n, sy / n
            mx2 = mx * mx
            var = sxx / n - mx2
            cov = sxy / n - mx * my
            slope = np.where(var > 1e-12 * np.maximum(mx2, 1.0), cov / var, 0.0)
            fitted = my + slope * (xc - mx)
            if not dense:  # (dense: every window holds at least its own point)
                fitted = np.where(n > 0, fitted, np.nan)
        if not self.odd[first:last].any():
            out[a0:b0] = fitted
            return
        fast = ~np.repeat(self.odd[first:last], self.lengths[first:last])
        out[a0:b0][fast] = fitted[fast]


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
    analysis will read the target as reached whatever comes after. A window cut by the first
    point (x - half-width before it) does not count: the analysis does not count a target met
    there either (`steps.EARLY`)."""
    x = np.asarray(x, float)
    if len(x) == 0:
        return False
    smooth = centred_fit(x, y, fraction, min_half_width)
    half = np.maximum(fraction * np.abs(x), min_half_width)
    whole = (x + half <= x[-1]) & (x - half >= x[0])
    return bool(np.any(whole & (smooth <= target)))
