"""Figures from a sweep's tables. Takes DataFrames, returns matplotlib figures; reads no files.

One style for every figure: Okabe-Ito colours for targets (colour-blind safe), viridis for the
ordered batch sizes, sizes and fonts meant for a paper column (3.4 in) or a page (7 in).
`draw_all` draws every figure a sweep can support and says in one line why it skipped the rest;
`png_bytes` turns one into bytes for the report; `gnsweep.figure_files` writes them to files.

Tables (docs/analysis.md lists their columns): `runs` and `metrics` from
`gnsweep.analysis.load.load_sweep`, `steps`, `front` and `fits` from `gnsweep analyze`.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FixedFormatter, FixedLocator, LogFormatter, NullFormatter

from gnsweep.analysis.bounds import LOWER_BOUND, UPPER_BOUND
from gnsweep.analysis.fit import predict_steps
from gnsweep.analysis.results import Results
from gnsweep.report.answers import TREND_WORDS, along_trend_caption, bcrit_trend_caption, trend
from gnsweep.report.views import (
    best_runs,
    bounded,
    finite,
    fitted,
    grid_cells,
    lr_fit_curve,
    placed,
    preconditioned,
    quantity,
)
from gnsweep.report.views import unit as unit_of
from gnsweep.targets import FALLING, Direction

# Okabe & Ito (2008): distinguishable with every common colour-vision deficiency.
COLORS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000", "#F0E442"]
COLUMN = 3.4
"""Width of one paper column, inches."""
PAGE = 7.0
"""Width of a two-column figure, inches."""
STYLE: dict[Any, Any] = {
    "figure.figsize": (COLUMN, 2.7), "figure.dpi": 200, "font.size": 7.5,
    "axes.titlesize": 8, "axes.labelsize": 7.5, "legend.fontsize": 6.5,
    "legend.title_fontsize": 6.5, "xtick.labelsize": 6.5, "ytick.labelsize": 6.5,
    "axes.grid": True, "grid.alpha": 0.3, "grid.linewidth": 0.5, "axes.linewidth": 0.6,
    "axes.spines.top": False, "axes.spines.right": False, "lines.linewidth": 1.2,
    "savefig.bbox": "tight", "savefig.pad_inches": 0.03, "legend.frameon": False,
    "figure.constrained_layout.use": True,
}


class Skip(Exception):
    """The sweep cannot support this figure; the message says why in one line."""


def _batch_colors(batch_sizes: list[int]) -> dict[int, tuple]:
    """Viridis over the ordered batch sizes, stopping before its pale yellow end."""
    cmap = plt.get_cmap("viridis")
    n = max(len(batch_sizes) - 1, 1)
    return {b: cmap(0.88 * i / n) for i, b in enumerate(sorted(batch_sizes))}


def _best_tuned(runs: pd.DataFrame, metrics: pd.DataFrame, front: pd.DataFrame,
                direction: Direction) -> tuple[pd.DataFrame, dict[int, tuple],
                                               dict[str, pd.DataFrame]]:
    """The best-tuned run per batch size (`best_runs`), a color per batch size, and each run's
    metrics by run id: what the curve figures draw."""
    chosen = best_runs(runs, metrics, front, direction)
    if chosen.empty:
        raise Skip("every run diverged or has no metrics")
    return (chosen, _batch_colors(list(chosen["batch_size"])),
            dict(tuple(metrics.groupby("run_id", sort=False))))


def _target_colors(targets) -> dict[float, str]:
    """One colour per target loss in every figure, in training order (highest loss first)."""
    ordered = sorted({float(t) for t in targets}, reverse=True)
    return {t: COLORS[i % len(COLORS)] for i, t in enumerate(ordered)}


class _PlainLogFormatter(LogFormatter):
    """LogFormatter's choice of which ticks to label, written plainly: 300 and 0.6, not 3x10^2
    and 6e-01; from 10,000 up with a k or M (300k, 1.2M), so that labels of tokens counted in
    the hundreds of thousands do not run into each other."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return plain_number(x) if super().__call__(x, pos) else ""


def plain_number(x: float) -> str:
    """A tick label: 300, 0.6, 40k, 1.2M."""
    if abs(x) >= 1e9:
        return f"{x / 1e9:g}G"
    if abs(x) >= 1e6:
        return f"{x / 1e6:g}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:g}k"
    return f"{x:g}"


def _plain_log_axis(axis) -> None:
    """Plain labels on a log axis; when the data span less than a decade or two, some minor
    ticks get labels too, so every axis has numbers."""
    axis.set_major_formatter(_PlainLogFormatter())
    axis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))


