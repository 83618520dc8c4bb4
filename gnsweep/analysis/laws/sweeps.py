"""A fixed-budget sweep folder as law input: every run trained to `sweep.max_examples` with no
early stop, its final loss compared per (B, lr). Pure: frames in (`analysis.load.load_sweep`),
rows out.

The final loss of a run is its last eval loss where it evaluated within the last 2% of the
budget (sweep.eval_every), else its last smoothed training loss (the logged causal EMA, whose
lag is harmless at the end of a run at constant loss). A diverged run counts as an infinite
loss: it brackets the optimum.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gnsweep.analysis.pipeline import AnalysisError

FINAL_SHARE = 0.98
"""A run that stopped before this share of the budget stopped early (a target was reached)."""


def final_losses(sweep: str, runs: pd.DataFrame, metrics: pd.DataFrame, max_examples: float
                 ) -> pd.DataFrame:
    """(batch_size, learning_rate, loss) per finished run; AnalysisError naming the first run
    that did not train to the budget."""
    if max_examples <= 0:
        raise AnalysisError(f"{sweep}: not a fixed-budget sweep (sweep.max_examples is 0); "
                            "launch every run to the same budget: sweep.budget=<examples>")
    rows = []
    by_run = dict(tuple(metrics.groupby("run_id", sort=False))) if len(metrics) else {}
    unfinished = runs[~runs["state"].isin(["done", "diverged"])]
    if len(unfinished):
        first = unfinished.iloc[0]
        raise AnalysisError(f"{sweep}: run {first['run_id']} is {first['state']}; finish the "
                            "sweep (relaunch it) before fitting laws")
    for run in runs.itertuples(index=False):
        if run.state == "diverged":
            rows.append((run.batch_size, run.learning_rate, math.inf))
            continue
        rows_of = by_run.get(run.run_id)
        if rows_of is None or not len(rows_of):
            raise AnalysisError(f"{sweep}: run {run.run_id} logged no metrics")
        last = rows_of.sort_values("step").iloc[-1]
        if float(last["examples"]) < FINAL_SHARE * max_examples:
            raise AnalysisError(
                f"{sweep}: run {run.run_id} stopped at {float(last['examples']):,.0f} examples, "
                f"before sweep.max_examples={max_examples:,.0f} (a target was reached): a "
                "fixed-budget sweep trains every run to its budget: launch it with "
                "sweep.budget=<examples>")
        evaluated = rows_of[np.isfinite(rows_of["eval_loss"].to_numpy(float))] if (
            "eval_loss" in rows_of) else rows_of.iloc[:0]
        final_eval = (evaluated.sort_values("step").iloc[-1] if len(evaluated) else None)
        if final_eval is not None and float(final_eval["examples"]) >= FINAL_SHARE * max_examples:
            loss = float(final_eval["eval_loss"])
        else:
            loss = float(last["loss_smooth"])
        rows.append((run.batch_size, run.learning_rate, loss if math.isfinite(loss)
                     else math.inf))
    return pd.DataFrame(rows, columns=["batch_size", "learning_rate", "loss"])
