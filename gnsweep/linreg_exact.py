"""Exact expected SGD dynamics of the linreg task: a test oracle for B_crit and the noise scales.

Task (gnsweep.tasks.linreg): `x ~ N(0, diag(lam))`, `y = w*.x + eps`, `eps ~ N(0, sigma^2)`,
model `w.x + b`, loss `0.5 * mean((w.x + b - y)^2)`, plain SGD (no momentum) on fresh batches of
B examples with learning rate lr. With `x~ = (x, 1)`, `delta = (w - w*, b)`, `H = diag(lam, 1)`
and `h` its diagonal, one step is `delta' = delta - lr g_B` with `E[g_B | delta] = H delta` and
`Cov[g_B | delta] = Sigma(delta) / B`, `Sigma = s2 H + G G^T - 2 c^2 e_b e_b^T` (Isserlis, see
tasks/linreg.py). Taking expectations over the batch and then over delta, the diagonal second
moments `m_i = E[delta_i^2]` close on themselves (docs/truth.md derives it):

    m_i' = (1 - lr h_i)^2 m_i + lr^2/B * ((h.m + sigma^2) h_i + a_i m_i)

with `a_i = h_i^2` for a Gaussian input and `a_b = -1` for the bias (its input is the constant 1,
whose fourth moment is 1, not 3). Everything the analysis needs is linear in `m`:

    E L            = 0.5 (h.m + sigma^2)
    E |G|^2        = sum h^2 m              E G^T H G     = sum h^3 m
    E tr(Sigma)    = (h.m + sigma^2) sum h + sum a m
    E tr(H Sigma)  = (h.m + sigma^2) sum h^2 + sum h a m

The noise scales here are ratios of expectations, `E tr(Sigma) / E|G|^2` (eq. 2.9) and
`E tr(H Sigma) / E G^T H G` (eq. 2.8): those are what set the expected progress of one step,
`E L' - E L = -lr E|G|^2 + lr^2/2 (E G^T H G + E tr(H Sigma)/B)` (exact for a quadratic), hence
the optimal step `lr_max / (1 + B_noise/B)` of the paper's section 2.2 for the expected loss.

Pure numpy (the hyperbola fit reuses the project's `analysis.fit`); no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gnsweep.analysis.fit import FitRefused, fit_hyperbola


@dataclass(frozen=True)
class Problem:
    """One linreg problem seen through the second moments of `delta` along H's eigenbasis."""

    h: np.ndarray
    """Diagonal of H: the input variances, then 1 for the bias (when there is one)."""
    a: np.ndarray
    """Fourth-moment coefficients: h_i^2 for Gaussian inputs, -1 for the bias."""
    m0: np.ndarray
    """Initial second moments E[delta_i^2] (delta_0^2 for a fixed initialisation)."""
    noise: float
    """Label-noise standard deviation sigma (loss floor sigma^2 / 2)."""

    @classmethod
    def linreg(cls, variances: np.ndarray, delta0: np.ndarray, noise: float, *, bias: bool = True
               ) -> Problem:
        """From the task's input variances and the initial `delta = (w0 - w*, b0)` (or its
        second moments, when given as E[delta^2] via `delta0 = sqrt(m0)`)."""
        lam = np.asarray(variances, float)
        h = np.concatenate([lam, [1.0]]) if bias else lam
        a = np.concatenate([lam ** 2, [-1.0]]) if bias else lam ** 2
        d0 = np.asarray(delta0, float)
        if d0.shape != h.shape:
            raise ValueError(f"delta0 has {d0.shape[0]} entries, need {h.shape[0]}")
        return cls(h=h, a=a, m0=d0 ** 2, noise=float(noise))

    def at(self, delta: np.ndarray) -> Problem:
        """The same problem started from the parameters `delta = (w - w*, b)` of a given state
        (a checkpoint's): the expected dynamics from there on, m0 = delta^2. A fixed state has
        no spread, so its second moments are the squares; the diagonal recursion needs nothing
        else (H is diagonal, module docstring)."""
        d = np.asarray(delta, float)
        if d.shape != self.h.shape:
            raise ValueError(f"delta has {d.shape} entries, need {self.h.shape}")
        return Problem(h=self.h, a=self.a, m0=d ** 2, noise=self.noise)

    @property
    def floor(self) -> float:
        """The loss at the optimum, sigma^2 / 2."""
        return 0.5 * self.noise ** 2

    # -- quantities linear in m (m has H's dimension last; any leading shape) -------------

    def loss(self, m: np.ndarray) -> np.ndarray:
        return 0.5 * (m @ self.h + self.noise ** 2)

    def g2(self, m: np.ndarray) -> np.ndarray:
        return m @ self.h ** 2

    def g_h_g(self, m: np.ndarray) -> np.ndarray:
        return m @ self.h ** 3

    def trace_sigma(self, m: np.ndarray) -> np.ndarray:
        return (m @ self.h + self.noise ** 2) * self.h.sum() + m @ self.a

    def trace_h_sigma(self, m: np.ndarray) -> np.ndarray:
        return (m @ self.h + self.noise ** 2) * (self.h ** 2).sum() + m @ (self.h * self.a)

    def b_simple(self, m: np.ndarray) -> np.ndarray:
        """E tr(Sigma) / E |G|^2 (eq. 2.9 with expectations over SGD's randomness)."""
        return self.trace_sigma(m) / self.g2(m)

    def b_noise(self, m: np.ndarray) -> np.ndarray:
        """E tr(H Sigma) / E G^T H G (eq. 2.8 with expectations over SGD's randomness)."""
        return self.trace_h_sigma(m) / self.g_h_g(m)

    # -- the recursion ----------------------------------------------------------------------

    def step(self, m: np.ndarray, lr: np.ndarray | float, batch: np.ndarray | float
             ) -> np.ndarray:
        """One SGD step of the second moments; `lr`, `batch` broadcast against m[..., 0]."""
        lr = np.asarray(lr, float)[..., None]
        batch = np.asarray(batch, float)[..., None]
        scale = (m @ self.h)[..., None] + self.noise ** 2
        return (1 - lr * self.h) ** 2 * m + lr ** 2 / batch * (scale * self.h + self.a * m)

    def moments(self, lr: float, batch: float, steps: int) -> np.ndarray:
        """m after 0..steps updates: shape (steps + 1, dim)."""
        out = np.empty((steps + 1, len(self.h)))
        out[0] = self.m0
        for s in range(steps):
            out[s + 1] = self.step(out[s], lr, batch)
        return out

    def loss_curve(self, lr: float, batch: float, steps: int) -> np.ndarray:
        """Expected loss after 0..steps updates (index s: the parameters after s updates)."""
        return self.loss(self.moments(lr, batch, steps))

    def transfer(self, lr: float, batch: float) -> np.ndarray:
        """The matrix A of the affine map m' = A m + lr^2 sigma^2 h / B."""
        q = 1 - lr * self.h
        return np.diag(q ** 2 + lr ** 2 / batch * self.a) + lr ** 2 / batch * np.outer(self.h,
                                                                                     self.h)

    def stable(self, lr: float, batch: float) -> bool:
        """Whether the second moments converge: spectral radius of `transfer` below 1."""
        return bool(np.max(np.abs(np.linalg.eigvals(self.transfer(lr, batch)))) < 1)

    def max_stable_lr(self, batch: float) -> float:
        """Largest stable learning rate at this batch size (bisection; 2 / h_max as B -> inf)."""
        lo, hi = 0.0, 2.0 / self.h.max()
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if self.stable(mid, batch) else (lo, mid)
        return lo

    # -- steps to target --------------------------------------------------------------------

    def steps_to_target(self, lr: np.ndarray, batch: np.ndarray, targets: list[float], *,
                        max_steps: int = 100_000, race: bool = False) -> np.ndarray:
        """Fractional steps until the expected loss reaches each target: shape
        (len(targets), *broadcast(lr, batch)); inf where it never does within max_steps.
        `race=True` stops as soon as every target has been reached by some entry (the others
        stay inf: they are slower), which is all a minimum over lr needs.

        Step s means the parameters after s updates; between s-1 and s the loss is interpolated
        linearly, so S varies smoothly with lr (the integer step is ceil(S)).
        """
        lr, batch = np.broadcast_arrays(np.asarray(lr, float), np.asarray(batch, float))
        targets_arr = np.asarray(sorted(targets, reverse=True), float)
        m = np.broadcast_to(self.m0, (*lr.shape, len(self.h))).copy()
        loss = self.loss(m)
        found = np.full((len(targets_arr), *lr.shape), np.inf)
        found[loss[None] <= targets_arr.reshape(-1, *[1] * lr.ndim)] = 0.0
        start = float(self.loss(self.m0))
        for s in range(1, max_steps + 1):
            m = self.step(m, lr, batch)
            new = self.loss(m)
            for k, t in enumerate(targets_arr):
                hit = np.isinf(found[k]) & (new <= t)
                if hit.any():
                    frac = (loss[hit] - t) / (loss[hit] - new[hit])
                    found[k][hit] = s - 1 + frac
            loss = new
            # Stop when every target is reached or the rest diverge / stall.
            open_ = np.isinf(found[-1]) & np.isfinite(loss) & (loss < 10 * start)
            if not open_.any() or (race and np.isfinite(found).any(axis=tuple(
                    range(1, found.ndim))).all()):
                break
        return found

    def best_steps(self, batch: float, targets: list[float], *, n_lr: int = 96,
                   zoom: int = 2, max_steps: int = 100_000) -> tuple[np.ndarray, np.ndarray]:
        """S(B) = min over lr of the steps to each target, and the optimal lr (per target, in
        descending order of target).

        A log grid of n_lr rates up to the stability limit, then `zoom` rounds of a finer grid
        between the best point's neighbours.
        """
        targets = sorted(targets, reverse=True)
        top = self.max_stable_lr(batch)
        lrs = np.geomspace(top * 1e-4, top * 0.999, n_lr)
        s = self.steps_to_target(lrs, np.full(n_lr, float(batch)), targets, max_steps=max_steps,
                                 race=True)
        best_s = np.full(len(targets), np.inf)
        best_lr = np.full(len(targets), np.nan)
        for k in range(len(targets)):
            grid, values = lrs, s[k]
            for _ in range(zoom + 1):
                i = int(np.argmin(values))
                if values[i] < best_s[k]:
                    best_s[k], best_lr[k] = values[i], grid[i]
                if not np.isfinite(values[i]):
                    break
                lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
                grid = np.geomspace(lo, hi, 17)
                values = self.steps_to_target(grid, np.full(len(grid), float(batch)),
                                              [targets[k]],
                                              max_steps=max_steps, race=True)[0]
        return best_s, best_lr

    # -- a fixed budget of examples (`gnsweep laws`): every run trains on the same D -------

    def budget_loss(self, lr: np.ndarray, batch: float, examples: float) -> np.ndarray:
        """Expected loss after `examples` examples at batch size `batch`, for each lr: after
        examples / batch updates, linear between the integer steps around a fractional count
        (as `steps_to_target` interpolates). inf where the moments blow up."""
        lr = np.atleast_1d(np.asarray(lr, float))
        steps = examples / batch
        whole = math.floor(steps)
        m = np.broadcast_to(self.m0, (len(lr), len(self.h))).copy()
        with np.errstate(over="ignore", invalid="ignore"):
            for _ in range(whole):
                m = self.step(m, lr, batch)
            loss = self.loss(m)
            if steps > whole:
                after = self.loss(self.step(m, lr, batch))
                loss = loss + (steps - whole) * (after - loss)
        return np.where(np.isfinite(loss), loss, np.inf)

    def best_budget_loss(self, batch: float, examples: float, *, n_lr: int = 48,
                         zoom: int = 3) -> tuple[float, float]:
        """(lowest expected loss over lr after `examples` examples at `batch`, its lr): a log
        grid up to the stability limit, then `zoom` finer grids around the best point."""
        top = self.max_stable_lr(batch)
        grid = np.geomspace(top * 1e-4, top * 0.999, n_lr)
        best, best_lr = math.inf, math.nan
        for _ in range(zoom + 1):
            values = self.budget_loss(grid, batch, examples)
            i = int(np.argmin(values))
            if values[i] < best:
                best, best_lr = float(values[i]), float(grid[i])
            grid = np.geomspace(grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)], 9)
        return best, best_lr

    def fixed_budget_bcrit(self, examples: float, tolerance: float, smallest: float = 1.0,
                           largest: float = 4096.0) -> float:
        """The exact fixed-budget critical batch size: the largest batch size whose best loss
        after `examples` examples is within `tolerance` (relative) of the best over batch sizes
        >= `smallest` (plain SGD at a fixed budget loses nothing to a smaller batch, so the
        best is at `smallest`; `gnsweep laws` finds the same on a grid starting there).
        Bisection in log B between `smallest` and `largest` (NaN when `largest` stays inside)."""
        floor = self.best_budget_loss(smallest, examples)[0]

        def outside(batch: float) -> bool:
            return self.best_budget_loss(batch, examples)[0] > floor * (1 + tolerance)

        if not outside(largest):
            return math.nan
        lo, hi = math.log(smallest), math.log(largest)
        for _ in range(20):  # log B to 2^-20 of its range
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if outside(math.exp(mid)) else (mid, hi)
        return math.exp(0.5 * (lo + hi))

    # -- limits: S_min (B -> inf, gradient descent) and E_min (B -> 0, lr = eta B) ----------

    def s_min(self, target: float) -> float:
        """Exact large-batch limit: plain GD, m_i(s) = (1 - lr h_i)^(2s) m0_i, min over lr.

        Continuous s: the first root of E L(s) = target (scan, then bisection) per lr.
        """
        def steps(lr: float) -> float:
            rate = np.log((1 - lr * self.h) ** 2)
            return self._first_time(
                lambda s: self.loss(self.m0 * np.exp(np.multiply.outer(s, rate))), target)

        return _minimize(steps, 1e-4, 0.999 * 2 / self.h.max())

    def e_min(self, target: float) -> float:
        """Exact small-batch limit: with lr = eta B and t = B s examples, B -> 0 turns the
        recursion into the linear ODE dm/dt = K m + eta^2 sigma^2 h,
        K = -2 eta diag(h) + eta^2 (diag(a) + h h^T); E_min is the fewest examples to the
        target over eta (eigendecomposition of K; scan, then bisection in t)."""
        sigma2 = self.noise ** 2

        def examples(eta: float) -> float:
            k = -2 * eta * np.diag(self.h) + eta ** 2 * (np.diag(self.a) + np.outer(self.h, self.h))
            vals, vecs = np.linalg.eig(k)
            if np.max(vals.real) >= 0:
                return math.inf
            fixed = -np.linalg.solve(k, eta ** 2 * sigma2 * self.h)  # the ODE's fixed point
            coef = np.linalg.solve(vecs, self.m0 - fixed)

            def loss_at(t):
                m = (np.exp(np.multiply.outer(np.asarray(t, float), vals)) * coef) @ vecs.T
                return self.loss(m.real + fixed)

            return self._first_time(loss_at, target)

        return _minimize(examples, 1e-5, 10.0 / self.h.sum())

    def _first_time(self, loss_at, target: float) -> float:
        """First t >= 0 with loss_at(t) <= target (loss_at takes arrays of t)."""
        if loss_at(0.0) <= target:
            return 0.0
        hi = 1.0
        while loss_at(hi) > target:
            hi *= 2
            if hi > 1e12:
                return math.inf
        # Scan for the first crossing at this resolution, then bisect inside the bracket.
        grid = np.linspace(0.0, hi, 257)
        values = loss_at(grid)
        j = int(np.argmax(values <= target))
        lo, hi = grid[j - 1], grid[j]
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if loss_at(mid) <= target else (mid, hi)
        return hi

    # -- noise scales along a path -----------------------------------------------------------

    def weighted_means(self, lr: float, batch: float, steps: float) -> tuple[float, float]:
        """S_min-weighted means of B_simple and B_noise over the first `steps` updates of the
        expected path at (lr, batch): weights dS / (1 + b/B) with each quantity's own b, exactly
        as the analysis weighs logged rows (steps.py `_RunningMeans`: row s holds the value at
        the parameters before update s, for s = 1..ceil(steps))."""
        n = max(math.ceil(steps), 1)
        m = self.moments(lr, batch, n - 1)
        out = []
        for b in (self.b_simple(m), self.b_noise(m)):
            w = 1.0 / (1.0 + b / batch)
            out.append(float((w * b).sum() / w.sum()))
        return out[0], out[1]


