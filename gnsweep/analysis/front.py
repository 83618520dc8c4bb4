"""Best learning rate per batch size and target, and the Pareto front in (examples, steps)."""

from __future__ import annotations

import numpy as np
import pandas as pd


def best_per_batch(steps: pd.DataFrame) -> pd.DataFrame:
    """For each (target, batch size): the learning rate that reaches the target in fewest steps.

    Seeds are averaged first; a (batch size, learning rate) counts as reaching a target only if
    every seed reached it. Batch sizes where no learning rate reached it are left out.
    Columns: target, batch_size, learning_rate, steps, examples, n_lr_reached, lr_on_edge,
    b_simple_at_target, b_simple_mean.
    """
    grouped = (steps.groupby(["target", "batch_size", "learning_rate"], as_index=False)
               .agg(steps=("steps", "mean"), all_reached=("reached", "all"),
                    b_simple_at_target=("b_simple_at_target", "mean"),
                    b_simple_mean=("b_simple_mean", "mean")))
    reached = grouped[grouped["all_reached"]]
    if reached.empty:
        return pd.DataFrame(columns=BEST_COLUMNS)
    best = reached.loc[reached.groupby(["target", "batch_size"])["steps"].idxmin()].copy()
    counts = reached.groupby(["target", "batch_size"]).size().rename("n_lr_reached")
    best = best.join(counts, on=["target", "batch_size"])
    lrs = np.sort(steps["learning_rate"].unique())
    best["lr_on_edge"] = (len(lrs) > 1) & best["learning_rate"].isin([lrs[0], lrs[-1]])
    best["examples"] = best["steps"] * best["batch_size"]
    return best[BEST_COLUMNS].sort_values(["target", "batch_size"]).reset_index(drop=True)


BEST_COLUMNS = ["target", "batch_size", "learning_rate", "steps", "examples", "n_lr_reached",
                "lr_on_edge", "b_simple_at_target", "b_simple_mean"]


def pareto_mask(examples: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """True where no other point needs both fewer (or equal) examples and fewer steps."""
    examples, steps = np.asarray(examples, float), np.asarray(steps, float)
    keep = np.ones(len(steps), bool)
    for i in range(len(steps)):
        dominated = (examples <= examples[i]) & (steps <= steps[i]) & (
            (examples < examples[i]) | (steps < steps[i]))
        keep[i] = not dominated.any()
    return keep


def pareto_front(best: pd.DataFrame) -> pd.DataFrame:
    """The best points with `on_front`: whether each is Pareto-optimal within its target."""
    parts = []
    for _, group in best.groupby("target", sort=False):
        group = group.copy()
        group["on_front"] = pareto_mask(group["examples"].to_numpy(), group["steps"].to_numpy())
        parts.append(group)
    return pd.concat(parts, ignore_index=True) if parts else best.assign(on_front=pd.Series(
        dtype=bool))
