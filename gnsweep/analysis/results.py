"""The one results type of an analysis: the tables `gnsweep analyze` derives from a sweep
(steps, front, fits, lr_fits, loss_scaling), its warnings and provenance, and, for figures and
the report, the runs and metrics they came from. Pure: `gnsweep.folder.read_results` makes one
from the tables `gnsweep.store` reads; the tables' columns are `gnsweep.tables`'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from gnsweep.tables import columns

ADAPTIVE_COLUMNS = columns("adaptive")
LOSS_SCALING_COLUMNS = columns("loss_scaling")
LR_FIT_COLUMNS = columns("lr_fits")
TEMPERATURE_COLUMNS = columns("temperature")


@dataclass
class Results:
    steps: pd.DataFrame
    """One row per (run, target): reached, steps, examples (steps.parquet)."""
    front: pd.DataFrame
    """Best learning rate per (target, batch size), with on_front (front.parquet)."""
    fits: pd.DataFrame
    """One row per target: S_min, E_min, B_crit with errors, B_simple beside (fits.parquet)."""
    warnings: list[str] = field(default_factory=list)
    lr_fits: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=LR_FIT_COLUMNS))
    """eps_opt(B) fits, one row per (target, model) (lr_fits.parquet)."""
    loss_scaling: pd.DataFrame = field(
        default_factory=lambda: pd.DataFrame(columns=LOSS_SCALING_COLUMNS))
    """B_crit(L) = B*/L^(1/alpha_B), one row (loss_scaling.parquet)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Where the analysis came from and how it was run (fits.json)."""
    runs: pd.DataFrame = field(default_factory=pd.DataFrame)
    """One row per run: run_id, batch_size, learning_rate, seed, state (for figures)."""
    metrics: pd.DataFrame = field(default_factory=pd.DataFrame)
    """One row per logged step: run_id, step, examples, loss, loss_smooth, b_simple, b_noise."""
    adaptive: pd.DataFrame = field(
        default_factory=lambda: pd.DataFrame(columns=ADAPTIVE_COLUMNS))
    """Adaptive batch size runs (appendix D) against the fits, one row per (run, target);
    empty without adaptive runs (adaptive.parquet, docs/adaptive.md)."""
    along: pd.DataFrame = field(default_factory=pd.DataFrame)
    """A branch sweep's local B_crit, one row per (branch point, target) (along.parquet,
    `analysis.along.ALONG_COLUMNS`, docs/along.md); empty for any other sweep."""
    along_schedule: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Runs whose batch size follows a measured B_crit curve (`sweep.schedule=along`) against
    the fastest fixed batch size, one row per (run, target) (along_schedule.parquet,
    `analysis.along.SCHEDULE_COLUMNS`); empty without such runs."""
    along_base: pd.DataFrame = field(default_factory=pd.DataFrame)
    """A branch sweep's base run: smoothed loss and noise scales per row (along_base.parquet,
    `analysis.along.BASE_COLUMNS`); empty for any other sweep."""
    temperature: pd.DataFrame = field(
        default_factory=lambda: pd.DataFrame(columns=TEMPERATURE_COLUMNS))
    """B_simple against the temperature eps/B, one row per target (temperature.parquet,
    `analysis.temperature`, appendix C)."""
    recommendation: dict[str, Any] | None = None
    """The batch size and learning rate to train with (`analysis.decision`, its `to_json`),
    written into fits.json by `gnsweep analyze`; None where none was made."""

    @property
    def bcrit_law(self) -> dict | None:
        """The power law B_crit(L) = B_* / L^(1/alpha_B) as a record (b_star, alpha_b, their
        _se, refused); None when the analysis did not write it."""
        rows = self.loss_scaling.to_dict(orient="records")
        return rows[0] if rows else None

    @bcrit_law.setter
    def bcrit_law(self, law: dict | None) -> None:
        self.loss_scaling = (pd.DataFrame([law]) if law is not None
                             else pd.DataFrame(columns=LOSS_SCALING_COLUMNS))

    def to_json(self) -> dict[str, Any]:
        """fits.json: the fits, lr fits, loss scaling, warnings and meta as plain data."""
        scaling = _records(self.loss_scaling)
        return {"fits": _records(self.fits), "lr_fits": _records(self.lr_fits),
                "loss_scaling": scaling[0] if scaling else None,
                "adaptive": _records(self.adaptive), "along": _records(self.along),
                "along_schedule": _records(self.along_schedule),
                "recommendation": self.recommendation,
                "warnings": self.warnings, "meta": self.meta}


def _records(frame: pd.DataFrame) -> list[dict]:
    return [{k: _plain(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]


def _plain(value: Any) -> Any:
    if isinstance(value, (float, np.floating)):
        return None if not math.isfinite(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value