def _median(values: np.ndarray) -> float:
    """Median of the finite values; NaN (without numpy's warning) when there are none: a target
    that no batch size reaches."""
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if len(finite) else math.nan


def _minimize(fn, lo: float, hi: float, n: int = 64, zoom: int = 3) -> float:
    """Minimum of fn over [lo, hi] on a log grid, refined `zoom` times around the best point."""
    grid = np.geomspace(lo, hi, n)
    best = math.inf
    for _ in range(zoom + 1):
        values = np.array([fn(x) for x in grid])
        i = int(np.argmin(values))
        best = min(best, float(values[i]))
        if not np.isfinite(values[i]):
            break
        grid = np.geomspace(grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)], 9)
    return best


@dataclass(frozen=True)
class TargetTruth:
    """The exact answer at one target."""

    target: float
    s_min: float
    """Large-batch limit of S (plain GD at its best lr)."""
    e_min: float
    """Small-batch limit of E = B S."""
    b_crit_limits: float
    """e_min / s_min: B_crit from the two limits (eq. 2.12 without a fit)."""
    b_crit_fit: float
    """B_crit of the project's fit of S = S_min + E_min/B (eq. 2.11) to the exact S(B) on the
    batch grid: what a perfect sweep on that grid would report."""
    s_min_fit: float
    e_min_fit: float
    rmse_log: float
    """How well the hyperbola describes the exact S(B) on the grid."""
    b_simple_mean: float
    """Median over the grid's batch sizes of the S_min-weighted mean of B_simple on each
    batch size's best-lr expected path up to the target (as the analysis takes the median)."""
    b_noise_mean: float
    b_simple_at_target: float
    b_noise_at_target: float


