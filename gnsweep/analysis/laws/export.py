"""`Laws` as the tables and the JSON `gnsweep laws` writes (docs/laws.md): laws.parquet one row
per law, law_cells.parquet one row per cell, laws.json the contract below. Pure: no files.

laws.json: `laws` (quantity, form, coefficients name -> {value, low, high}, held_out {N, D,
predicted, measured, ...}), `cells` (N, D, batch_size, learning_rate, loss, edge, ...),
`prediction` with --predict, and `refused`, `warnings`, `references`, `tolerance`, `kind`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from gnsweep.analysis.laws.family import REFERENCES, Laws
from gnsweep.tables import columns


def plain(value: Any) -> Any:
    """JSON-ready: NaN and inf as null, numpy scalars unwrapped."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, (np.integer, int)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(float(value)) else None
    return value


def laws_frame(result: Laws) -> pd.DataFrame:
    """One row per law (fitted or refused): coefficients with intervals, the held-out check."""
    rows = []
    for law in result.laws:
        row: dict[str, Any] = {"quantity": law.quantity, "form": law.law.form,
                               "target": math.nan if law.target is None else law.target,
                               "n_points": law.law.n_points, "rmse_log": law.law.rmse_log,
                               "refused": "", "scope": law.scope}
        for name, coef in law.law.coefficients().items():
            row.update({name: coef["value"], f"{name}_low": coef["low"],
                        f"{name}_high": coef["high"]})
        held = law.held_out
        row.update(held_out_N=held["N"], held_out_D=held["D"],
                   held_out_predicted=_nan(held["predicted"]),
                   held_out_low=_nan(held["predicted_low"]),
                   held_out_high=_nan(held["predicted_high"]),
                   held_out_measured=held["measured"], held_out_ratio=_nan(held["ratio"]))
        rows.append(row)
    for refused in result.refused:
        rows.append({"quantity": refused["quantity"], "form": "",
                     "target": math.nan if refused["target"] is None else refused["target"],
                     "n_points": 0, "refused": refused["reason"],
                     "scope": refused.get("scope", "")})
    frame = pd.DataFrame(rows).reindex(columns=columns("laws"))
    frame["n_points"] = frame["n_points"].fillna(0).astype(int)
    for name in ("quantity", "form", "refused", "scope"):
        frame[name] = frame[name].fillna("").astype(str)
    return frame


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def laws_json(result: Laws) -> dict[str, Any]:
    """The content of laws.json (module docstring)."""
    laws = []
    for law in result.laws:
        entry: dict[str, Any] = {"quantity": law.quantity, "form": law.law.form,
                                 "form_reason": law.form_reason, "target": law.target,
                                 "coefficients": law.law.coefficients(),
                                 "held_out": law.held_out, "n_points": law.law.n_points,
                                 "rmse_log": law.law.rmse_log}
        if law.scope:
            entry["scope"] = law.scope
        if "L" in law.law.variables:
            # Kaplan's B_crit(L) = B* / L^(1/alpha_B): alpha_B = -1/g, B* = c.
            g = law.law.coefficients()["g"]
            ends = sorted(-1 / v if v else math.inf for v in (g["low"], g["high"]))
            entry["alpha_B"] = {"value": -1 / g["value"] if g["value"] else math.inf,
                                "low": ends[0] if g["low"] * g["high"] > 0 else None,
                                "high": ends[1] if g["low"] * g["high"] > 0 else None}
        laws.append(entry)
    cells = result.cells.drop(columns=[c for c in ("target",) if result.cells[c].isna().all()])
    data: dict[str, Any] = {
        "kind": result.kind, "tolerance": result.tolerance,
        "tolerance_source": result.tolerance_source, "bootstrap": result.bootstrap,
        "laws": laws, "refused": result.refused,
        "cells": cells.to_dict(orient="records"), "held_out_loss": result.held_out_loss,
        "warnings": result.warnings,
        "references": [{**r, "note": "published, for comparison only; not fitted here"}
                       for r in REFERENCES]}
    if result.prediction is not None:
        data["prediction"] = result.prediction
    return plain(data)
