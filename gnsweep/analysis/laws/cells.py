"""The optimum of one (N, D) cell of a fixed-budget grid: every run trained on the same D
examples (or tokens), its final loss compared across batch size B and learning rate lr.

- The optimum (B_opt, lr_opt) is the minimum of a quadratic model of the loss over
  (log B, log lr), fitted by least squares to the best grid point and its neighbours (one grid
  spacing around it; two when fewer than six points are there or that model has no minimum
  inside), leaving out neighbours more than 25% above the best (another regime: near
  divergence). When the model has no minimum inside that neighbourhood, or puts it further
  below the best run than the neighbourhood rises above it, the best grid point is the answer
  (`method` says which), and the cell is not used as a point of a law (`edge`): its optimum is
  not located.
- A residual bootstrap of that model (refit on fitted + resampled residuals) gives the 95%
  interval of B_opt and lr_opt; without residual degrees of freedom the draws come from the
  near-optimal set instead.
- The near-optimal set (Li et al. 2025, "Step Law") is every configuration whose loss is within
  a relative `tolerance` of the best: loss <= best + tolerance * |best| (best * (1 +
  tolerance) for a positive loss; a negative one, a -ELBO, is compared by differences).
- A fitted minimum at or beyond the grid's edge (the smallest or largest batch size, or the
  smallest or largest learning rate tried at the batch size nearest it) is only a bound:
  `edge` is set and the law fits leave the cell out. A minimum inside the grid is located and
  used; where the near-optimal set reaches the grid's smallest or largest batch size, or an
  end of the learning rates tried at the best batch size, the loss is flat to that edge within
  the tolerance, so its interval (and its bootstrap draws) are widened to the edge (`widened`).
  A larger learning rate that diverged brackets the optimum from above.
- The fixed-budget critical batch size: the largest batch size whose best loss (over lr) stays
  within the tolerance of the cell's best, interpolated in log B between the last batch size
  inside and the first outside. Beyond a small-batch regime where only the ratio lr/B matters
  (the paper's section 2.2), a larger batch at fixed data loses loss; this is where it starts.
  Every batch size of the grid inside the tolerance makes it a lower bound (not used).

Pure numpy; no files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

QUADRATIC = "quadratic"
GRID = "grid"
OFF_VALLEY = 0.25
"""Neighbours more than this (relative) above the best loss are left out of the local model."""
LOCAL = 4.0
"""The fixed-budget critical batch size's curve is fitted up to this many tolerances of
excess loss."""
MIN_QUADRATIC_POINTS = 6
"""A full quadratic in two variables has six coefficients."""


@dataclass(frozen=True)
class CellOptimum:
    """The optimum of one cell and its spread (`cell_optimum`)."""

    batch_size: float
    learning_rate: float
    loss: float
    """The model's loss at the optimum (the best grid loss with method `grid`)."""
    best_loss: float
    """The lowest loss measured in the cell."""
    batch_size_low: float
    batch_size_high: float
    learning_rate_low: float
    learning_rate_high: float
    """95% bootstrap interval of the optimum."""
    method: str
    """`quadratic` (the local model's minimum) or `grid` (the best grid point)."""
    edge: bool
    edge_reason: str
    """Why the optimum is only a bound ("" when located inside the grid)."""
    widened: str
    """Why a located optimum's interval was widened to an edge ("" when not)."""
    n_runs: int
    n_configs: int
    n_diverged: int
    n_near: int
    """Configurations in the near-optimal set."""
    near_batch_low: float
    near_batch_high: float
    near_lr_low: float
    near_lr_high: float
    b_crit: float
    """Largest batch size within the tolerance of the best loss (NaN when refused)."""
    b_crit_status: str
    """fit, lower_bound (every larger batch size stays inside) or refused."""
    seeds: float
    """Median number of runs (seeds) per configuration, averaged into its loss."""
    seed_sd: float
    """Median standard deviation of a repeated configuration's loss over its seeds (NaN
    without repeats): the noise the tolerance should stand above."""
    draws: np.ndarray = field(repr=False)
    """Bootstrap draws of (log B_opt, log lr_opt), shape (n, 2)."""


class CellRefused(ValueError):
    """The cell's runs cannot give an optimum; the message says why."""