def _loglog(ax: Axes) -> None:
    """Log scales on both axes, plain tick labels."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_axis(ax.xaxis)
    _plain_log_axis(ax.yaxis)


def _plain_ticks(axis, values) -> None:
    """Major ticks at the given values, labelled plainly (8, 16, ... not 2^3, 2^4)."""
    values = sorted({float(v) for v in values})
    axis.set_major_locator(FixedLocator(values))
    axis.set_major_formatter(FixedFormatter([f"{v:g}" for v in values]))
    axis.set_minor_formatter(NullFormatter())


def _number(record: dict | pd.Series | None, key: str) -> float:
    """record[key] as a float; NaN when missing, None or not a number."""
    try:
        return float(record.get(key, np.nan)) if record is not None else np.nan
    except (TypeError, ValueError):
        return np.nan


def _bound_arrows(ax: Axes, x: np.ndarray, rows: pd.DataFrame, color: str,
                  label: str | None = None) -> None:
    """B_crit bounds drawn as bounds: an arrow from the grid edge the way B_crit lies (up for
    "above 8192", down for "below 128"), never a point at a value the fit ran off to."""
    for xi, row in zip(x, rows.itertuples(index=False), strict=True):
        up = row.bcrit_status == LOWER_BOUND
        tip = row.b_crit_bound * (2.0 if up else 0.5)
        ax.annotate("", xy=(xi, tip), xytext=(xi, row.b_crit_bound),
                    arrowprops={"arrowstyle": "-|>", "color": color, "lw": 0.9})
        ax.plot([xi], [tip], ls="", marker="")  # annotations do not widen the axes: the tip does
        ax.plot([xi], [row.b_crit_bound], marker="_", ms=8, mew=1.2, color=color, ls="",
                label=label)
        label = None


def _off_note(ax: Axes, off: list[str]) -> None:
    if off:
        ax.text(0.99, 0.01, "\n".join(off), transform=ax.transAxes, ha="right", va="bottom",
                fontsize=5.5, color="0.35")


# ---- a. Pareto fronts ---------------------------------------------------------------------


def pareto_fronts(front: pd.DataFrame, fits: pd.DataFrame,
                  adaptive: pd.DataFrame | None = None, what: str = "loss",
                  unit: str = "examples") -> Figure:
    """Steps against examples to reach each target, best learning rate per batch size, with the
    fitted hyperbola (S/S_min - 1)(E/E_min - 1) = 1 (eq. 2.11) and its B_crit point
    (E, S) = (2 E_min, 2 S_min) (eq. 2.12), log-log like the paper's fig. 4. Adaptive runs
    (appendix D), where given, are their own series (diamonds, numbered by exchange rate r),
    with the adaptive front (S/S_min - 1)(E/E_min - 1) = gamma at their median gamma (dashed).

    The view is set by the measured points: a B_crit point far outside them (a fit that cannot
    place B_crit) is left off the chart and its legend entry says where B_crit lies instead."""
    if front.empty:
        raise Skip("no batch size reached any target at any learning rate")
    reached = (adaptive[adaptive["reached"].astype(bool)] if adaptive is not None
               else pd.DataFrame(columns=["target", "steps", "examples"]))
    examples = np.concatenate([front["examples"].to_numpy(float),
                               reached["examples"].to_numpy(float)])
    steps = np.concatenate([front["steps"].to_numpy(float), reached["steps"].to_numpy(float)])
    x_lo, x_hi = examples.min() / 1.5, examples.max() * 1.5
    y_lo, y_hi = steps.min() / 1.5, steps.max() * 1.5
    b_lo, b_hi = int(front["batch_size"].min()), int(front["batch_size"].max())
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(COLUMN, 3.5))
        colors = _target_colors([*front["target"], *fits["target"]])
        for target in sorted(front["target"].unique(), reverse=True):
            group = front[np.isclose(front["target"], target)].sort_values("batch_size")
            color = colors[float(target)]
            on = group["on_front"].astype(bool) if "on_front" in group else group["steps"] > 0
            fit = fitted(fits[np.isclose(fits["target"], target)])
            label = f"{what} {target:g}"
            bound = bounded(fits[np.isclose(fits["target"], target)])
            if len(bound):
                row = bound.iloc[0]
                label += f": B_crit {'>' if row['bcrit_status'] == LOWER_BOUND else '<'} " \
                         f"{row['b_crit_bound']:g}"
            ax.plot(group["examples"], group["steps"], ":", color=color, lw=0.6, alpha=0.7)
            for row in group.itertuples(index=False):
                ax.annotate(f"{row.batch_size}", (row.examples, row.steps), fontsize=5,
                            xytext=(2.5, 2.5), textcoords="offset points", color=color)
            if len(fit):
                s_min, e_min = float(fit["s_min"].iloc[0]), float(fit["e_min"].iloc[0])
                b_crit = e_min / s_min
                b = np.geomspace(b_lo / 64, b_hi * 64, 300)
                s = predict_steps(b, s_min, e_min)
                ax.plot(b * s, s, color=color, lw=1.0, alpha=0.85)
                if b_crit > 2 * b_hi:
                    label += f": B_crit beyond {b_hi}"
                elif b_crit < b_lo / 2:
                    label += f": B_crit below {b_lo}"
                else:
                    label += f": B_crit ≈ {b_crit:.3g}"
                star_x, star_y = 2 * e_min, 2 * s_min
                if x_lo / 10 < star_x < x_hi * 10 and y_lo / 10 < star_y < y_hi * 10:
                    ax.scatter([star_x], [star_y], marker="*", s=70, color=color,
                               edgecolor="black", linewidth=0.5, zorder=4)
                    x_lo, x_hi = min(x_lo, star_x / 1.5), max(x_hi, star_x * 1.5)
                    y_lo, y_hi = min(y_lo, star_y / 1.5), max(y_hi, star_y * 1.5)
            ax.scatter(group["examples"][on], group["steps"][on], color=color, s=16, zorder=3,
                       label=label)
            ax.scatter(group["examples"][~on], group["steps"][~on], facecolor="white",
                       edgecolor=color, s=16, zorder=3)
            _adaptive_series(ax, reached[np.isclose(reached["target"].astype(float), target)],
                             fit, color)
        _loglog(ax)
        ax.set_xlim(x_lo, x_hi)
        ax.set_ylim(y_lo, y_hi)
        ax.set_xlabel(f"examples to reach the target, E ({unit})")
        ax.set_ylabel("steps to reach the target, S (steps)")
        ax.set_title(f"Pareto fronts: steps vs examples per target {what}")
        handles, labels = ax.get_legend_handles_labels()
        handles += [plt.Line2D([], [], color="grey", lw=1.0),
                    plt.Line2D([], [], marker="*", ls="", color="grey", mec="black", mew=0.5,
                               ms=8)]
        labels += ["fit of eq. 2.11", "B_crit point (2 E_min, 2 S_min)"]
        if len(reached):
            handles += [plt.Line2D([], [], marker="D", ls="", color="grey", mec="black",
                                   mew=0.5, ms=4), plt.Line2D([], [], color="grey", ls="--",
                                                              lw=0.8)]
            labels += ["adaptive, B = sqrt(r B_noise)",
                       "adaptive front, = gamma (app. D)"]
        if "on_front" in front and not front["on_front"].astype(bool).all():
            handles.append(plt.Line2D([], [], marker="o", ls="", mfc="white", color="grey",
                                      ms=4))
            labels.append("not Pareto-optimal")
        fig.legend(handles, labels, loc="outside lower center", ncol=2)
        ax.text(0.99, 0.99, "numbers: batch size", fontsize=5.5, ha="right", va="top",
                transform=ax.transAxes, color="0.35")
        return fig


def _adaptive_series(ax: Axes, runs: pd.DataFrame, fit: pd.DataFrame, color: Any) -> None:
    """One target's adaptive runs, and the front (S/S_min - 1)(E/E_min - 1) = gamma."""
    if not len(runs):
        return
    ax.scatter(runs["examples"], runs["steps"], marker="D", color=color, edgecolor="black",
               linewidth=0.5, s=18, zorder=5)
    for row in runs.itertuples(index=False):
        ax.annotate(f"r={row.exchange_rate:g}", (row.examples, row.steps), fontsize=5,
                    xytext=(3, -6), textcoords="offset points", color=color)
    gamma = float(np.nanmedian(runs["gamma"].to_numpy(float)))
    if len(fit) and gamma > 0:
        s_min, e_min = float(fit["s_min"].iloc[0]), float(fit["e_min"].iloc[0])
        s = s_min * (1.0 + np.geomspace(1e-2, 1e3, 300))
        ax.plot(e_min * (1.0 + gamma / (s / s_min - 1.0)), s, "--", color=color, lw=0.8,
                alpha=0.85)


