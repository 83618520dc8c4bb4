"""Steps-to-target: the first (interpolated) step at which a run's loss reaches each target.

Every loss refers to the parameters after the same number of updates: the training loss logged
at step s was computed before update s (after s - 1 updates), the eval loss after it (s). The
default "smoothed" loss is a centred local-linear smooth of the raw training loss
(`analysis.smoothing.centred_fit`, half-width max(fraction x steps, MIN_WINDOW_EXAMPLES / samples
a step)): no lag, unlike the training loop's causal EMA (`loss_smooth`, used only where no raw
loss is logged or with `ema_examples`). A target is never read as reached before one update
(`MIN_REACH_UPDATES`): not inside a run's first step. Nor is a smoothed loss read before the
run trained on MIN_WINDOW_EXAMPLES samples: there the smallest window is cut by the run's start
and the value is mostly its first rows' (the local line extrapolated to the window's edge; a
causal EMA of a few batches). A target already met where the window becomes whole is not
counted (outcome `early`).

Works on `Curves`: every run's logged rows concatenated into flat numpy arrays with offsets, so a
sweep of 1,000 runs x 2,000 steps is a handful of vectorized passes, not a Python loop per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import pandas as pd

from gnsweep.analysis.smoothing import (
    MIN_REACH_UPDATES,
    MIN_WINDOW_EXAMPLES,
    SMOOTHING_FRACTION,
    RunSmoother,
    interpolate_log_steps,
    pooled_probes,
)
from gnsweep.tables import BEST_VALUE, CURVE_COLUMNS, columns
from gnsweep.targets import FALLING, Direction

LOSS_COLUMNS = {"smoothed": "loss_smooth", "raw": "loss", "eval": "eval_loss",
                "metric": "metric"}
"""Which logged column decides a target; "metric" is a task's own (cartpole's return)."""
RUN_COLUMNS = ["run_id", "batch_size", "learning_rate", "seed", "state"]
EARLY = "early"
"""The outcome of a loss target already met where the run's smoothing window first holds
MIN_WINDOW_EXAMPLES samples: when it got there is unknown, so not counted (neither a point of
the front nor a bound), said in one warning."""

STEPS_COLUMNS = columns("steps")
DRIFT_LIMIT = 2.0
"""A step's drift flag: |G|^2 changed more than this factor inside the noise-scale window."""


@dataclass
class Curves:
    """Logged rows of many runs: run i owns rows offsets[i]:offsets[i+1] of every array."""

    runs: pd.DataFrame
    """One row per run: run_id, batch_size, learning_rate, seed, state."""
    offsets: np.ndarray
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    """CURVE_COLUMNS (float64, NaN when absent)."""
    derived: dict[str, object] = field(default_factory=dict, repr=False, compare=False)
    """What the analysis computes from the curves whatever the smoothing window (the noise
    scales' running means, the smoothers' prefix sums), kept for the refits at half and double
    the window. Curves are read-only."""

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def curves_from_frames(runs: pd.DataFrame, metrics: pd.DataFrame) -> Curves:
    """Curves from a runs table and a long metrics table with a run_id column (any row order)."""
    runs = runs.reset_index(drop=True)
    position = pd.Series(np.arange(len(runs)), index=runs["run_id"].astype(str))
    index = metrics["run_id"].astype(str).map(position)
    keep = index.notna().to_numpy()
    index = index.to_numpy()[keep].astype(np.int64)
    step = pd.to_numeric(metrics["step"], errors="coerce").to_numpy(float)[keep]
    order = np.lexsort((step, index))
    columns = {}
    for name in CURVE_COLUMNS:
        if name in metrics:
            values = pd.to_numeric(metrics[name], errors="coerce").to_numpy(float)[keep]
        else:
            values = np.full(int(keep.sum()), np.nan)
        columns[name] = values[order]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(index, minlength=len(runs)))])
    return Curves(runs, offsets.astype(np.int64), columns)


