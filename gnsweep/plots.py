"""Figures from analysis tables. Takes DataFrames, returns matplotlib figures; reads no files.

One style for every figure: Okabe-Ito colours (colour-blind safe), sized for a paper column.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from gnsweep.analysis.fit import predict_steps

# Okabe & Ito (2008): distinguishable with every common colour-vision deficiency.
COLORS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
STYLE = {
    "figure.figsize": (4.8, 3.6), "figure.dpi": 150, "font.size": 9, "axes.titlesize": 10,
    "axes.labelsize": 9, "legend.fontsize": 8, "axes.grid": True, "grid.alpha": 0.3,
    "axes.spines.top": False, "axes.spines.right": False, "savefig.bbox": "tight",
}


def pareto_fronts(front: pd.DataFrame, fits: pd.DataFrame) -> Figure:
    """Steps against examples to reach each target, best learning rate per batch size, with the
    fitted hyperbola (S/S_min - 1)(E/E_min - 1) = 1 and its B_crit point (2 E_min, 2 S_min)."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots()
        for i, (target, group) in enumerate(front.groupby("target", sort=True)):
            color = COLORS[i % len(COLORS)]
            ax.scatter(group["examples"], group["steps"], color=color, zorder=3, s=22,
                       label=f"loss {target:g}")
            for row in group.itertuples(index=False):
                ax.annotate(f"{row.batch_size}", (row.examples, row.steps), fontsize=6,
                            xytext=(3, 3), textcoords="offset points", color=color)
            fit = fits[fits["target"] == target]
            if fit.empty or not np.isfinite(fit["s_min"].iloc[0]):
                continue
            s_min, e_min = float(fit["s_min"].iloc[0]), float(fit["e_min"].iloc[0])
            b = np.geomspace(group["batch_size"].min() / 4, group["batch_size"].max() * 4, 200)
            s = predict_steps(b, s_min, e_min)
            ax.plot(b * s, s, color=color, lw=1.2, alpha=0.8)
            ax.scatter([2 * e_min], [2 * s_min], marker="*", s=90, color=color,
                       edgecolor="black", linewidth=0.5, zorder=4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("examples processed E")
        ax.set_ylabel("optimizer steps S")
        ax.set_title("Pareto fronts: steps vs examples to reach each target\n"
                     "(lines: fit of eq. 2.11, stars: B_crit; labels: batch size)")
        ax.legend(title="target")
        return fig


def bcrit_vs_bsimple(fits: pd.DataFrame) -> Figure:
    """B_crit from the fits against B_simple (S_min-weighted mean over the run), with y = x."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots()
        ok = fits[np.isfinite(fits["b_crit"]) & np.isfinite(fits["b_simple_mean"])]
        for i, row in enumerate(ok.itertuples(index=False)):
            yerr = row.b_crit_se if np.isfinite(row.b_crit_se) else 0
            ax.errorbar([row.b_simple_mean], [row.b_crit], yerr=[[min(yerr, row.b_crit * 0.99)],
                        [yerr]], fmt="o", color=COLORS[i % len(COLORS)], capsize=3,
                        label=f"loss {row.target:g}")
        values = np.concatenate([ok["b_crit"], ok["b_simple_mean"]]) if len(ok) else np.ones(1)
        lo, hi = values[values > 0].min() / 3, values.max() * 3
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("B_simple (S_min-weighted mean up to the target)")
        ax.set_ylabel("B_crit = E_min / S_min (fit)")
        ax.set_title("Critical batch size vs measured noise scale")
        ax.legend()
        return fig


def save(fig: Figure, stem: str, out_dir, formats: tuple[str, ...] = ("png", "pdf")) -> list:
    """Write one figure in each format; returns the paths."""
    from pathlib import Path

    from gnsweep.store import _atomic_path

    paths = []
    for fmt in formats:
        path = Path(out_dir) / f"{stem}.{fmt}"
        with _atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt)
        paths.append(path)
    plt.close(fig)
    return paths