# ---- b. B_crit against the measured noise scale --------------------------------------------


def bcrit_vs_bsimple(fits: pd.DataFrame, front: pd.DataFrame | None = None,
                     what: str = "loss", unit: str = "examples") -> Figure:
    """B_crit of the fit (eq. 2.12) against B_simple, the S_min-weighted mean of the measured
    noise scale up to the target (median over batch sizes), and B_noise (eq. 2.8) where the
    fits carry it. y error bars: B_crit's standard error; x bars: range over batch sizes."""
    ok, off = placed(fitted(fits), front, what)
    ok = ok[finite(ok, "b_simple_mean")]
    if ok.empty:
        raise Skip("no target has both a fit of eq. 2.11 that places B_crit and a measured "
                   "B_simple" + (f" ({'; '.join(off)})" if off else ""))
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(COLUMN, 3.6))
        _off_note(ax, off)
        values = [ok["b_crit"].to_numpy(float), ok["b_simple_mean"].to_numpy(float)]
        has_noise = "b_noise_mean" in ok and finite(ok, "b_noise_mean").any()
        colors = _target_colors(fits["target"])
        has_lr = False
        has_precond = preconditioned(ok)  # SGD's B_simple_P is B_simple: not drawn twice
        for row in ok.itertuples(index=False):
            color = colors[float(row.target)]
            yerr = _yerr(row.b_crit, getattr(row, "b_crit_se", np.nan))
            xerr = None
            if front is not None and "b_simple_mean" in front:
                spread = front.loc[np.isclose(front["target"], row.target), "b_simple_mean"]
                spread = spread[np.isfinite(spread) & (spread > 0)]
                if len(spread) > 1:
                    xerr = [[max(row.b_simple_mean - spread.min(), 0)],
                            [max(spread.max() - row.b_simple_mean, 0)]]
                    values.append(spread.to_numpy(float))
            ax.errorbar([row.b_simple_mean], [row.b_crit], yerr=yerr, xerr=xerr, fmt="o",
                        color=color, capsize=2, ms=4, elinewidth=0.8)
            b_lr = _number(row._asdict(), "b_noise_lr")
            if np.isfinite(b_lr) and b_lr > 0:
                ax.errorbar([b_lr], [row.b_crit], yerr=yerr, fmt="D", mfc="white", color=color,
                            capsize=2, ms=3.5, elinewidth=0.8, alpha=0.8)
                values.append(np.array([b_lr]))
                has_lr = True
            if has_noise and np.isfinite(getattr(row, "b_noise_mean", np.nan)):
                ax.errorbar([row.b_noise_mean], [row.b_crit], yerr=yerr, fmt="s", mfc="white",
                            color=color, capsize=2, ms=4, elinewidth=0.8)
                values.append(np.array([row.b_noise_mean]))
            b_p = _number(row._asdict(), "b_simple_precond_mean")
            if has_precond and np.isfinite(b_p) and b_p > 0:  # in the optimizer's P
                ax.errorbar([b_p], [row.b_crit], yerr=yerr, fmt="^", mfc="white", color=color,
                            capsize=2, ms=4, elinewidth=0.8)
                values.append(np.array([b_p]))
        flat = np.concatenate(values)
        flat = flat[np.isfinite(flat) & (flat > 0)]
        lo, hi = flat.min() / 2.5, flat.max() * 2.5
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        _loglog(ax)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_aspect("equal", adjustable="box")
        noise = "B_simple" + (", B_noise" if has_noise else "")
        ax.set_xlabel(f"measured noise scale: {noise} ({unit})")
        ax.set_ylabel(f"B_crit = E_min/S_min, fit ({unit})")
        ax.set_title("Critical batch size vs measured noise scale")
        # Colour says the target, the marker says which noise scale.
        handles = [plt.Line2D([], [], marker="o", ls="", color=colors[float(t)], ms=4)
                   for t in ok["target"]]
        labels = [f"{what} {t:g}" for t in ok["target"]]
        kinds = [("o", "grey", "B_simple (S_min-weighted)")]
        if has_noise:
            kinds.append(("s", "white", "B_noise (eq. 2.8)"))
        if has_lr:
            kinds.append(("D", "white", "B_noise from the best lr"))
        if has_precond:
            kinds.append(("^", "white", "B_simple_P (preconditioned)"))
        for marker, face, label in kinds:
            handles.append(plt.Line2D([], [], marker=marker, ls="", mfc=face, color="grey",
                                      ms=4))
            labels.append(label)
        handles.append(plt.Line2D([], [], color="black", ls="--", lw=0.8))
        labels.append("y = x")
        fig.legend(handles, labels, loc="outside lower center", ncol=2)
        return fig


def _yerr(value: float, se: float) -> list[list[float]] | None:
    if not np.isfinite(se) or se <= 0:
        return None
    # Keep the lower bar above zero on a log axis.
    return [[min(se, value * 0.95)], [se]]


# ---- c. the noise scale over training ------------------------------------------------------


MAX_POINTS = 2000
"""Points drawn per curve: long runs are thinned log-uniformly in step (the x axes are log)."""


def _thin(frame: pd.DataFrame, n: int = MAX_POINTS) -> pd.DataFrame:
    if len(frame) <= n:
        return frame
    keep = np.unique(np.geomspace(1, len(frame), n).astype(int) - 1)
    return frame.iloc[keep]


def _positive(values: pd.Series) -> np.ndarray:
    array = pd.to_numeric(values, errors="coerce").to_numpy(float)
    return np.where(np.isfinite(array) & (array > 0), array, np.nan)


