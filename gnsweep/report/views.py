"""What the figures show, decided from the results' tables: which fits can be placed on a
plot, the best-tuned run of each batch size, the grid's cells, the fitted eps_opt(B) curve.
Pure pandas/numpy (no matplotlib), so the report and tests use the same rules as the figures.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gnsweep.targets import FALLING, Direction


def finite(frame: pd.DataFrame, column: str) -> pd.Series:
    if column not in frame:
        return pd.Series(False, index=frame.index)
    values = pd.to_numeric(frame[column], errors="coerce")
    return np.isfinite(values) & (values > 0)


def fitted(fits: pd.DataFrame) -> pd.DataFrame:
    return fits[finite(fits, "b_crit") & finite(fits, "s_min") & finite(fits, "e_min")]


def bounded(table: pd.DataFrame) -> pd.DataFrame:
    """The rows whose B_crit is only a bound (`bcrit_status` lower_bound or upper_bound, with
    the grid edge in `b_crit_bound`): drawn as arrows at that edge, never as a value."""
    if "bcrit_status" not in table or "b_crit_bound" not in table:
        return table.iloc[0:0]
    status = table["bcrit_status"].astype(str)
    return table[status.isin(("lower_bound", "upper_bound")) & finite(table, "b_crit_bound")]


def preconditioned(table: pd.DataFrame, of: str = "b_simple_precond_mean",
                   plain: str = "b_simple_mean") -> bool:
    """Whether `table` holds a B_simple_P worth showing beside B_simple: logged somewhere, and
    not B_simple itself (SGD's P is the identity, so its B_simple_P is B_simple to the bit and
    would only repeat it)."""
    if of not in table or plain not in table:
        return False
    p = pd.to_numeric(table[of], errors="coerce").to_numpy(float)
    b = pd.to_numeric(table[plain], errors="coerce").to_numpy(float)
    shown = np.isfinite(p)
    return bool(shown.any()) and not bool(np.allclose(p[shown], b[shown], rtol=1e-9,
                                                      atol=0.0, equal_nan=False))


def quantity(meta: dict) -> str:
    """What the targets are values of, from an analysis' meta: "loss", or the task's own
    metric ("return": cartpole's, higher is better)."""
    return str(meta.get("metric") or "loss")


def unit(meta: dict) -> str:
    """What B, E and B_crit are counted in, from an analysis' meta: the task's unit (examples,
    tokens, environment steps), recorded by `gnsweep analyze`."""
    return str(meta.get("unit") or "examples")


def placed(fits: pd.DataFrame, front: pd.DataFrame | None,
           what: str = "loss") -> tuple[pd.DataFrame, list[str]]:
    """The fitted targets whose B_crit lies within a factor 2 of the measured batch sizes, and
    one line for each of the others (the fit bounds B_crit there but cannot place it)."""
    if front is None or front.empty or fits.empty:
        return fits, []
    b_lo, b_hi = float(front["batch_size"].min()), float(front["batch_size"].max())
    inside = (fits["b_crit"] <= 2 * b_hi) & (fits["b_crit"] >= b_lo / 2)
    off = [f"{what} {row.target:g}: B_crit {'beyond' if row.b_crit > b_hi else 'below'} "
           f"{b_hi if row.b_crit > b_hi else b_lo:g}, not shown"
           for row in fits[~inside].itertuples(index=False)]
    return fits[inside], off


def best_runs(runs: pd.DataFrame, metrics: pd.DataFrame, front: pd.DataFrame,
              direction: Direction | bool = FALLING) -> pd.DataFrame:
    """The best-tuned run of each batch size: the learning rate that reached the hardest target
    it reached in fewest steps (from `front`; the hardest in the targets' direction,
    `Direction.hardest`: the smallest loss, the largest return); a batch size that
    reached none falls back to its run with the lowest final smoothed loss. Diverged runs are
    never chosen.
    Columns: batch_size, learning_rate, run_id, reached (whether any target was reached)."""
    out = []
    alive = runs[runs["state"] != "diverged"] if "state" in runs else runs
    have_metrics = set(metrics["run_id"]) if "run_id" in metrics else set()
    alive = alive[alive["run_id"].isin(have_metrics)]
    final = (metrics.sort_values("step").groupby("run_id")["loss_smooth"].last()
             if len(metrics) else pd.Series(dtype=float))
    for batch, group in alive.groupby("batch_size", sort=True):
        best = front[front["batch_size"] == batch] if len(front) else front
        reached = len(best) > 0
        if reached:
            target = Direction.of(direction).hardest(best["target"].astype(float))
            lr = float(best[best["target"] == target]["learning_rate"].iloc[0])
            chosen = group[np.isclose(group["learning_rate"], lr)]
            if chosen.empty:
                reached, chosen = False, group
        else:
            chosen = group
        if not reached:
            losses = final.reindex(chosen["run_id"]).to_numpy(float)
            losses = np.where(np.isfinite(losses), losses, np.inf)
            chosen = chosen.iloc[[int(np.argmin(losses))]]
        row = chosen.sort_values("seed").iloc[0] if "seed" in chosen else chosen.iloc[0]
        out.append({"batch_size": int(batch), "learning_rate": float(row["learning_rate"]),
                    "run_id": row["run_id"], "reached": reached})
    return pd.DataFrame(out, columns=["batch_size", "learning_rate", "run_id", "reached"])


def grid_cells(steps: pd.DataFrame) -> pd.DataFrame:
    """Per (target, batch size, learning rate): mean steps over seeds where every seed reached
    the target, and the cell's outcome: 'reached', 'diverged' or 'early' (any seed) or 'not
    reached'."""
    def outcome(group: pd.DataFrame) -> pd.Series:
        if group["reached"].astype(bool).all():
            return pd.Series({"steps": group["steps"].mean(), "outcome": "reached"})
        states = set(group["state"]) if "state" in group else set()
        if "outcome" in group:  # newer steps tables say why a run did not reach it
            states |= set(group["outcome"])
        worst = next((s for s in ("diverged", "early", "failed", "corrupt", "pending",
                                  "running")
                      if s in states), "not reached")
        return pd.Series({"steps": np.nan, "outcome": worst})

    keys = ["target", "batch_size", "learning_rate"]
    rows = [{**dict(zip(keys, key, strict=True)), **outcome(group).to_dict()}
            for key, group in steps.groupby(keys, sort=True)]
    return pd.DataFrame(rows, columns=[*keys, "steps", "outcome"])


def lr_fit_curve(fit: pd.Series | None, batch_sizes: np.ndarray) -> np.ndarray | None:
    """The fitted eps_opt(B) = eps_max / (1 + (B_noise/B)^alpha) (eq. 2.7 with alpha = 1 for
    SGD; alpha free for Adam-like optimizers) from one fits.parquet row, or None without one."""
    if fit is None:
        return None
    values = [fit.get("eps_max", np.nan), fit.get("b_noise_lr", np.nan),
              fit.get("lr_alpha", 1.0)]
    try:
        eps_max, b_noise, alpha = (float(v) for v in values)
    except (TypeError, ValueError):
        return None
    if not (np.isfinite([eps_max, b_noise, alpha]).all() and eps_max > 0 and b_noise > 0):
        return None
    return eps_max / (1 + (b_noise / np.asarray(batch_sizes, float)) ** alpha)