@dataclass(frozen=True)
class Truth:
    batch_sizes: np.ndarray
    steps: np.ndarray
    """Exact S(B): shape (len(targets), len(batch_sizes))."""
    best_lr: np.ndarray
    targets: list[float]
    per_target: list[TargetTruth]
    b_simple_mean: np.ndarray
    """Per target and batch size: S_min-weighted mean of B_simple up to the target."""
    b_noise_mean: np.ndarray


def exact_truth(problem: Problem, batch_sizes: list[int], targets: list[float], *,
                max_steps: int = 100_000, limits: bool = True) -> Truth:
    """Exact S(B) at the best lr for every batch size and target, the fitted and the limit
    B_crit, and the noise scales along the best paths (see `TargetTruth`)."""
    targets = sorted(targets, reverse=True)
    b = np.asarray(batch_sizes, float)
    steps = np.empty((len(targets), len(b)))
    lrs = np.empty_like(steps)
    for j, batch in enumerate(b):
        steps[:, j], lrs[:, j] = problem.best_steps(batch, targets, max_steps=max_steps)
    simple = np.full_like(steps, np.nan)
    noise = np.full_like(steps, np.nan)
    at_simple = np.full_like(steps, np.nan)
    at_noise = np.full_like(steps, np.nan)
    for k in range(len(targets)):
        for j, batch in enumerate(b):
            if np.isfinite(steps[k, j]):
                simple[k, j], noise[k, j] = problem.weighted_means(lrs[k, j], batch, steps[k, j])
                m = problem.moments(lrs[k, j], batch, max(math.ceil(steps[k, j]) - 1, 0))[-1]
                at_simple[k, j], at_noise[k, j] = problem.b_simple(m), problem.b_noise(m)
    per = []
    for k, target in enumerate(targets):
        s_min = problem.s_min(target) if limits else math.nan
        e_min = problem.e_min(target) if limits else math.nan
        ok = np.isfinite(steps[k])
        try:
            fit = fit_hyperbola(b[ok], steps[k, ok])
            fitted = (fit.b_crit, fit.s_min, fit.e_min, fit.rmse_log)
        except FitRefused:
            fitted = (math.nan,) * 4
        per.append(TargetTruth(
            target=target, s_min=s_min, e_min=e_min, b_crit_limits=e_min / s_min,
            b_crit_fit=fitted[0], s_min_fit=fitted[1], e_min_fit=fitted[2], rmse_log=fitted[3],
            b_simple_mean=_median(simple[k]),
            b_noise_mean=_median(noise[k]),
            b_simple_at_target=_median(at_simple[k]),
            b_noise_at_target=_median(at_noise[k])))
    return Truth(b, steps, lrs, targets, per, simple, noise)


