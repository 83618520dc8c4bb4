"""The comparison's figures from compare.parquet's table; no analysis logic, no file I/O.

- `bcrit_vs_noise_scale`: the paper's headline figure (fig. 4 of McCandlish et al. 2018):
  B_crit against B_simple across tasks and targets, log-log, the line y = x and a band of a
  factor 3, one marker per task, standard errors as bars.
- `noise_scale_vs_target`: B_simple against the target reached, one panel per task (the noise
  scale grows as the loss falls, section 3).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from gnsweep.analysis.crit_vs_simple import log_error_bars, placeable
from gnsweep.report.figures import COLORS, COLUMN, STYLE, Skip, literal
from gnsweep.report.views import preconditioned
from gnsweep.targets import KEY as DIRECTION_KEY

MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
BAND = 3.0
"""The factor of the shaded band around y = x (the issue's goal; the paper's claim is 10)."""


def _style(tasks: list[str]) -> dict[str, tuple[str, str]]:
    """Task -> (colour, marker), in the order the tasks first appear."""
    return {t: (COLORS[i % len(COLORS)], MARKERS[i % len(MARKERS)]) for i, t in enumerate(tasks)}


def _units(table: pd.DataFrame) -> str:
    units = [literal(u) for u in dict.fromkeys(table["unit"].astype(str))]
    return ", ".join(units[:-1]) + (" or " if len(units) > 1 else "") + units[-1]


def _precond(shown: pd.DataFrame) -> np.ndarray:
    """B_simple_P (mean up to the target) per row where an adaptive optimizer logged a positive
    one, else NaN (SGD's equals B_simple: not drawn twice)."""
    if not preconditioned(shown):  # none logged, or SGD's, which is B_simple itself
        return np.full(len(shown), np.nan)
    values = pd.to_numeric(shown["b_simple_precond_mean"], errors="coerce").to_numpy(float)
    return np.where(values > 0, values, np.nan)


def bcrit_vs_noise_scale(table: pd.DataFrame) -> Figure:
    """B_crit (eq. 2.12) against B_simple averaged over training up to the target; an adaptive
    optimizer's B_simple_P beside it, hollow, where one was logged."""
    import matplotlib.pyplot as plt

    shown = placeable(table).reset_index(drop=True)
    if shown.empty:
        raise Skip("no target with both a fitted B_crit and a measured B_simple")
    style = _style(list(dict.fromkeys(table["task"])))
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(COLUMN * 1.15, COLUMN * 1.1))
        precond = _precond(shown)
        values = np.concatenate([shown["b_simple_mean"], shown["b_crit"],
                                 precond[np.isfinite(precond)]]).astype(float)
        lo, hi = values.min() / 3 / BAND, values.max() * 3 * BAND
        line = np.array([lo, hi])
        ax.fill_between(line, line / BAND, line * BAND, color="0.85", lw=0,
                        label=f"within {BAND:g}x")
        ax.plot(line, line, color="0.3", lw=0.8, ls="--", label="$B_{crit} = B_{simple}$")
        for task, rows in shown.groupby("task", sort=False):
            color, marker = style[str(task)]
            x, y = rows["b_simple_mean"].to_numpy(float), rows["b_crit"].to_numpy(float)
            ax.errorbar(x, y, xerr=log_error_bars(x, rows["b_simple_mean_se"].to_numpy(float)),
                        yerr=log_error_bars(y, rows["b_crit_se"].to_numpy(float)),
                        fmt=marker, color=color, ms=4, lw=0.7, capsize=1.5,
                        label=literal(f"{task} ({rows['unit'].iloc[0]})"))
            # An adaptive optimizer's B_simple_P, hollow, joined to the same target's B_simple.
            x_p = precond[shown.index.get_indexer(rows.index)]
            has_p = np.isfinite(x_p)
            if has_p.any():
                for x0, x1, y0 in zip(x[has_p], x_p[has_p], y[has_p], strict=True):
                    ax.plot([x0, x1], [y0, y0], color=color, lw=0.5, ls=":")
                ax.plot(x_p[has_p], y[has_p], marker, color=color, mfc="white", ms=4, lw=0)
        if np.isfinite(precond).any():
            ax.plot([], [], "o", color="0.3", mfc="white", ms=4, lw=0,
                    label="hollow: $B_{simple,P}$ (optimizer's preconditioner)")
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), aspect="equal")
        units = _units(shown)
        ax.set_xlabel(f"$B_{{simple}}$, mean up to the target\n({units})")
        ax.set_ylabel(f"$B_{{crit}}$ from the sweep\n({units})")
        ax.set_title("Critical batch size against the gradient noise scale")
        ax.legend(loc="upper left", fontsize=5.5)
    return fig


def noise_scale_vs_target(table: pd.DataFrame) -> Figure:
    """B_simple (mean up to the target, and at the target) against the target, per task; the
    x axis runs the way training goes (a loss falls, a return rises)."""
    import matplotlib.pyplot as plt

    shown = placeable(table, x="target", y="b_simple_mean")
    if shown.empty:
        raise Skip("no target with a measured B_simple")
    tasks = list(dict.fromkeys(shown["task"]))
    style = _style(list(dict.fromkeys(table["task"])))
    cols = min(3, len(tasks))
    rows_n = -(-len(tasks) // cols)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows_n, cols, figsize=(COLUMN * cols * 0.75, 2.2 * rows_n),
                                 squeeze=False)
        for ax, task in zip(axes.flat, tasks, strict=False):
            rows = shown[shown["task"] == task].sort_values("target")
            color, marker = style[task]
            x = rows["target"].to_numpy(float)
            y = rows["b_simple_mean"].to_numpy(float)
            ax.errorbar(x, y, yerr=log_error_bars(y, rows["b_simple_mean_se"].to_numpy(float)),
                        fmt=f"{marker}-", color=color, ms=3.5, lw=0.8, capsize=1.5,
                        label="mean up to target")
            at = rows["b_simple_at_target"].to_numpy(float)
            if np.isfinite(at).any():
                ax.plot(x, at, marker, color=color, mfc="none", ms=3.5, label="at target")
            ax.set_yscale("log")
            if (x > 0).all() and x.max() > 10 * x.min():  # log only over a decade or more
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())
            if not bool(rows[DIRECTION_KEY].iloc[0]):
                ax.invert_xaxis()
            ax.set_xlabel(f"{rows['metric'].iloc[0]} reached")
            ax.set_ylabel(f"$B_{{simple}}$ ({literal(str(rows['unit'].iloc[0]))})")
            ax.set_title(str(task))
            ax.legend(fontsize=5)
        for ax in list(axes.flat)[len(tasks):]:
            ax.set_visible(False)
        fig.suptitle("The noise scale grows as training progresses", fontsize=8)
    return fig


FIGURES: dict[str, Callable[[pd.DataFrame], Figure]] = {
    "bcrit_vs_noise_scale": bcrit_vs_noise_scale,
    "noise_scale_vs_target": noise_scale_vs_target,
}


def draw_all(table: pd.DataFrame) -> dict[str, Figure | str]:
    """Every comparison figure, or one line saying why it was skipped."""
    out: dict[str, Figure | str] = {}
    for name, draw in FIGURES.items():
        try:
            out[name] = draw(table)
        except Skip as why:
            out[name] = str(why)
    return out