def noise_over_training(runs: pd.DataFrame, metrics: pd.DataFrame, front: pd.DataFrame,
                        what: str = "loss", unit: str = "examples",
                        direction: Direction = FALLING) -> Figure:
    """B_simple = EMA(tr Sigma)/EMA(|G|^2) (eq. A.2) and B_noise (eq. 2.8, where measured) of
    the best-tuned run per batch size, against optimizer steps and against the training loss.
    Non-positive early estimates (noise before the EMAs settle) are not drawn on the log axis."""
    if metrics.empty or not np.isfinite(_positive(metrics["b_simple"])).any():
        raise Skip("no run logged a positive B_simple")
    chosen, colors, by_run = _best_tuned(runs, metrics, front, direction)
    has_noise = "b_noise" in metrics and np.isfinite(_positive(metrics["b_noise"])).any()
    with plt.rc_context(STYLE):
        fig, (ax_step, ax_loss) = plt.subplots(1, 2, figsize=(PAGE, 2.8), sharey=True)
        for row in chosen.itertuples(index=False):
            frame = _thin(by_run[row.run_id].sort_values("step"))
            color = colors[row.batch_size]
            label = f"B = {row.batch_size} (lr {row.learning_rate:g})"
            b_simple = _positive(frame["b_simple"])
            ax_step.plot(frame["step"], b_simple, color=color, label=label)
            # The lowest loss (highest metric) so far: the value still wobbles, progress does
            # not.
            reached = (frame["loss_smooth"].cummin() if what == "loss"
                       else frame["metric"].cummax())
            ax_loss.plot(reached, b_simple, color=color)
            if has_noise:
                b_noise = _positive(frame["b_noise"])
                ok = np.isfinite(b_noise)
                ax_step.plot(frame["step"][ok], b_noise[ok], "--", color=color)
                ax_loss.plot(reached[ok], b_noise[ok], "--", color=color)
        for ax in (ax_step, ax_loss):
            _loglog(ax)
        ax_step.set_xlabel("optimizer step (steps)")
        if what == "loss":
            ax_loss.set_xlabel("lowest smoothed training loss so far (nats; training →)")
            ax_loss.invert_xaxis()
        else:
            ax_loss.set_xlabel(f"highest {what} so far (training →)")
        ax_step.set_ylabel(("B_simple, B_noise" if has_noise else "B_simple") + f" ({unit})")
        ax_step.set_title("Noise scale over training" + ("" if has_noise else ": B_simple"))
        ax_loss.set_title(f"... against the {what} reached")
        ax_loss.tick_params(which="both", labelleft=True)
        handles, labels = ax_step.get_legend_handles_labels()
        if has_noise:
            handles += [plt.Line2D([], [], color="grey"), plt.Line2D([], [], color="grey",
                                                                     ls="--")]
            labels += ["solid: B_simple", "dashed: B_noise"]
        fig.legend(handles, labels, title="best-tuned run\nper batch size",
                   loc="outside right upper")
        return fig


# ---- d. steps-to-target over the grid ------------------------------------------------------


CELL_MARKS = {"not reached": "x", "diverged": "div", "early": "early", "failed": "fail",
              "corrupt": "bad",
              "pending": "…", "running": "…"}


def tick_labels(values: list[float]) -> list[str]:
    """Axis labels of a grid's values with the fewest significant digits (3 to 6) that keep them
    apart: a planned grid's 14.205 and 16.336 read 14.2 and 16.3, not six digits each."""
    for digits in range(3, 7):
        labels = [f"{v:.{digits}g}" for v in values]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{v:g}" for v in values]


GRID_COLUMNS_A_ROW = 24
"""Grid columns (batch sizes) drawn side by side on one row of panels: past it, fewer panels a
row, so that each cell keeps room for its number."""


def steps_grid(steps: pd.DataFrame, front: pd.DataFrame, what: str = "loss",
               unit: str = "examples") -> Figure:
    """Steps to reach each target over the batch size x learning rate grid, one panel per
    target; the best learning rate per batch size is boxed, cells that never reached the target
    are hatched (x: not reached, div: diverged, early: met before 64 samples, not counted)."""
    if steps.empty:
        raise Skip("the steps table is empty; run `gnsweep analyze` first")
    cells = grid_cells(steps)
    if cells.empty:  # a table of measurements without learning rates: no grid
        raise Skip("the steps table has no learning rates (a table of best runs only)")
    targets = sorted(cells["target"].unique(), reverse=True)
    batches = sorted(cells["batch_size"].unique())
    lrs = sorted(cells["learning_rate"].unique())
    reached = cells["steps"].to_numpy(float)
    reached = reached[np.isfinite(reached) & (reached > 0)]
    norm = LogNorm(reached.min(), max(reached.max(), reached.min() * 1.01)) if len(reached) \
        else LogNorm(1, 10)
    # Panels side by side while their cells stay wide enough for a number each.
    ncols = max(1, min(len(targets), 3, GRID_COLUMNS_A_ROW // max(1, len(batches))))
    nrows = -(-len(targets) // ncols)
    width = PAGE if ncols > 1 else COLUMN + 0.6
    height = max(2.0, 0.28 * len(lrs) + 0.9) * nrows
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False)
        image = None
        for ax, target in zip(axes.flat, targets, strict=False):
            table = cells[np.isclose(cells["target"], target)]
            grid = np.full((len(lrs), len(batches)), np.nan)
            for row in table.itertuples(index=False):
                grid[lrs.index(row.learning_rate), batches.index(row.batch_size)] = row.steps
            image = ax.imshow(grid, origin="lower", cmap="viridis", norm=norm, aspect="auto")
            ax.set_facecolor("0.92")
            best = front[np.isclose(front["target"], target)] if len(front) else front
            best_cells = set(zip(best["batch_size"], best["learning_rate"], strict=True))
            for row in table.itertuples(index=False):
                x, y = batches.index(row.batch_size), lrs.index(row.learning_rate)
                if row.outcome == "reached":
                    shade = norm(row.steps)
                    ax.text(x, y, f"{row.steps:.0f}", ha="center", va="center", fontsize=5,
                            color="white" if shade < 0.6 else "black",
                            weight="bold" if (row.batch_size, row.learning_rate) in best_cells
                            else "normal")
                else:
                    ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False,
                                               hatch="////", edgecolor="0.7", lw=0))
                    ax.text(x, y, CELL_MARKS.get(row.outcome, "?"), ha="center",
                            va="center", fontsize=5.5, color="0.25")
            for row in best.itertuples(index=False):
                x, y = batches.index(row.batch_size), lrs.index(row.learning_rate)
                # Inset, so that neighbouring best cells keep separate boxes.
                ax.add_patch(plt.Rectangle((x - 0.42, y - 0.4), 0.84, 0.8, fill=False,
                                           edgecolor="#D55E00", lw=1.4))
            ax.set_xticks(range(len(batches)), [f"{b:g}" for b in batches], rotation=90)
            ax.set_yticks(range(len(lrs)), tick_labels(lrs))
            ax.grid(False)
            ax.set_xlabel(f"batch size B ({unit})")
            if ax in axes[:, 0]:
                ax.set_ylabel("learning rate")
            n_reached = int(table["outcome"].eq("reached").sum())
            ax.set_title(f"{what} {target:g}: {n_reached}/{len(table)} cells reached")
        for ax in list(axes.flat)[len(targets):]:
            ax.set_visible(False)
        if image is not None:
            bar = fig.colorbar(image, ax=axes, label="steps to target (steps)", shrink=0.9,
                               pad=0.01)
            _plain_log_axis(bar.ax.yaxis)
        marks = sorted(set(cells["outcome"]) - {"reached"})
        legend = "; ".join(f"{CELL_MARKS.get(m, '?')}: {m}" for m in marks)
        fig.suptitle("Steps to target over the grid (box: best learning rate"
                     + (f"; {legend}" if legend else "") + ")", fontsize=8)
        return fig