def configuration_table(batch_size: np.ndarray, learning_rate: np.ndarray, loss: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One row per (B, lr), in (B, lr) order: (B, lr, mean loss over its seeds -- inf where any
    seed diverged, a non-finite loss --, seeds, the seeds' standard deviation -- NaN with one
    seed or a diverged one). One sort: a million rows take about a second."""
    b = np.asarray(batch_size, float)
    lr = np.asarray(learning_rate, float)
    values = np.asarray(loss, float)
    order = np.lexsort((lr, b))
    b, lr, values = b[order], lr[order], values[order]
    starts = np.flatnonzero(np.r_[True, (np.diff(b) != 0) | (np.diff(lr) != 0)])
    counts = np.diff(np.r_[starts, len(b)])
    finite = np.isfinite(values)
    bad = np.add.reduceat((~finite).astype(np.int64), starts) > 0
    clean = np.where(finite, values, 0.0)
    # Differences from each configuration's first seed: the variance without cancellation.
    shifted = clean - np.repeat(clean[starts], counts)
    total = np.add.reduceat(shifted, starts)
    squares = np.add.reduceat(shifted * shifted, starts)
    mean = clean[starts] + total / counts
    with np.errstate(invalid="ignore", divide="ignore"):
        spread = np.sqrt(np.maximum(squares - total * total / counts, 0.0) / (counts - 1))
    spread[(counts < 2) | bad] = math.nan
    mean[bad] = math.inf
    return b[starts], lr[starts], mean, counts, spread


def configurations(batch_size: np.ndarray, learning_rate: np.ndarray, loss: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One row per (B, lr): the mean loss over its seeds, inf where any seed diverged (a
    non-finite loss). Returns (B, lr, loss, runs)."""
    b, lr, mean, _, _ = configuration_table(batch_size, learning_rate, loss)
    return b, lr, mean, len(np.asarray(loss))


def ceiling(best: float, tolerance: float) -> float:
    """The highest loss within a relative `tolerance` of `best`: best + tolerance * |best|.
    A loss is a number to minimise, so a negative one (a negative log-likelihood, a -ELBO) is
    compared by its difference from the best, relative to the best's size."""
    return best + tolerance * abs(best)


def relative_excess(values: np.ndarray | float, best: float) -> np.ndarray:
    """(loss - best) / |best|: how far above the best, relative to its size (`ceiling`)."""
    return (np.asarray(values, float) - best) / abs(best)


def cell_optimum(batch_size: np.ndarray, learning_rate: np.ndarray, loss: np.ndarray, *,
                 tolerance: float, bootstrap: int = 200, seed: int = 0) -> CellOptimum:
    """The cell's optimum, near-optimal set and fixed-budget critical batch size (module
    docstring). Raises CellRefused when no configuration has a finite loss, or the best loss
    is exactly 0 (no relative tolerance around it)."""
    b, lr, values, seeds, spread = configuration_table(batch_size, learning_rate, loss)
    n_runs = len(np.asarray(loss))
    finite = np.isfinite(values)
    if not finite.any():
        raise CellRefused("every run diverged (no finite loss)")
    x, y = np.log(b), np.log(lr)
    best = int(np.argmin(np.where(finite, values, np.inf)))
    best_loss = float(values[best])
    if best_loss == 0:
        raise CellRefused("the best loss is exactly 0, so a tolerance relative to it is empty; "
                          "shift the losses by a constant (e.g. loss + 1)")
    near = finite & (values <= ceiling(best_loss, tolerance))
    rng = np.random.default_rng(seed)
    model = _local_quadratic(x, y, values, finite, best, bootstrap, rng)
    widened = ""
    if model is None:
        # A grid point is a located optimum only when the smooth model agrees that there is
        # a minimum there: in a flat or noisy valley the best point is noise.
        edge_reason = _edge(b, lr, best) or (
            "the local quadratic model has no minimum near the best point: the optimum is not "
            "located (a flat or noisy valley)")
        method, opt, model_loss = GRID, np.array([x[best], y[best]]), best_loss
        pool = np.flatnonzero(near)
        draws = np.stack([x[pool], y[pool]], axis=1)[rng.integers(0, len(pool), max(bootstrap,
                                                                                     1))]
    else:
        method, (opt, model_loss, draws) = QUADRATIC, model
        # Only a minimum at or beyond the grid's edge is a bound; one inside is located, and
        # a near-optimal set reaching an edge only widens its interval (below).
        edge_reason = _beyond(b, lr, opt)
    low, high = (np.percentile(draws, q, axis=0) for q in (2.5, 97.5))
    low, high = np.minimum(low, opt), np.maximum(high, opt)
    if not edge_reason:
        widened, low, high, draws = _widen(b, lr, near, best, low, high, draws, rng)
    b_crit, b_crit_status = _fixed_budget_bcrit(b, y, values, finite, best_loss, tolerance)
    repeated = seeds > 1
    return CellOptimum(
        batch_size=math.exp(opt[0]), learning_rate=math.exp(opt[1]), loss=float(model_loss),
        best_loss=best_loss, batch_size_low=math.exp(low[0]), batch_size_high=math.exp(high[0]),
        learning_rate_low=math.exp(low[1]), learning_rate_high=math.exp(high[1]),
        method=method, edge=bool(edge_reason), edge_reason=edge_reason, widened=widened,
        n_runs=n_runs, n_configs=len(b), n_diverged=int((~finite).sum()),
        n_near=int(near.sum()),
        near_batch_low=float(b[near].min()), near_batch_high=float(b[near].max()),
        near_lr_low=float(lr[near].min()), near_lr_high=float(lr[near].max()),
        b_crit=b_crit, b_crit_status=b_crit_status,
        seeds=float(np.median(seeds)),
        seed_sd=(float(np.nanmedian(spread[repeated])) if np.isfinite(spread[repeated]).any()
                 else math.nan),
        draws=draws)


def _edge(b: np.ndarray, lr: np.ndarray, best: int) -> str:
    """Why the best configuration is only a bound ("" when the grid brackets it)."""
    reasons = []
    if len(np.unique(b)) < 2 or b[best] == b.min():
        reasons.append(f"smallest batch size {b[best]:g}")
    elif b[best] == b.max():
        reasons.append(f"largest batch size {b[best]:g}")
    tried = lr[b == b[best]]  # diverged rates count: a divergence above brackets the optimum
    if len(tried) < 2 or lr[best] == tried.min():
        reasons.append(f"smallest learning rate {lr[best]:g} tried at batch size {b[best]:g}")
    elif lr[best] == tried.max():
        reasons.append(f"largest learning rate {lr[best]:g} tried at batch size {b[best]:g}")
    return "; ".join(reasons)


def _beyond(b: np.ndarray, lr: np.ndarray, opt: np.ndarray) -> str:
    """Why the fitted minimum (log B, log lr) is only a bound ("" when it lies inside the grid):
    at or beyond the smallest or largest batch size, or the smallest or largest learning rate
    tried at the grid's batch size nearest it (a diverged rate counts as tried: it brackets)."""
    reasons = []
    x = np.log(b)
    if len(np.unique(b)) < 2 or opt[0] <= x.min():
        reasons.append(f"the fitted minimum lies at or beyond the smallest batch size "
                       f"{b.min():g}")
    elif opt[0] >= x.max():
        reasons.append(f"the fitted minimum lies at or beyond the largest batch size "
                       f"{b.max():g}")
    nearest = b[int(np.argmin(np.abs(x - opt[0])))]
    tried = np.log(lr[b == nearest])
    if len(tried) < 2 or opt[1] <= tried.min():
        reasons.append(f"the fitted minimum lies at or beyond the smallest learning rate "
                       f"{math.exp(tried.min()):g} tried at batch size {nearest:g}")
    elif opt[1] >= tried.max():
        reasons.append(f"the fitted minimum lies at or beyond the largest learning rate "
                       f"{math.exp(tried.max()):g} tried at batch size {nearest:g}")
    return "; ".join(reasons)


def _widen(b: np.ndarray, lr: np.ndarray, near: np.ndarray, best: int, low: np.ndarray,
           high: np.ndarray, draws: np.ndarray, rng: np.random.Generator
           ) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """A located optimum whose near-optimal set reaches an edge of the grid (`_near_edge`):
    the loss is flat to that edge within the tolerance, so the interval is widened to the edge
    and the draws on that axis spread uniformly (in log) over the widened interval, which the
    laws' intervals then carry. Returns (what was widened, low, high, draws)."""
    found = _near_edge(b, lr, near, best)
    if found is None:
        return "", low, high, draws
    reason, axis, value = found
    low, high, draws = low.copy(), high.copy(), draws.copy()
    edge = math.log(value)
    low[axis], high[axis] = min(low[axis], edge), max(high[axis], edge)
    draws[:, axis] = rng.uniform(low[axis], high[axis], len(draws))
    return f"interval widened: {reason}", low, high, draws


def _near_edge(b: np.ndarray, lr: np.ndarray, near: np.ndarray, best: int
               ) -> tuple[str, int, float] | None:
    """Where the grid does not bracket the near-optimal set (None when it does): a
    configuration within the tolerance at the grid's smallest or largest batch size, or at the
    smallest or largest learning rate tried at the best configuration's batch size. The loss
    is then flat to the edge (plain SGD at a fixed budget is as good at every batch size below
    its critical one). Other batch sizes' learning-rate ranges are not asked: a grid may try
    fewer rates far from the optimum. Returns (why, axis 0 for B or 1 for lr, the edge)."""
    for side, value in (("smallest", b.min()), ("largest", b.max())):
        if (near & (b == value)).any():
            return f"the near-optimal set reaches the {side} batch size {value:g}", 0, value
    at_best = b == b[best]
    tried = lr[at_best]
    for side, value in (("smallest", tried.min()), ("largest", tried.max())):
        if (near & at_best & (lr == value)).any():
            return (f"the near-optimal set reaches the {side} learning rate {value:g} tried at "
                    f"batch size {b[best]:g}", 1, value)
    return None


def _spacing(values: np.ndarray) -> float:
    """The median gap between the sorted distinct values (1 with fewer than two)."""
    distinct = np.unique(values)
    return float(np.median(np.diff(distinct))) if len(distinct) > 1 else 1.0


def _design(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return np.stack([np.ones_like(u), u, v, u * u, u * v, v * v], axis=1)


def _stationary(coef: np.ndarray, box: float) -> np.ndarray | None:
    """The quadratic's minimum when it has one (positive-definite Hessian) inside the box."""
    hessian = np.array([[2 * coef[3], coef[4]], [coef[4], 2 * coef[5]]])
    if np.linalg.eigvalsh(hessian).min() <= 0:
        return None
    point = -np.linalg.solve(hessian, coef[1:3])
    return point if np.abs(point).max() <= box else None


def _local_quadratic(x: np.ndarray, y: np.ndarray, values: np.ndarray, finite: np.ndarray,
                     best: int, bootstrap: int, rng: np.random.Generator
                     ) -> tuple[np.ndarray, float, np.ndarray] | None:
    """(optimum (log B, log lr), the model's loss there, bootstrap draws) or None when the
    neighbourhood has too few points or the model no minimum inside it."""
    sx, sy = _spacing(x), _spacing(y)
    u, v = (x - x[best]) / sx, (y - y[best]) / sy
    # One grid spacing around the best point; two when one holds too few points or its model
    # has no minimum inside (a valley steeper on one side than a quadratic).
    # A neighbour far above the best (near divergence, or off the valley) is another regime:
    # a quadratic through it would misplace the minimum.
    valley = finite & (values <= ceiling(float(values[best]), OFF_VALLEY))
    for box in (1.01, 2.01):
        chosen = valley & (np.abs(u) <= box) & (np.abs(v) <= box)
        if chosen.sum() < MIN_QUADRATIC_POINTS or len(np.unique(u[chosen])) < 3 or len(
                np.unique(v[chosen])) < 3:
            continue
        design = _design(u[chosen], v[chosen])
        target = values[chosen]
        coef, *_ = np.linalg.lstsq(design, target, rcond=None)
        point = _stationary(coef, box)
        # A model whose minimum lies further below the best run than the neighbourhood rises
        # above it extrapolates (a fit bent by noise), and locates nothing.
        rise = float(target.max() - values[best])
        if point is not None and float((_design(point[:1], point[1:]) @ coef)[0]) >= values[
                best] - rise:
            break
    else:
        return None
    fitted = design @ coef
    residuals = target - fitted
    dof = len(target) - MIN_QUADRATIC_POINTS
    draws = np.empty((max(bootstrap, 1), 2))
    draws[:] = point
    if dof > 0 and bootstrap > 0:
        scaled = (residuals - residuals.mean()) * math.sqrt(len(target) / dof)
        for k in range(bootstrap):
            resampled = fitted + rng.choice(scaled, len(target), replace=True)
            again, *_ = np.linalg.lstsq(design, resampled, rcond=None)
            moved = _stationary(again, box)
            if moved is None:  # no minimum inside: the resample's best point stands for it
                i = int(np.argmin(resampled))
                moved = np.array([u[chosen][i], v[chosen][i]])
            draws[k] = moved
    model_loss = float((_design(point[:1], point[1:]) @ coef)[0])
    scale = np.array([sx, sy])
    origin = np.array([x[best], y[best]])
    return origin + point * scale, model_loss, origin + draws * scale


def _per_batch_best(y: np.ndarray, values: np.ndarray, tolerance: float) -> float:
    """The best loss over learning rates at one batch size: the minimum of a parabola in log lr
    fitted by least squares to the best point and its neighbours (up to two on each side)
    whose loss is within LOCAL x the tolerance of it (more points average the runs' noise; a
    steep wall near divergence would bend the parabola below the valley), when at least three
    are and the minimum lies among them; else the best measured."""
    order = np.argsort(y)
    y, values = y[order], values[order]
    i = int(np.argmin(values))
    lo, hi = max(i - 2, 0), min(i + 3, len(y))
    near = np.arange(lo, hi)
    near = near[values[near] <= ceiling(float(values[i]), LOCAL * tolerance)]
    if len(near) >= 3 and near.min() < i < near.max():
        a, b, c = np.polyfit(y[near], values[near], 2)
        if a > 0:
            vertex = -b / (2 * a)
            if y[near.min()] <= vertex <= y[near.max()]:
                return float(min(values[i], c - b * b / (4 * a)))
    return float(values[i])


def _fixed_budget_bcrit(b: np.ndarray, y: np.ndarray, values: np.ndarray, finite: np.ndarray,
                        best_loss: float, tolerance: float) -> tuple[float, str]:
    """The largest batch size whose best loss is within `tolerance` of the cell's best (module
    docstring), and its status.

    Each batch size's best loss (over lr) is a noisy curve, flat below the critical batch size
    and rising above it. The lowest of several noisy flat values lies below their level and
    would move the crossing; so from the best batch size up the curve is fitted by a floor
    and a power, L(B) = L0 + k B^p (least squares, every batch size up to the first beyond
    LOCAL tolerances weighing in), and the
    crossing is where L(B) rises `tolerance` above the fitted curve's value at its start.
    Where that fit fails, the crossing is interpolated in log B between the batch sizes
    around it.
    """
    sizes = np.unique(b)
    bests = np.array([
        _per_batch_best(y[(b == s) & finite], values[(b == s) & finite], tolerance)
        if ((b == s) & finite).any() else math.inf for s in sizes])
    start = int(np.argmin(bests))
    excess = relative_excess(bests, float(bests[start]))
    if not (excess[start + 1:] > tolerance).any():
        return float(sizes[-1]), "lower_bound"
    k = start + 1 + int(np.argmax(excess[start + 1:] > tolerance))
    # The curve's shape steepens far above the crossing: fit it up to the first batch size
    # beyond LOCAL x the tolerance, where it describes the crossing.
    beyond = np.flatnonzero(excess[start:] > LOCAL * tolerance)
    end = start + (int(beyond[0]) + 1 if len(beyond) else len(sizes) - start)
    fitted = _floor_power_crossing(sizes[start:end], bests[start:end], tolerance)
    if fitted is not None and sizes[start] <= fitted <= sizes[-1]:
        return fitted, "fit"
    if not math.isfinite(excess[k]):
        return float(sizes[k - 1]), "fit"
    inside = excess[k - 1]
    share = (tolerance - inside) / (excess[k] - inside)
    log_b = math.log(sizes[k - 1]) + share * (math.log(sizes[k]) - math.log(sizes[k - 1]))
    return math.exp(log_b), "fit"


def _floor_power_crossing(sizes: np.ndarray, bests: np.ndarray, tolerance: float
                          ) -> float | None:
    """Where L0 + k B^p, fitted to (sizes, bests), rises `tolerance` above its value at the
    first size; None when the fit has no such rise (fewer than four finite points, k <= 0)."""
    from scipy.optimize import least_squares

    ok = np.isfinite(bests)
    x, v = np.log(sizes[ok] / sizes[0]), bests[ok]
    if len(v) < 4:
        return None
    scale = abs(float(v.min()))

    def residuals(theta: np.ndarray) -> np.ndarray:
        floor, log_k, p = theta
        return (floor + np.exp(log_k + p * x) - v) / scale

    start = np.array([v.min() - 0.001 * scale,
                      math.log(max(v.max() - v.min(), 1e-12 * scale)) - 2.0, 1.0])
    try:
        fit = least_squares(residuals, start, bounds=([-np.inf, -np.inf, 0.25], [np.inf, 50, 8]))
    except ValueError:
        return None
    floor, log_k, p = fit.x
    level = floor + math.exp(log_k)  # the curve at the first size (x = 0)
    rise = ceiling(level, tolerance) - floor
    if not (fit.success and rise > 0 and math.isfinite(log_k)):
        return None
    crossing = (math.log(rise) - log_k) / p
    return float(sizes[0] * math.exp(crossing)) if math.isfinite(crossing) else None