@dataclass(frozen=True)
class LocalTruth:
    """The exact answer at one branch point: the critical batch size of short runs started from
    the point's own parameters, to targets below the loss there, and the noise scales there."""

    loss: float
    """Expected (here exact) loss at the point: 0.5 (delta^T H delta + sigma^2)."""
    b_simple: float
    """tr(Sigma)/|G|^2 at the point (eq. 2.9)."""
    b_noise: float
    """tr(H Sigma)/G^T H G at the point (eq. 2.8): the paper's local critical batch size."""
    per_target: list[TargetTruth]
    """Per absolute target (descending), the exact S(B) fitted by eq. 2.11 (`exact_truth`)."""


def local_truth(problem: Problem, delta: np.ndarray, batch_sizes: list[int],
                targets: list[float], *, max_steps: int = 100_000) -> LocalTruth:
    """Exact local B_crit from a branch point: `exact_truth` of the problem started at `delta`
    (`Problem.at`), to the given absolute targets, with the noise scales at the point itself.
    A target at or below the loss floor is never reached: its fit is NaN."""
    local = problem.at(delta)
    truth = exact_truth(local, batch_sizes, targets, max_steps=max_steps, limits=False)
    return LocalTruth(loss=float(local.loss(local.m0)), b_simple=float(local.b_simple(local.m0)),
                      b_noise=float(local.b_noise(local.m0)), per_target=truth.per_target)