# ---- e. best learning rate against batch size ----------------------------------------------


def best_lr_vs_batch(front: pd.DataFrame, steps: pd.DataFrame | None = None,
                     fits: pd.DataFrame | None = None, what: str = "loss",
                     unit: str = "examples") -> Figure:
    """The best learning rate per batch size against batch size, log-log: the refined optimum
    `lr_opt` (parabola vertex in log lr, log steps) where the front has it, else the best grid
    point; with the fitted eps_opt(B) = eps_max/(1 + (B_noise/B)^alpha) (eq. 2.7) where the fits
    carry it. Hollow points: the best rate is on the grid's edge (a bound, left out of the fit)."""
    if front.empty or front["batch_size"].nunique() < 2:
        raise Skip("fewer than 2 batch sizes reached a target")
    column = "lr_opt" if "lr_opt" in front and np.isfinite(front["lr_opt"]).any() \
        else "learning_rate"
    if not (np.isfinite(front[column].astype(float)) & (front[column] > 0)).any():
        raise Skip("no learning rates (a table of best runs only)")
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots()
        targets = sorted(front["target"].unique(), reverse=True)
        n = len(targets)
        offsets = {t: 1.05 ** (i - (n - 1) / 2) for i, t in enumerate(targets)}
        colors = _target_colors(targets)
        drawn_fit = False
        for target in targets:
            group = front[np.isclose(front["target"], target)].sort_values("batch_size")
            color = colors[float(target)]
            edge = group["lr_on_edge"].astype(bool) if "lr_on_edge" in group else \
                pd.Series(False, index=group.index)
            # Small horizontal offsets so targets sharing a rate do not hide each other.
            x = group["batch_size"] * offsets[target]
            y = group[column].where(np.isfinite(group[column]), group["learning_rate"])
            label = f"{what} {target:g}"
            fit = None
            if fits is not None and len(fits):
                match = fits[np.isclose(fits["target"], target)]
                fit = match.iloc[0] if len(match) else None
            b = np.geomspace(group["batch_size"].min() / 2, group["batch_size"].max() * 2, 200)
            curve = lr_fit_curve(fit, b)
            if curve is not None:
                ax.plot(b, curve, "-", color=color, lw=1.0, alpha=0.9)
                label += f": B_noise ≈ {_number(fit, 'b_noise_lr'):.3g}"
                drawn_fit = True
            ax.scatter(x[~edge], y[~edge], color=color, s=16, zorder=3, label=label)
            ax.scatter(x[edge], y[edge], facecolor="white", edgecolor=color, s=16, zorder=3)
        if steps is not None and len(steps) and "learning_rate" in steps:
            for lr in (steps["learning_rate"].min(), steps["learning_rate"].max()):
                if np.isfinite(lr):
                    ax.axhline(lr, color="0.5", lw=0.6, ls=":")
        _loglog(ax)
        _plain_ticks(ax.xaxis, front["batch_size"].unique())
        ax.set_xlabel(f"batch size B ({unit})")
        ax.set_ylabel("best learning rate" + (" (refined)" if column == "lr_opt" else ""))
        ax.set_title("Best learning rate vs batch size" + ("" if drawn_fit else " (no fit)"))
        handles, labels = ax.get_legend_handles_labels()
        if drawn_fit:
            handles.append(plt.Line2D([], [], color="grey", lw=1.0))
            labels.append("fit: eps_max / (1 + (B_noise/B)^α)")
        if "lr_on_edge" in front and front["lr_on_edge"].astype(bool).any():
            handles.append(plt.Line2D([], [], marker="o", ls="", mfc="white", color="grey",
                                      ms=4))
            labels.append("on the grid's edge (not fitted)")
        if steps is not None and len(steps):
            handles.append(plt.Line2D([], [], color="0.5", lw=0.6, ls=":"))
            labels.append("grid's lowest/highest rate")
        ax.legend(handles, labels, loc="lower right")
        return fig


# ---- f. B_crit against the target loss -----------------------------------------------------


def bcrit_vs_loss(fits: pd.DataFrame, law: dict | None = None,
                  front: pd.DataFrame | None = None, what: str = "loss",
                  unit: str = "examples") -> Figure:
    """B_crit (eq. 2.12) with its standard error against the target loss, log-log, with the
    power law B_crit(L) = B_* / L^(1/alpha_B) (Kaplan et al. 2020) where a fit is given."""
    ok, off = placed(fitted(fits), front, what)
    bounds = bounded(fits)
    if len(ok) + len(bounds) < 2:
        raise Skip(f"{len(ok)} target(s) with a fit of eq. 2.11 that places B_crit; a trend "
                   "needs at least 2" + (f" ({'; '.join(off)})" if off else ""))
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots()
        _off_note(ax, off)
        colors = _target_colors(fits["target"])
        for row in ok.itertuples(index=False):
            color = colors[float(row.target)]
            ax.errorbar([row.target], [row.b_crit], yerr=_yerr(row.b_crit, row.b_crit_se),
                        fmt="o", color=color, capsize=2, ms=4, elinewidth=0.8)
        for target, rows in bounds.groupby("target", sort=False):
            _bound_arrows(ax, rows["target"].to_numpy(float), rows, colors[float(target)])
        title = f"Critical batch size vs target {what}"
        b_star, alpha = _number(law, "b_star"), _number(law, "alpha_b")
        if np.isfinite([b_star, alpha]).all() and alpha > 0 and b_star > 0 and len(ok):
            losses = np.geomspace(ok["target"].min() / 1.5, ok["target"].max() * 1.5, 100)
            ax.plot(losses, b_star / losses ** (1 / alpha), "k--", lw=0.9,
                    label=f"B_* / L^(1/α_B): B_* = {b_star:.3g}, α_B = {alpha:.2g}")
            fig.legend(loc="outside lower center")
        else:
            title += " (no power-law fit)"
        _loglog(ax)
        _plain_ticks(ax.xaxis, pd.concat([ok["target"], bounds["target"]]))
        if what == "loss":
            ax.invert_xaxis()
            ax.set_xlabel("target loss L (nats; lower is further into training)")
        else:
            ax.set_xlabel(f"target {what} (higher is further into training)")
        ax.set_ylabel(f"B_crit = E_min / S_min ({unit})")
        ax.set_title(title)
        return fig


