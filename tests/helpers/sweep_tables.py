"""A synthetic sweep whose answers are known: steps follow S = S_min + E_min/B (eq. 2.11) exactly.

Used by tests/report/ (the figures, the report) to draw every figure in well under a second,
without training.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gnsweep.analysis.results import Results

BATCHES = [8, 16, 32, 64, 128, 256]
LRS = [0.1, 0.3, 1.0, 3.0]
TARGETS = [1.0, 0.5, 0.25]


def s_min(target: float) -> float:
    return 10.0 / target


def e_min(target: float) -> float:
    return 500.0 / target**1.5


def b_crit(target: float) -> float:
    """E_min / S_min = 50 / sqrt(target) (eq. 2.12): 50, 70.7, 100."""
    return e_min(target) / s_min(target)


def best_lr(batch: int) -> float:
    return 0.3 if batch <= 16 else 1.0


def steps_at(batch: int, lr: float, target: float) -> float:
    """Optimal steps at the best rate; 50% more per factor ~3 away from it."""
    penalty = 1 + 0.5 * abs(math.log(lr / best_lr(batch)) / math.log(3.0))
    return (s_min(target) + e_min(target) / batch) * penalty


def run_id(batch: int, lr: float) -> str:
    return f"b{batch:05d}_lr{lr:g}_s0"


def outcome(batch: int, lr: float, target: float) -> str:
    if lr == 3.0 and batch <= 16:
        return "diverged"
    if lr == 0.1 and target == min(TARGETS):
        return "not_reached"
    return "reached"


def make_tables(targets: list[float] = TARGETS, b_noise: bool = False) -> Results:
    runs, steps, front, fits, metrics = [], [], [], [], []
    for batch in BATCHES:
        for lr in LRS:
            rid = run_id(batch, lr)
            diverged = outcome(batch, lr, targets[0]) == "diverged"
            runs.append({"run_id": rid, "batch_size": batch, "learning_rate": lr, "seed": 0,
                         "state": "diverged" if diverged else "done"})
            for target in targets:
                result = outcome(batch, lr, target)
                n = steps_at(batch, lr, target) if result == "reached" else math.nan
                steps.append({"run_id": rid, "batch_size": batch, "learning_rate": lr,
                              "seed": 0, "target": target, "state": runs[-1]["state"],
                              "reached": result == "reached", "steps": n,
                              "examples": n * batch, "b_simple_at_target": b_crit(target),
                              "b_simple_mean": b_crit(target) * 0.8, "outcome": result})
            # Loss falls as exp(-rate * step) down to 0.2; the noise scale grows as 20/loss.
            last = 4 * steps_at(batch, lr, min(targets))
            step = np.unique(np.geomspace(1, last, 120).astype(int))  # log-spaced logging
            rate = math.log(2) / steps_at(batch, lr, max(targets))
            loss = 2 * np.exp(-rate * step) + 0.2
            metrics.append(pd.DataFrame({
                "run_id": rid, "step": step, "examples": step * batch, "loss": loss,
                "loss_smooth": loss, "eval_loss": np.nan, "b_simple": 20 / loss,
                "b_noise": 30 / loss if b_noise else np.nan}))
    for target in targets:
        for batch in BATCHES:
            n = steps_at(batch, best_lr(batch), target)
            front.append({"target": target, "batch_size": batch,
                          "learning_rate": best_lr(batch), "steps": n, "examples": n * batch,
                          "n_lr_reached": 3, "lr_on_edge": False,
                          "b_simple_at_target": b_crit(target),
                          "b_simple_mean": b_crit(target) * (0.6 + 0.1 * BATCHES.index(batch)),
                          "on_front": True, "lr_opt": best_lr(batch)})
        b = b_crit(target)
        fits.append({"target": target, "n_batch_sizes": len(BATCHES), "s_min": s_min(target),
                     "s_min_se": 0.05 * s_min(target), "e_min": e_min(target),
                     "e_min_se": 0.05 * e_min(target), "b_crit": b, "b_crit_se": 0.1 * b,
                     "rmse_log": 0.0, "b_simple_at_target": b, "b_simple_mean": 0.8 * b,
                     "ratio": 1.25, "refused": "", "lr_model": "sgd", "eps_max": 1.2,
                     "b_noise_lr": 20.0, "lr_alpha": 1.0, "lr_refused": "",
                     "b_noise_mean": 1.2 * b if b_noise else math.nan})
    # B_crit = 50 / L^(1/2): the power law with B_* = 50, alpha_B = 2.
    law = {"n_targets": len(targets), "b_star": 50.0, "b_star_se": 0.0, "alpha_b": 2.0,
           "alpha_b_se": 0.0, "rmse_log": 0.0, "refused": ""}
    return Results(runs=pd.DataFrame(runs), metrics=pd.concat(metrics, ignore_index=True),
                       steps=pd.DataFrame(steps), front=pd.DataFrame(front),
                       fits=pd.DataFrame(fits), loss_scaling=pd.DataFrame([law]),
                       warnings=["target 1: best learning rate on the edge of the grid"])
