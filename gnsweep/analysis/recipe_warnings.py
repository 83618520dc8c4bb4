"""What a run's learning-rate schedule does to the fits: warnings, per target, where the answer
measures the schedule rather than the batch size.

- A target reached inside the warmup measures the warmup: S_min (or E_min, for a warmup
  counted in examples) below the warmup's length, or best runs that reached the target before
  their warmup ended. A warmup in steps is longer in examples at larger batches, which bends
  the front: a 30-step warmup halved a GPT-2's B_crit when S_min was 27 steps.
- A target reached after the decay's horizon was reached at the floor rate (min_lr_ratio x
  the run's rate), not at the rate the grid swept.
"""

from __future__ import annotations

import math

import pandas as pd

from gnsweep.config import Config


def recipe_warnings(config: Config, fits: pd.DataFrame, front: pd.DataFrame) -> list[str]:
    """One warning per target and problem (`fits`: s_min, e_min per target; `front`: the best
    run per target and batch size, with its steps and examples to the target)."""
    train = config.train
    out: list[str] = []
    for target in dict.fromkeys([*fits["target"], *front["target"]]):  # the fits' order
        fit = fits[fits["target"] == target]
        best = front[front["target"] == target]
        out += _warmup(target, train.warmup_steps, train.warmup_examples, fit, best)
        # With no horizon given, the horizon is the run's budget, which no run passes.
        if train.decay != "constant" and train.decay_examples:
            late = best[best["examples"] > train.decay_examples]
            if len(late):
                out.append(f"target {target:g}: reached after the decay's horizon "
                           f"(train.decay_examples={train.decay_examples}) at batch sizes "
                           f"{_sizes(late)}: at the floor rate (train.min_lr_ratio="
                           f"{train.min_lr_ratio:g} x the grid's), not the rate swept; "
                           "lengthen the decay")
    return out


def _warmup(target: float, steps: int, examples: int, fit: pd.DataFrame,
            best: pd.DataFrame) -> list[str]:
    if not (steps or examples):
        return []
    length = f"{steps} steps" if steps else f"{examples} examples"
    s_min = float(fit["s_min"].iloc[0]) if len(fit) else math.nan
    e_min = float(fit["e_min"].iloc[0]) if len(fit) else math.nan
    if steps and s_min < steps:
        return [f"target {target:g}: S_min {s_min:.3g} steps falls inside the warmup ({length}):"
                " the fit measures the warmup; count the warmup in examples "
                "(train.warmup_examples) or shorten it"]
    if examples and e_min < examples:
        return [f"target {target:g}: E_min {e_min:.3g} examples falls inside the warmup "
                f"({length}): the fit measures the warmup; shorten it"]
    inside = best[best["steps"] <= steps] if steps else best[best["examples"] <= examples]
    if len(inside):
        return [f"target {target:g}: reached inside the warmup ({length}) at batch sizes "
                f"{_sizes(inside)}: those points measure the warmup"]
    return []


def _sizes(rows: pd.DataFrame) -> str:
    return ", ".join(f"{b:g}" for b in sorted(rows["batch_size"].astype(float)))