# ---- g. training-loss curves ---------------------------------------------------------------


def loss_curves(runs: pd.DataFrame, metrics: pd.DataFrame, front: pd.DataFrame,
                targets: list[float] | None = None, what: str = "loss",
                unit: str = "examples", direction: Direction = FALLING) -> Figure:
    """Smoothed training loss of the best-tuned run per batch size, against optimizer steps and
    against examples, log-log, with the targets as horizontal lines: larger batches need fewer
    steps but more examples (the two sides of eq. 2.11)."""
    if metrics.empty:
        raise Skip("no run has metrics")
    chosen, colors, by_run = _best_tuned(runs, metrics, front, direction)
    with plt.rc_context(STYLE):
        fig, (ax_s, ax_e) = plt.subplots(1, 2, figsize=(PAGE, 2.8), sharey=True)
        for row in chosen.itertuples(index=False):
            frame = _thin(by_run[row.run_id].sort_values("step"))
            # A task's own metric is plotted as logged (already a window mean).
            loss = _positive(frame["loss_smooth" if what == "loss" else "metric"])
            label = f"B = {row.batch_size} (lr {row.learning_rate:g})"
            if not row.reached:
                label += ", no target reached"
            style = "-" if row.reached else ":"
            ax_s.plot(frame["step"], loss, style, color=colors[row.batch_size], label=label)
            ax_e.plot(frame["examples"], loss, style, color=colors[row.batch_size])
        for ax in (ax_s, ax_e):
            for target in targets or []:
                ax.axhline(target, color="0.4", ls="--", lw=0.6)
            _loglog(ax)
        if targets:
            ax_e.text(1.0, min(targets), " targets", transform=ax_e.get_yaxis_transform(),
                      fontsize=5.5, color="0.4", va="center")
        ax_s.set_xlabel("optimizer step (steps)")
        ax_e.set_xlabel(f"examples processed ({unit})")
        ax_s.set_ylabel("training loss, smoothed (nats)" if what == "loss"
                        else f"training {what}")
        ax_e.tick_params(which="both", labelleft=True)
        ax_s.set_title(f"Training {what} of the best-tuned run per batch size")
        ax_e.set_title("... against examples (dashed: targets)")
        fig.legend(title="best-tuned run\nper batch size", loc="outside right upper")
        return fig


# ---- all of them ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FigureSpec:
    name: str
    """File stem, e.g. pareto_fronts."""
    caption: str
    draw: Callable[[Results], Figure]
    trend: Callable[[Results], str] | None = None
    """What the drawn data do (computed, `report.answers`), appended to the caption: a caption
    never claims a trend its figure does not show."""

    def caption_for(self, tables: Results) -> str:
        """The caption, with the trend computed from `tables` where the figure has one."""
        if self.trend is None:
            return self.caption
        return f"{self.caption} {self.trend(tables)}"


def literal(text: str) -> str:
    """Text from a folder (a task's unit or metric name) as matplotlib draws it literally: a
    `$` escaped, never read as the start of mathtext (`a$^$b` would stop the figure)."""
    return text.replace("$", r"\$")


def _what(tables: Results) -> str:
    return literal(quantity(tables.meta))


def _unit(tables: Results) -> str:
    return literal(unit_of(tables.meta))


def _over_targets(tables: Results, column: str) -> str:
    """The trend of a fits column over the targets, in training order (`answers.trend`)."""
    fits = tables.fits
    if not len(fits) or column not in fits:
        return TREND_WORDS[""]
    rises = Direction.from_meta(tables.meta).rises
    ordered = fits.sort_values("target", ascending=rises)[column].to_numpy(float)
    return TREND_WORDS[trend(np.arange(1, len(ordered) + 1, dtype=float), ordered)]


def _lr_trend(tables: Results) -> str:
    """How the best learning rate moves with the batch size: the median over targets of each
    batch size's best rate (front.parquet), from the rates inside the grid; where best rates
    sit on the grid's edge (`lr_on_edge`: bounds, left out of the fit, as the analysis warns)
    that is said instead of a trend they cannot show."""
    front = tables.front
    if not len(front):
        return f"{TREND_WORDS['']} with B"
    edge = front["lr_on_edge"].astype(bool) if "lr_on_edge" in front else \
        pd.Series(False, index=front.index)
    best = front[~edge].groupby("batch_size")["learning_rate"].median()
    said = f"{TREND_WORDS[trend(best.index.to_numpy(float), best.to_numpy(float))]} with B"
    if not edge.any():
        return said
    sizes = ", ".join(f"{b:g}" for b in sorted(front.loc[edge, "batch_size"].astype(float)
                                                .unique()))
    inside = f"{said} where the best rate is inside the grid; " if len(best) else \
        "shows no trend yet: "
    return (f"{inside}at B = {sizes} the best rate sits on the learning-rate grid's edge (a "
            "bound, not fitted: widen the grid there before reading a trend)")


def _targets(tables: Results) -> list[float]:
    return sorted(float(t) for t in tables.fits["target"]) if len(tables.fits) else []


