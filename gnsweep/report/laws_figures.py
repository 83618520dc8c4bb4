"""The figures of `gnsweep laws` from its `Laws` and the runs it fitted; writes no file.

- `laws_fits`: each law against D (one line per model size N, or against N when D is fixed),
  its 95% band, the cells it was fitted on (filled) and the held-out cell (open) with the
  prediction of the fit made without it.
- `laws_landscapes`: each fixed-budget cell's loss over (B, lr), log-log, coloured by the
  loss's excess over the cell's best, the near-optimal set ringed and the optimum starred.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from gnsweep.analysis.laws.cells import configurations, relative_excess
from gnsweep.analysis.laws.family import FIXED_BUDGET, Laws
from gnsweep.report.figures import COLORS, COLUMN, STYLE, Skip

NAMES = {"batch_size": "B_opt", "learning_rate": "lr_opt", "b_crit": "B_crit"}


def laws_fits(result: Laws) -> Figure:
    """Each law with its band and points (module docstring)."""
    if not result.laws:
        raise Skip("no law was fitted (too few usable cells)")
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(result.laws), figsize=(COLUMN * len(result.laws), 2.7),
                                 squeeze=False)
        for ax, law in zip(axes[0], result.laws, strict=True):
            _law_panel(ax, result, law)

    return fig


def _law_panel(ax, result: Laws, law) -> None:
    cells = result.cells
    if law.target is not None:
        cells = cells[cells["target"] == law.target]
    # A law in the target loss L (Kaplan's B_crit(L)) is drawn against each cell's target.
    along = "L" if "L" in law.law.variables else "D" if "D" in law.law.variables else "N"
    column = "target" if along == "L" else along
    other = "N" if along == "D" else "D"
    groups = ([] if along == "L" else sorted(cells[other].dropna().unique())) or [math.nan]
    held = law.held_out
    for i, value in enumerate(groups):
        color = COLORS[i % len(COLORS)]
        rows = cells if math.isnan(value) else cells[cells[other] == value]
        usable = rows[f"{law.quantity}_usable"] if f"{law.quantity}_usable" in rows else ~rows[
            "edge"]
        x, y = rows[column].to_numpy(float), rows[law.quantity].to_numpy(float)
        used = usable.to_numpy(bool)
        is_held = (rows["N"].to_numpy(float) == held["N"]) & (np.nan_to_num(
            rows["D"].to_numpy(float), nan=1.0) == (held["D"] if held["D"] == held["D"] else 1.0))
        label = f"{other}={value:.3g}" if not math.isnan(value) else None
        ax.scatter(x[used & ~is_held], y[used & ~is_held], color=color, s=14, zorder=3,
                   label=label)
        ax.scatter(x[~used], y[~used], color=color, marker="x", s=14, zorder=3)
        ax.scatter(x[used & is_held], y[used & is_held], facecolors="none", edgecolors=color,
                   s=30, zorder=3)
        grid = np.geomspace(np.nanmin(cells[column]) / 1.5, np.nanmax(cells[column]) * 1.5, 50)
        fixed = value if not math.isnan(value) else 1.0
        points = [law.law.predict(*(fixed, g) if along in ("D", "L") else (g, fixed))
                  for g in grid]
        mid, low, high = (np.array(p) for p in zip(*points, strict=True))
        ax.plot(grid, mid, color=color, lw=1)
        ax.fill_between(grid, low, high, color=color, alpha=0.15, lw=0)
    if held.get("predicted") is not None:
        x_held = held["target" if along == "L" else along]
        ax.errorbar([x_held], [held["predicted"]], yerr=[[held["predicted"]
                     - held["predicted_low"]], [held["predicted_high"] - held["predicted"]]],
                    fmt="D", color="black", ms=3, capsize=2, zorder=4,
                    label="held out: predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("target loss" if along == "L" else along)
    coefs = law.law.coefficients()
    exps = ", ".join(f"{k}={v['value']:.3g}" for k, v in coefs.items() if k != "c")
    target = f" (target {law.target:g})" if law.target is not None else ""
    ax.set_ylabel(NAMES.get(law.quantity, law.quantity))
    ax.set_title(f"{NAMES.get(law.quantity)}{target} = {law.law.form}; {exps}")
    ax.legend(loc="best")


MAX_POINTS = 4000
"""Configurations drawn per cell of the landscapes figure: the lowest losses."""


def laws_landscapes(result: Laws, runs: pd.DataFrame) -> Figure:
    """Each cell's loss landscape with its optimum and near-optimal set (module docstring)."""
    if result.kind != FIXED_BUDGET:
        raise Skip("steps-to-target input has no fixed-budget loss landscape")
    cells = result.cells
    n_cols = min(len(cells), 4)
    n_rows = math.ceil(len(cells) / n_cols)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(n_rows, n_cols, figsize=(1.9 * n_cols, 1.8 * n_rows),
                                 squeeze=False, sharex=False, sharey=False)
        scatter = None
        for ax, cell in zip(axes.flat, cells.itertuples(index=False), strict=False):
            rows = runs[(runs["N"] == cell.N) & (runs["D"] == cell.D)]
            b, lr, loss, _ = configurations(rows["batch_size"].to_numpy(float),
                                            rows["learning_rate"].to_numpy(float),
                                            rows["loss"].to_numpy(float))
            if len(loss) > MAX_POINTS:
                # A dense grid (100,000 configurations a cell) is drawn by its valley: the
                # configurations of lowest loss, so that a figure costs the same at any size.
                keep = np.argsort(loss, kind="stable")[:MAX_POINTS]
                b, lr, loss = b[keep], lr[keep], loss[keep]
            finite = np.isfinite(loss)
            excess = relative_excess(loss[finite], cell.best_loss)
            scatter = ax.scatter(b[finite], lr[finite], c=np.maximum(excess, 1e-5), s=10,
                                 cmap="viridis", norm=LogNorm(1e-4, 1.0))
            ax.scatter(b[~finite], lr[~finite], marker="x", color="grey", s=8)
            near = excess <= result.tolerance
            ax.scatter(b[finite][near], lr[finite][near], facecolors="none", edgecolors="red",
                       s=28, lw=0.7)
            ax.scatter([cell.batch_size], [cell.learning_rate], marker="*", color="red", s=40,
                       zorder=4)
            ax.set_xscale("log")
            ax.set_yscale("log")
            edge = " (edge)" if cell.edge else ""
            ax.set_title(f"N={cell.N:.3g} D={cell.D:.3g}{edge}", fontsize=6.5)
            ax.tick_params(labelsize=5.5)
        for ax in list(axes.flat)[len(cells):]:
            ax.set_visible(False)
        fig.supxlabel("batch size", fontsize=7)
        fig.supylabel("learning rate", fontsize=7)

        if scatter is not None:
            fig.colorbar(scatter, ax=axes.ravel().tolist(), label="loss / best - 1", shrink=0.8)
    return fig


def draw_all(result: Laws, runs: pd.DataFrame) -> dict[str, Figure | str]:
    """Every laws figure, or one line saying why it was skipped."""
    out: dict[str, Figure | str] = {}
    for name, draw in (("laws_fits", lambda: laws_fits(result)),
                       ("laws_landscapes", lambda: laws_landscapes(result, runs))):
        try:
            out[name] = draw()
        except Skip as why:
            out[name] = str(why)
    return out
