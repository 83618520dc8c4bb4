"""The optimum of one (N, D) cell of a fixed-budget grid: every run trained on the same D
examples (or tokens), its final loss compared across batch size B and learning rate lr.

- The optimum (B_opt, lr_opt) is the minimum of a quadratic model of the loss over
  (log B, log lr), fitted by least squares to the best grid point and its neighbours (one grid
  spacing around it, two when fewer than six points are there). When the model has no minimum
  inside that neighbourhood the best grid point is the answer (`method` says which).
- A residual bootstrap of that model (refit on fitted + resampled residuals) gives the 95%
  interval of B_opt and lr_opt; without residual degrees of freedom the draws come from the
  near-optimal set instead.
- The near-optimal set (Li et al. 2025, "Step Law") is every configuration whose loss is within
  a relative `tolerance` of the best: loss <= best * (1 + tolerance).
- An optimum on the grid's edge (the smallest or largest batch size, or the smallest or largest
  learning rate tried at its batch size) is only a bound: `edge` is set and the law fits leave
  the cell out. A larger learning rate that diverged brackets the optimum from above.
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
    """Which edge the best grid point sits on ("" when inside)."""
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
    draws: np.ndarray = field(repr=False)
    """Bootstrap draws of (log B_opt, log lr_opt), shape (n, 2)."""


class CellRefused(ValueError):
    """The cell's runs cannot give an optimum; the message says why."""


def configurations(batch_size: np.ndarray, learning_rate: np.ndarray, loss: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One row per (B, lr): the mean loss over its seeds, inf where any seed diverged (a
    non-finite loss). Returns (B, lr, loss, runs)."""
    b = np.asarray(batch_size, float)
    lr = np.asarray(learning_rate, float)
    values = np.asarray(loss, float)
    keys = np.stack([b, lr], axis=1)
    unique, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    out = np.empty(len(unique))
    for k in range(len(unique)):
        chosen = values[inverse == k]
        out[k] = chosen.mean() if np.isfinite(chosen).all() else math.inf
    return unique[:, 0], unique[:, 1], out, len(values)


def cell_optimum(batch_size: np.ndarray, learning_rate: np.ndarray, loss: np.ndarray, *,
                 tolerance: float, bootstrap: int = 200, seed: int = 0) -> CellOptimum:
    """The cell's optimum, near-optimal set and fixed-budget critical batch size (module
    docstring). Raises CellRefused when no configuration has a finite loss."""
    b, lr, values, n_runs = configurations(batch_size, learning_rate, loss)
    finite = np.isfinite(values)
    if not finite.any():
        raise CellRefused("every run diverged (no finite loss)")
    x, y = np.log(b), np.log(lr)
    best = int(np.argmin(np.where(finite, values, np.inf)))
    best_loss = float(values[best])
    edge_reason = _edge(b, lr, best)
    near = finite & (values <= best_loss * (1 + tolerance))
    rng = np.random.default_rng(seed)
    model = _local_quadratic(x, y, values, finite, best, bootstrap, rng)
    if model is None:
        method, opt, model_loss = GRID, np.array([x[best], y[best]]), best_loss
        pool = np.flatnonzero(near)
        draws = np.stack([x[pool], y[pool]], axis=1)[rng.integers(0, len(pool), max(bootstrap,
                                                                                     1))]
    else:
        method, (opt, model_loss, draws) = QUADRATIC, model
    low, high = (np.percentile(draws, q, axis=0) for q in (2.5, 97.5))
    b_crit, b_crit_status = _fixed_budget_bcrit(b, y, values, finite, best_loss, tolerance)
    return CellOptimum(
        batch_size=math.exp(opt[0]), learning_rate=math.exp(opt[1]), loss=float(model_loss),
        best_loss=best_loss, batch_size_low=math.exp(min(low[0], opt[0])),
        batch_size_high=math.exp(max(high[0], opt[0])),
        learning_rate_low=math.exp(min(low[1], opt[1])),
        learning_rate_high=math.exp(max(high[1], opt[1])), method=method,
        edge=bool(edge_reason), edge_reason=edge_reason, n_runs=n_runs, n_configs=len(b),
        n_diverged=int((~finite).sum()), n_near=int(near.sum()),
        near_batch_low=float(b[near].min()), near_batch_high=float(b[near].max()),
        near_lr_low=float(lr[near].min()), near_lr_high=float(lr[near].max()),
        b_crit=b_crit, b_crit_status=b_crit_status, draws=draws)


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
    for box in (1.01, 2.01):
        chosen = finite & (np.abs(u) <= box) & (np.abs(v) <= box)
        if chosen.sum() >= MIN_QUADRATIC_POINTS and len(np.unique(u[chosen])) >= 3 and len(
                np.unique(v[chosen])) >= 3:
            break
    else:
        return None
    design = _design(u[chosen], v[chosen])
    target = values[chosen]
    coef, *_ = np.linalg.lstsq(design, target, rcond=None)
    point = _stationary(coef, box)
    if point is None:
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


def _per_batch_best(y: np.ndarray, values: np.ndarray) -> float:
    """The best loss over learning rates at one batch size: a parabola in log lr through the
    best point and its two neighbours when it is inside, else the best measured."""
    order = np.argsort(y)
    y, values = y[order], values[order]
    i = int(np.argmin(values))
    if 0 < i < len(y) - 1 and np.isfinite(values[i - 1:i + 2]).all():
        a, b, c = np.polyfit(y[i - 1:i + 2], values[i - 1:i + 2], 2)
        if a > 0:
            vertex = -b / (2 * a)
            if y[i - 1] <= vertex <= y[i + 1]:
                return float(min(values[i], c - b * b / (4 * a)))
    return float(values[i])


def _fixed_budget_bcrit(b: np.ndarray, y: np.ndarray, values: np.ndarray, finite: np.ndarray,
                        best_loss: float, tolerance: float) -> tuple[float, str]:
    """The largest batch size whose best loss is within `tolerance` of the cell's best (module
    docstring), and its status."""
    sizes = np.unique(b)
    excess = np.array([
        _per_batch_best(y[(b == s) & finite], values[(b == s) & finite]) / best_loss - 1
        if ((b == s) & finite).any() else math.inf for s in sizes])
    start = int(np.argmin(excess))
    for k in range(start + 1, len(sizes)):
        if excess[k] > tolerance:
            inside = excess[k - 1]
            if not math.isfinite(excess[k]):
                return float(sizes[k - 1]), "fit"
            share = (tolerance - inside) / (excess[k] - inside)
            log_b = math.log(sizes[k - 1]) + share * (math.log(sizes[k]) - math.log(sizes[k - 1]))
            return math.exp(log_b), "fit"
    return float(sizes[-1]), "lower_bound"