FIGURES = [
    FigureSpec("pareto_fronts", "Steps against examples to reach each target at the best "
               "learning rate per batch size, with the fitted hyperbola of eq. 2.11 and B_crit.",
               lambda t: pareto_fronts(t.front, t.fits, t.adaptive, _what(t), _unit(t))),
    FigureSpec("bcrit_vs_bsimple", "B_crit from the fit against the noise scale measured "
               "during training; on the dashed line the noise scale predicts B_crit exactly.",
               lambda t: bcrit_vs_bsimple(t.fits, t.front, _what(t), _unit(t))),
    FigureSpec("noise_over_training", "The measured noise scale of the best-tuned run per "
               "batch size, over steps and against the loss.",
               lambda t: noise_over_training(t.runs, t.metrics, t.front, _what(t), _unit(t),
                                                 Direction.from_meta(t.meta)),
               lambda t: "Its S_min-weighted mean up to each target "
                         f"{_over_targets(t, 'b_simple_mean')} from target to target."),
    FigureSpec("steps_grid", "Steps to reach each target over the batch size x learning rate "
               "grid; boxed cells are the best learning rate per batch size.",
               lambda t: steps_grid(t.steps, t.front, _what(t), _unit(t))),
    FigureSpec("best_lr", "The best learning rate against batch size (eq. 2.7 has it grow with "
               "B, then level off near B_noise).",
               lambda t: best_lr_vs_batch(t.front, t.steps, t.fits, _what(t), _unit(t)),
               lambda t: f"Here it {_lr_trend(t)}."),
    FigureSpec("bcrit_vs_loss", "B_crit against the target loss.",
               lambda t: bcrit_vs_loss(t.fits, t.bcrit_law, t.front, _what(t), _unit(t)),
               lambda t: "As training goes on the critical batch size "
                         f"{bcrit_trend_caption(t.fits, t.front, Direction.from_meta(t.meta))}."),
    FigureSpec("loss_curves", "Training loss of the best-tuned run per batch size against "
               "steps and examples; dashed lines are the targets.",
               lambda t: loss_curves(t.runs, t.metrics, t.front, _targets(t), _what(t),
                                     _unit(t), Direction.from_meta(t.meta))),
    FigureSpec("noise_scale_vs_temperature", "B_simple when each run reaches a target against "
               "the temperature eps/B (appendix C: slope -1 in equilibrium), with the fitted "
               "exponent of temperature.parquet.",
               lambda t: noise_vs_temperature(t.steps, t.temperature, _what(t), _unit(t))),
]


def noise_vs_temperature(steps: pd.DataFrame, temperature: pd.DataFrame, what: str = "loss",
                         unit: str = "examples") -> Figure:
    """B_simple at the moment each run reaches a target against the temperature T = eps/B
    (appendix C), every run that reached it, with the fitted power law of temperature.parquet
    per target and the paper's slope -1 for reference."""
    if steps.empty or "b_simple_at_target" not in steps:
        raise Skip("no steps table with B_simple at the targets")
    runs = steps[steps["reached"].astype(bool)]
    runs = runs[np.isfinite(runs["b_simple_at_target"]) & (runs["b_simple_at_target"] > 0)
                & np.isfinite(runs["learning_rate"])]
    if runs.empty:
        raise Skip("no run reached a target with a measured, positive B_simple")
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(COLUMN, 3.4))
        colors = _target_colors(steps["target"])
        slopes = temperature.set_index("target") if len(temperature) else pd.DataFrame()
        for target, group in runs.groupby("target"):
            t = (group["learning_rate"] / group["batch_size"]).to_numpy(float)
            b = group["b_simple_at_target"].to_numpy(float)
            color = colors[float(target)]
            label = f"{what} {target:g}"
            if float(target) in slopes.index and np.isfinite(slopes.loc[target, "exponent"]):
                row = slopes.loc[target]
                label += f": slope {row['exponent']:.2f} ± {row['exponent_se']:.2f}"
                grid = np.geomspace(t.min(), t.max(), 20)
                level = np.exp(np.mean(np.log(b) - row["exponent"] * np.log(t)))
                ax.plot(grid, level * grid ** row["exponent"], color=color, lw=0.9)
            ax.plot(t, b, "o", color=color, ms=3.5, label=label)
        t_all = (runs["learning_rate"] / runs["batch_size"]).to_numpy(float)
        b_all = runs["b_simple_at_target"].to_numpy(float)
        mid_t, mid_b = np.exp(np.mean(np.log(t_all))), np.exp(np.mean(np.log(b_all)))
        grid = np.geomspace(t_all.min(), t_all.max(), 20)
        ax.plot(grid, mid_b * mid_t / grid, "k--", lw=0.8, label="slope -1 (appendix C)")
        _loglog(ax)
        ax.set_xlabel(f"temperature T = learning rate / B (per {unit[:-1] or unit})")
        ax.set_ylabel(f"B_simple at the target ({unit})")
        ax.set_title("Noise scale against temperature")
        ax.legend(fontsize="small")
        return fig


def draw_all(tables: Results) -> dict[str, Figure | str]:
    """Every figure of FIGURES: a Figure, or the one-line reason it was skipped."""
    out: dict[str, Figure | str] = {}
    for spec in FIGURES:
        try:
            out[spec.name] = spec.draw(tables)
        except Skip as reason:
            out[spec.name] = str(reason)
    return out


# ---- h. the critical batch size along training (a branch sweep) ---------------------------