# -- Monte-Carlo SGD on the same problem (for tests and for simulated loss curves) -----------


def simulate_sgd(problem: Problem, delta0: np.ndarray, lr: float, batch: int, steps: int,
                 runs: int, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`runs` independent plain-SGD runs on fresh Gaussian batches, all from `delta0`; the
    gradients are written out from sampled inputs (`r x~`), not from the recursion.

    Returns (batch_loss, population_loss, delta), the first two (runs, steps + 1):
    batch_loss[:, s] is the loss of the batch drawn for update s+1 at the parameters after s
    updates (NaN in the last column), population_loss[:, s] the exact expected loss
    0.5 (delta^T H delta + sigma^2) there; delta (runs, dim) the final parameters' error.
    """
    h = problem.h
    gaussian = problem.a > 0  # the bias coordinate has the constant input 1
    delta = np.broadcast_to(np.asarray(delta0, float), (runs, len(h))).copy()
    batch_loss = np.full((runs, steps + 1), np.nan)
    pop = np.empty((runs, steps + 1))
    sd = np.sqrt(h)
    for s in range(steps + 1):
        pop[:, s] = 0.5 * ((delta ** 2) @ h + problem.noise ** 2)
        if s == steps:
            break
        x = rng.standard_normal((runs, batch, len(h))) * sd
        x[..., ~gaussian] = 1.0
        residual = np.einsum("rbi,ri->rb", x, delta) - problem.noise * rng.standard_normal(
            (runs, batch))
        batch_loss[:, s] = 0.5 * (residual ** 2).mean(1)
        grad = np.einsum("rb,rbi->ri", residual, x) / batch
        delta -= lr * grad
    return batch_loss, pop, delta