def resmooth(curves: Curves, ema_examples: float) -> np.ndarray:
    """Bias-corrected EMA of the raw loss with a time constant in examples (paper appendix A).

    Per logged row the past decays by exp(-B * dstep / ema_examples), the same rule the training
    loop uses for `loss_smooth`, so every batch size averages over the same number of examples.
    """
    from scipy.signal import lfilter

    loss, step = curves.columns["loss"], curves.columns["step"]
    out = np.full(len(loss), np.nan)
    batch = curves.runs["batch_size"].to_numpy(float)
    for i, (lo, hi) in enumerate(zip(curves.offsets[:-1], curves.offsets[1:], strict=True)):
        if hi <= lo:
            continue
        gaps = np.diff(step[lo:hi])
        every = float(np.median(gaps)) if len(gaps) else 1.0
        decay = math.exp(-batch[i] * max(every, 1.0) / ema_examples)
        total = lfilter([1.0], [1.0, -decay], loss[lo:hi])
        weight = lfilter([1.0], [1.0, -decay], np.ones(hi - lo))
        out[lo:hi] = total / weight
    return out


def centred_loss(curves: Curves, fraction: float = SMOOTHING_FRACTION,
                  min_samples: float = MIN_WINDOW_EXAMPLES, column: str = "loss") -> np.ndarray:
    """A loss column of every run smoothed by a centred local-linear window (no lag):
    half-width max(fraction * x, min_samples / samples a step) at x updates
    (`smoothing.centred_fit`, `samples_per_step`)."""
    loss = curves.columns[column]
    batch = samples_per_step(curves.runs)
    key = f"smoother:{column}"
    smoother = curves.derived.get(key)
    if not isinstance(smoother, RunSmoother):  # built once, reused at every window
        x = curves.columns["step"] if column == "eval_loss" else _updates(curves)
        smoother = curves.derived[key] = RunSmoother(x, loss, curves.offsets)
    return smoother.fit(fraction, min_samples / batch)


def samples_per_step(runs: pd.DataFrame) -> np.ndarray:
    """Each run's samples a step (the batch's first dimension: a language model's sequences):
    the `samples` column where the runs table has it and it is known (> 0), else its batch
    size (a table written elsewhere, an adaptive run: its unit taken for samples)."""
    batch = runs["batch_size"].to_numpy(float)
    if "samples" not in runs:
        return batch
    samples = pd.to_numeric(runs["samples"], errors="coerce").to_numpy(float)
    return np.where(np.isfinite(samples) & (samples > 0), samples, batch)