def bcrit_along_training(along: pd.DataFrame, base: pd.DataFrame | None = None,
                         unit: str = "examples") -> Figure:
    """The local B_crit (eq. 2.12) of each branch point and target, with its standard error,
    against the examples the base run had seen there, log-log; beside it the base run's noise
    scale over the whole run (B_simple, eq. 2.9; B_noise, eq. 2.8, where measured), which the
    theory puts at the local critical batch size."""
    ok = along[np.isfinite(along["b_crit"].astype(float)) & (along["b_crit"].astype(float) > 0)
               & (along["at_examples"].astype(float) > 0)] if len(along) else along
    eq_bounds = along[along["bcrit_status"].isin([LOWER_BOUND, UPPER_BOUND])
                      & (along["b_crit_bound"].astype(float) > 0)
                      & (along["at_examples"].astype(float) > 0)] \
        if len(along) and "bcrit_status" in along else along.iloc[:0]
    points = along.groupby("at_examples", sort=True).first().reset_index() \
        if len(along) and "b_crit_tol" in along else pd.DataFrame()
    tol = points[np.isfinite(points["b_crit_tol"].astype(float))] if len(points) else points
    bounded = points[~np.isfinite(points["b_crit_tol"].astype(float))
                     & np.isfinite(points["b_crit_tol_lo"].astype(float))
                     & ~np.isfinite(points["b_crit_tol_hi"].astype(float))] \
        if len(points) else points
    if not len(ok) and not len(eq_bounds) and not len(tol) and not len(bounded):
        raise Skip("no branch point has a local B_crit, by eq. 2.11 or by tolerance "
                   "(along.parquet: see `refused`, `tol_refused`)")
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(COLUMN * 1.3, 2.9))
        # A target's bounds ("above the largest batch") share its series' colour, as arrows.
        series = _along_series(pd.concat([ok, eq_bounds]) if len(eq_bounds) else ok)
        offsets = np.linspace(-0.04, 0.04, max(len(series), 1))  # side by side, in log x
        for i, (label, both) in enumerate(series):
            fitted = both.index.isin(ok.index)
            edge = both[~fitted]
            if len(edge):
                _bound_arrows(ax, edge["at_examples"].to_numpy(float) * 10 ** offsets[i], edge,
                              COLORS[i % len(COLORS)],
                              None if fitted.any() else f"{label}: bound only")
            rows = both[fitted]
            if not len(rows):
                continue
            x = rows["at_examples"].to_numpy(float) * 10 ** offsets[i]
            se = rows["b_crit_se"].to_numpy(float)
            b = rows["b_crit"].to_numpy(float)
            low = np.where(np.isfinite(se), np.minimum(se, 0.95 * b), 0.0)
            high = np.where(np.isfinite(se), se, 0.0)
            ax.errorbar(x, b, yerr=[low, high], fmt="o-", color=COLORS[i % len(COLORS)],
                        capsize=2, ms=3.5, elinewidth=0.8, lw=0.8, label=label)
        if len(tol):
            ax.plot(tol["at_examples"].to_numpy(float), tol["b_crit_tol"].to_numpy(float),
                    "s:", color="0.1", ms=4, lw=0.9, label="local B_crit by tolerance")
        if len(bounded):  # every batch size within tolerance: above the largest
            ax.plot(bounded["at_examples"].to_numpy(float),
                    bounded["b_crit_tol_lo"].to_numpy(float), "^", color="0.1", ms=5,
                    ls="none", label="by tolerance: above the largest batch")
        if base is not None and len(base):
            for column, style, label in (("b_simple", "-", "base run B_simple"),
                                         ("b_noise", "--", "base run B_noise")):
                if column not in base:
                    continue
                values = base[column].to_numpy(float)
                x = base["examples"].to_numpy(float)
                keep = np.isfinite(values) & (values > 0) & np.isfinite(x) & (x > 0)
                if keep.any():
                    ax.plot(x[keep], values[keep], style, color="0.35", lw=0.9, label=label)
        _loglog(ax)
        ax.set_xlabel(f"{unit} seen by the base run at the branch point")
        ax.set_ylabel(f"batch size ({unit})")
        ax.set_title("Critical batch size along training")
        fig.legend(loc="outside lower center", ncols=2)
        return fig


def _along_series(rows: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The fitted rows of along.parquet as series: one per target fraction (`branch.targets`),
    or, for targets chosen from the runs (a different fraction at every point), one per rank
    at its point (easiest first)."""
    if not len(rows):
        return []
    auto = rows["target_source"].astype(str) == "auto" if "target_source" in rows \
        else pd.Series(False, index=rows.index)
    out: list[tuple[str, pd.DataFrame]] = []
    fixed = rows[~auto]
    for target in sorted({float(t) for t in fixed["target"]}, reverse=True):
        out.append((f"local B_crit, target {target:g} x loss",
                    fixed[fixed["target"].astype(float) == target]))
    chosen = rows[auto]
    if len(chosen):
        rank = chosen.groupby("at_examples")["target"].rank(ascending=False, method="first")
        for r in sorted(set(rank.astype(int))):
            out.append((f"local B_crit, automatic target {r}", chosen[rank == r]))
    return out


ALONG_FIGURE = FigureSpec(
    "bcrit_along_training", "Local B_crit of short runs branched from the base run's "
    "checkpoints (error bars: standard errors of the fit of eq. 2.11; squares: the tolerance "
    "rule, triangles its bounds; arrows: eq. 2.11's bounds beyond the grid) against the "
    "examples the base run had seen, with the base run's own noise scale over training.",
    lambda t: bcrit_along_training(t.along, t.along_base, _unit(t)),
    lambda t: "From point to point the local B_crit of eq. 2.11 (median over each point's "
              f"targets) {along_trend_caption(t.along)}; by tolerance it "
              f"{along_trend_caption(t.along, 'b_crit_tol')}.")


def draw_along(tables: Results) -> dict[str, Figure | str]:
    """The along-training figure of a branch sweep ({} for any other sweep)."""
    if not len(tables.along):
        return {}
    try:
        return {ALONG_FIGURE.name: ALONG_FIGURE.draw(tables)}
    except Skip as reason:
        return {ALONG_FIGURE.name: str(reason)}


def notes(tables: Results) -> list[str]:
    """One line for each thing the figures leave out although the figure is drawn."""
    out = []
    if "b_noise" not in tables.metrics or not np.isfinite(
            _positive(tables.metrics["b_noise"])).any():
        out.append("B_noise not measured in the training loop (noise.hessian_every=0; probes, "
                   "where run, feed the fits only): the noise-scale figures show B_simple only")
    fits = tables.fits
    if "eps_max" not in fits or not (np.isfinite(fits["eps_max"].astype(float)).any()):
        why = "; ".join(sorted({str(r) for r in fits.get("lr_refused", []) if r})) or \
            "not in fits.parquet (re-run gnsweep analyze)"
        out.append(f"best_lr drawn without the fit of eps_opt(B): {why}")
    law = tables.bcrit_law or {}
    if len(fitted(fits)) >= 2 and not np.isfinite(
            [law.get("b_star", np.nan), law.get("alpha_b", np.nan)]).all():
        why = law.get("refused") or "no loss_scaling table (re-run gnsweep analyze)"
        out.append(f"bcrit_vs_loss drawn without the power law B_crit(L): {why}")
    return out


def axes_of(fig: Figure) -> list[Axes]:
    """The figure's data axes (colorbars left out)."""
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.get_visible()]


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes, for embedding in the report."""
    buffer = io.BytesIO()
    fig.canvas.print_figure(buffer, format="png")  # what savefig does, into memory
    return buffer.getvalue()