def loss_curve(curves: Curves, loss: str, ema_examples: float | None = None,
               smoothing: float = SMOOTHING_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(updates, loss) per row for the chosen loss: the training losses at step - 1 updates
    (computed before update `step`), the eval loss at `step`. The eval loss is smoothed with
    the same centred window as the training loss: even the exact population loss of one run
    fluctuates with its parameters, and the first crossing of a fluctuating curve comes early
    (on linreg_truth the unsmoothed exact loss gave B_crit 0.55-0.75 of the exact one)."""
    step = curves.columns["step"]
    updates = _updates(curves)
    if loss == "metric":  # a task's own metric, already a window mean (cartpole's return)
        return updates, curves.columns["metric"]
    if loss == "eval":
        return step, centred_loss(curves, smoothing, column="eval_loss")
    if loss == "raw":
        return updates, curves.columns["loss"]
    if ema_examples:
        return updates, resmooth(curves, ema_examples)
    if not np.isfinite(curves.columns["loss"]).any():
        return updates, curves.columns["loss_smooth"]  # a table without the raw loss
    return updates, centred_loss(curves, smoothing)


def _updates(curves: Curves) -> np.ndarray:
    """Updates before each logged training loss (step - 1), computed once per `Curves`."""
    updates = curves.derived.get("updates")
    if not isinstance(updates, np.ndarray):
        updates = curves.derived["updates"] = curves.columns["step"] - 1.0
    return updates


def noise_rows(curves: Curves, scale: str) -> np.ndarray:
    """Per-row B_simple ("simple") or B_noise ("noise"): from the frozen-parameter probes where a
    run has them (pooled over +-1 octave before the ratio, `smoothing.pooled_probes`), else the
    training loop's EMA column. Without probes that column itself: read-only, as the curves."""
    num, den = (("probe_trace_sigma", "probe_g2") if scale == "simple"
                else ("probe_trace_h_sigma", "probe_g_h_g"))
    column = curves.columns[f"b_{scale}"]
    numerator, denominator = curves.columns[num], curves.columns[den]
    probed = np.isfinite(numerator) & np.isfinite(denominator)
    if not probed.any():
        return column
    out = column.copy()
    x = curves.columns["step"] - 1.0
    for lo, hi in zip(curves.offsets[:-1], curves.offsets[1:], strict=True):
        at = np.flatnonzero(probed[lo:hi])
        if len(at):
            out[lo:hi] = pooled_probes(x[lo:hi][at], numerator[lo:hi][at],
                                       denominator[lo:hi][at], x[lo:hi])
    return out


def steps_to_target(metrics: pd.DataFrame | Curves, runs: pd.DataFrame | None, targets: list[float],
                    loss: str = "smoothed", ema_examples: float | None = None,
                    smoothing: float = SMOOTHING_FRACTION,
                    direction: Direction | bool = FALLING) -> pd.DataFrame:
    """One row per (run, target): whether and when the run reached the target.

    `metrics` is a long table (run_id, step, the loss column, b_simple, ...) with `runs`
    (run_id, batch_size, learning_rate, seed, state), or `Curves` (then `runs` is ignored).
    Runs that never reach a target, diverged, failed or have no metrics keep a row with
    reached=False, steps=NaN and `outcome` saying why: marked, never dropped. A diverged run
    counts as not reaching any target, even one passed before it diverged: an unstable learning
    rate is not a usable one. `steps` is interpolated between the last row above the target and
    the first at or below it (`loss_curve` says which loss and which update count).

    Besides the step, each row carries B_simple when the target was reached and B_simple averaged
    over the run up to it with S_min weights `dS / (1 + B_simple/B)` (DESIGN.md): B_crit at a
    target is the S_min-weighted mean of the noise scale over the path to it. The same for
    B_noise (eq. 2.8) where measured, for the exact values where logged (`b_*_true_mean`), and
    `drift_share`: the share of rows up to the target whose drift flag says |G|^2 changed more
    than 2x inside the noise-scale window.

    `direction` (`RISING` for a task's metric such as a return): a target is reached when the
    value rises to it, and the `min_loss` column (`BEST_VALUE`) holds the best (largest) value
    reached.

    `lr_share`: the learning rate logged at the target over the run's largest logged one (NaN
    where no learning rate is logged, or when the target came before the peak, in a warmup): how
    far its schedule had decayed when it got there.

    The smoothed loss is not read before the run trained on MIN_WINDOW_EXAMPLES (64) samples,
    at fewer than 64 / samples-a-step updates: the smoothing's smallest window there is cut by
    the run's start, so the value is mostly its first rows' (a run that blew up: the local line
    through its rising first losses, extrapolated to step 0, lies far below any loss it
    logged). A crossing is the first one after that. A target already met at the first row read
    has reached=False, steps NaN and outcome `early` (EARLY): when the run got there is unknown.
    Not a point, and not a bound either (`front.censored_points` leaves such a batch size out).
    From 64 samples a step up nothing changes: the first update is 64 samples and
    `MIN_REACH_UPDATES` already counts a target met by then as one step. A task's own metric
    (already a window mean, read as logged) and the raw loss (one batch at every row, early or
    late) are exempt.
    """
    curves = metrics if isinstance(metrics, Curves) else curves_from_frames(runs, metrics)
    x, values = loss_curve(curves, loss, ema_examples, smoothing)
    # Every comparison below is the loss's: the direction turns a rising metric's values and
    # targets lower-is-better (NaN, a metric not measured yet, reaches nothing either way).
    direction = Direction.of(direction)
    sign = direction.sign
    values = direction.as_loss(values)
    n_runs = len(curves.runs)
    starts, ends = curves.offsets[:-1], curves.offsets[1:]
    has_rows = ends > starts
    batch = curves.runs["batch_size"].to_numpy(float)
    state = curves.runs["state"].astype(str).to_numpy()
    usable = has_rows & (state != "diverged")
    step = curves.columns["step"]
    # Updates below which the smallest window is cut by the run's start: rows read from there
    # on, where that lies past the first update (before it MIN_REACH_UPDATES rules: a target
    # met there is met in one step). The raw loss (one batch at every row, the noise its reader
    # chose) and a metric (read as logged) have no window.
    settled_from = (np.zeros(n_runs) if loss in ("metric", "raw")
                    else MIN_WINDOW_EXAMPLES / samples_per_step(curves.runs))
    settled_from = np.where(settled_from > MIN_REACH_UPDATES, settled_from, 0.0)
    read = x >= np.repeat(settled_from, curves.lengths) * (1 - 1e-9)
    first_read = _first_true(read, curves.offsets)
    # Met at the first row read: when the run got there is unknown (`EARLY`).
    unresolved_start = settled_from > 0

    best_value = np.full(n_runs, np.nan)
    last_step = np.full(n_runs, np.nan)
    if has_rows.any():
        # Never better than any value the run logged: a local-linear window at a blow-up (a
        # NaN loss after a steep rise) can dip below every logged loss, even below zero.
        logged = direction.as_loss(_logged(curves, loss))
        with np.errstate(invalid="ignore"):
            best_value[has_rows] = sign * np.fmax(np.fmin.reduceat(values, starts[has_rows]),
                                                np.fmin.reduceat(logged, starts[has_rows]))
        last_step[has_rows] = step[ends[has_rows] - 1]
    lr = curves.columns["lr"]
    peak_lr = np.full(n_runs, np.nan)
    peak_at = ends.copy()  # the row of each run's peak learning rate
    if has_rows.any() and np.isfinite(lr).any():
        for i in np.flatnonzero(has_rows).tolist():
            part = lr[starts[i]:ends[i]]
            if np.isfinite(part).any():
                j = int(np.nanargmax(part))
                peak_lr[i], peak_at[i] = part[j], starts[i] + j
    simple, noise, simple_true, noise_true, flag_sum = _noise_sums(curves)
    precond = _precond_sums(curves)

    base = curves.runs[RUN_COLUMNS[:4]].reset_index(drop=True)
    parts = []
    for target in sorted(targets, reverse=True):
        first = (_first_at_or_below(values, curves.offsets, sign * target, read)
                 if usable.any() else ends)
        reached = usable & (first < ends)
        early = reached & (first == first_read) & unresolved_start
        reached &= ~early
        at = np.where(reached, first, 0)
        steps = np.where(reached, _interpolated(x, values, at, starts, sign * target), np.nan)
        # Never inside the first step: at least one update (training losses sit at step - 1).
        steps = np.where(reached, np.maximum(steps, MIN_REACH_UPDATES), np.nan)
        outcome = np.where(reached, "reached", np.where(has_rows, "not_reached", "no_metrics"))
        outcome = np.where(early, EARLY, outcome)
        outcome = np.where(state == "diverged", "diverged", outcome)
        # A run still training has not failed to reach what it has not reached yet.
        outcome = np.where((state == "running") & ~reached, "running", outcome)
        # Runs without metrics that did not finish say why: pending, running, failed, corrupt.
        outcome = np.where(~has_rows & (state != "done"), state, outcome)
        part = base.copy()
        part["target"] = float(target)
        part["state"] = state
        part["reached"] = reached
        part["steps"] = steps
        part["examples"] = steps * batch
        part["b_simple_at_target"], part["b_simple_mean"] = simple.at(at, reached)
        part["outcome"] = outcome
        part["b_noise_at_target"], part["b_noise_mean"] = noise.at(at, reached)
        part[BEST_VALUE] = best_value
        part["last_step"] = last_step
        part["b_simple_true_mean"] = simple_true.at(at, reached)[1]
        part["b_noise_true_mean"] = noise_true.at(at, reached)[1]
        with np.errstate(invalid="ignore", divide="ignore"):
            share = (flag_sum[at + 1] - flag_sum[starts]) / (at + 1 - starts)
        part["drift_share"] = np.where(reached, share, np.nan)
        part["b_simple_precond_at_target"], part["b_simple_precond_mean"] = precond.at(at,
                                                                                      reached)
        with np.errstate(invalid="ignore", divide="ignore"):
            lr_share = lr[at] / peak_lr if len(lr) else np.full(n_runs, np.nan)
        # Only a decay counts: a target met during a warmup, before the peak, is not late.
        part["lr_share"] = np.where(reached & (peak_lr > 0) & (at >= peak_at), lr_share, np.nan)
        parts.append(part)
    if not parts:
        return pd.DataFrame(columns=STEPS_COLUMNS)
    out = pd.concat(parts, ignore_index=True)
    out["reached"] = out["reached"].astype(bool)
    return out[STEPS_COLUMNS]


def _first_at_or_below(values: np.ndarray, offsets: np.ndarray, level: float,
                       read: np.ndarray | None = None) -> np.ndarray:
    """Each run's first row whose value is at or below `level` (among the rows `read` where
    given); its end offset when none."""
    below = values <= level
    if read is not None:
        below &= read
    return _first_true(below, offsets)


def _first_true(below: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each run's first True row of `below`; its end offset when none.

    A search per run that stops at the first hit (`argmax` of a boolean), all runs in one call
    when they have the same length (a grid's runs, usually), instead of a full-length index
    array per target."""
    starts, ends = offsets[:-1], offsets[1:]
    lengths = ends - starts
    first = ends.copy()
    if not len(lengths):
        return first
    if lengths[0] > 0 and (lengths == lengths[0]).all() and len(below) == int(ends[-1]) \
            and starts[0] == 0:
        grid = below.reshape(len(lengths), int(lengths[0]))
        column = grid.argmax(axis=1)
        hit = grid[np.arange(len(lengths)), column]
        first[hit] = starts[hit] + column[hit]
        return first
    for i in np.flatnonzero(lengths > 0).tolist():
        a = int(starts[i])
        j = int(below[a:int(ends[i])].argmax())
        if below[a + j]:
            first[i] = a + j
    return first


def _logged(curves: Curves, loss: str) -> np.ndarray:
    """The logged (unsmoothed) values behind `loss_curve`'s curve for `loss`."""
    if loss in ("metric", "eval"):
        return curves.columns["metric" if loss == "metric" else "eval_loss"]
    if loss != "raw" and not np.isfinite(curves.columns["loss"]).any():
        return curves.columns["loss_smooth"]
    return curves.columns["loss"]


def _noise_sums(curves: Curves) -> tuple[_RunningMeans, _RunningMeans, _RunningMeans,
                                          _RunningMeans, np.ndarray]:
    """Running means of B_simple, B_noise and their exact values, and the prefix count of
    drift-flagged rows: the same for every loss and smoothing window, so computed once per
    `Curves` (the analysis refits at half and double the window)."""
    cached = curves.derived.get("noise_sums")
    if cached is not None:
        return cast(tuple[_RunningMeans, _RunningMeans, _RunningMeans, _RunningMeans,
                          np.ndarray], cached)
    step = curves.columns["step"]
    starts = curves.offsets[:-1]
    batch = curves.runs["batch_size"].to_numpy(float)
    run_of_row = np.repeat(np.arange(len(curves.runs)), curves.lengths)
    drift = curves.columns["drift"]
    flagged = np.zeros(len(drift), bool)
    logged = np.flatnonzero(np.isfinite(drift))  # often none: a log of NaN is slow
    with np.errstate(invalid="ignore", divide="ignore"):
        flagged[logged] = np.abs(np.log(drift[logged])) > np.log(DRIFT_LIMIT)
    out = (_RunningMeans(noise_rows(curves, "simple"), step, starts, run_of_row, batch),
           _RunningMeans(noise_rows(curves, "noise"), step, starts, run_of_row, batch),
           _RunningMeans(_filled(curves, "b_simple_true"), step, starts, run_of_row, batch),
           _RunningMeans(_filled(curves, "b_noise_true"), step, starts, run_of_row, batch),
           np.concatenate([[0.0], np.cumsum(flagged)]))
    curves.derived["noise_sums"] = out
    return out


def _precond_sums(curves: Curves) -> _RunningMeans:
    """Running means of B_simple_P (the optimizer's preconditioned B_simple), like B_simple's
    (`_noise_sums`): from the training loop's EMA column, computed once per `Curves`."""
    cached = curves.derived.get("precond_sums")
    if cached is not None:
        return cast(_RunningMeans, cached)
    batch = curves.runs["batch_size"].to_numpy(float)
    run_of_row = np.repeat(np.arange(len(curves.runs)), curves.lengths)
    out = _RunningMeans(curves.columns["b_simple_precond"], curves.columns["step"],
                        curves.offsets[:-1], run_of_row, batch)
    curves.derived["precond_sums"] = out
    return out


def _filled(curves: Curves, column: str) -> np.ndarray:
    """A column logged at some rows only (a costly exact truth), interpolated to every row of
    its run linearly in log steps (`smoothing.interpolate_log_steps`); unchanged where dense
    (then the column itself: read-only, as the curves)."""
    values = curves.columns[column]
    step = curves.columns["step"]
    finite = np.isfinite(values)
    if finite.all() or not finite.any():
        return values
    values = values.copy()
    for lo, hi in zip(curves.offsets[:-1], curves.offsets[1:], strict=True):
        known = finite[lo:hi]
        if known.any() and not known.all():
            values[lo:hi] = interpolate_log_steps(step[lo:hi][known], values[lo:hi][known],
                                                  step[lo:hi])
    return values


def _interpolated(x: np.ndarray, values: np.ndarray, at: np.ndarray, starts: np.ndarray,
                  target: float) -> np.ndarray:
    """x where the loss crosses `target` between row at-1 (above) and row at (at or below),
    linear as `smoothing.first_reach`; x[at] at a run's first row or after a NaN."""
    if not len(x):
        return np.full(len(at), np.nan)
    prev = np.maximum(at - 1, 0)
    v0, v1 = values[prev], values[at]
    ok = (at > starts) & np.isfinite(v0) & (v0 > v1)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(ok, (v0 - target) / (v0 - v1), 1.0)
    return np.where(ok, x[prev] + frac * (x[at] - x[prev]), x[at])


class _RunningMeans:
    """Last finite value and S_min-weighted mean of a noise scale up to any row of its run.

    Weights `dS/(1 + b/B)` (DESIGN.md, from eq. 2.11's dS_min = dS/(1 + B_noise/B)); rows with a
    NaN estimate, or one at or below -B (weight undefined), carry no weight. Prefix sums make the
    value at any row O(1).
    """

    def __init__(self, b: np.ndarray, step: np.ndarray, starts: np.ndarray,
                 run_of_row: np.ndarray, batch: np.ndarray) -> None:
        self.b = b
        self.starts = starts
        finite = np.isfinite(b)
        self.measured = bool(finite.any())
        if not self.measured:  # B_noise is usually not measured: nothing to sum
            return
        n = len(b)
        self.finite_rows = np.flatnonzero(finite)
        # Few fresh full-length arrays, each written in place: on a large sweep allocating
        # (page-faulting) a new array costs more than the arithmetic that fills it.
        weight = np.empty(n)  # dS: steps since the previous row, or since a run's start
        weight[0] = step[0]
        np.subtract(step[1:], step[:-1], out=weight[1:])
        inside = starts[starts < n]
        weight[inside] = step[inside]
        ratio = np.take(batch, run_of_row)
        np.divide(b, ratio, out=ratio)  # b / B
        ok = finite & (ratio > -1.0)
        ratio += 1.0
        np.divide(weight, ratio, out=weight, where=ok)
        weight[~ok] = 0.0
        self.cw = np.empty(n + 1)
        self.cw[0] = 0.0
        np.cumsum(weight, out=self.cw[1:])
        np.multiply(weight, b, out=weight, where=ok)
        del ratio  # its memory serves the second prefix sum
        self.cwb = np.empty(n + 1)
        self.cwb[0] = 0.0
        np.cumsum(weight, out=self.cwb[1:])

    def at(self, row: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Values at `row[i]`, a row of run i (so run i starts at starts[i])."""
        if not self.measured:
            return np.full(len(row), np.nan), np.full(len(row), np.nan)
        # The last finite row at or before each queried row (-1: none).
        found = np.searchsorted(self.finite_rows, row, side="right") - 1
        last = np.where(found >= 0, self.finite_rows[np.maximum(found, 0)], -1)
        at_target = np.where(valid & (last >= self.starts), self.b[np.maximum(last, 0)], np.nan)
        w = self.cw[row + 1] - self.cw[self.starts]
        wb = self.cwb[row + 1] - self.cwb[self.starts]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(valid & (w > 0), wb / w, np.nan)
        return at_target, mean
