"""Tables made elsewhere for `gnsweep laws --table`: one row a run, in one of two shapes.

- fixed budget: `N, D, batch_size, learning_rate, loss` (the final loss after D examples or
  tokens; NaN or inf for a run that diverged);
- steps to target: `N, batch_size, steps`, optional `D`, `target` (one target when absent),
  `learning_rate`.

Other columns (seed, run_id...) are ignored. Every problem is an AnalysisError naming the file,
the column and the row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from gnsweep.analysis.external import _numeric, read_table_file
from gnsweep.analysis.laws.family import FIXED_BUDGET, STEPS
from gnsweep.analysis.pipeline import AnalysisError

FIXED_REQUIRED = ("N", "D", "batch_size", "learning_rate", "loss")
STEPS_REQUIRED = ("N", "batch_size", "steps")


def family_table(path: Path) -> tuple[str, pd.DataFrame]:
    """(kind, runs) from a table file: kind FIXED_BUDGET or STEPS, runs with the columns the
    kind's fit reads (`family.fixed_budget_laws`, `family.steps_laws`)."""
    frame = read_table_file(path)
    frame.columns = [str(c).strip() for c in frame.columns]
    if frame.empty:
        raise AnalysisError(f"{path}: the table has no rows")
    present = set(frame.columns)
    if set(FIXED_REQUIRED) <= present:
        return FIXED_BUDGET, pd.DataFrame({
            "N": _numeric(path, frame, "N", positive=True),
            "D": _numeric(path, frame, "D", positive=True),
            "batch_size": _numeric(path, frame, "batch_size", positive=True),
            "learning_rate": _numeric(path, frame, "learning_rate", positive=True),
            # A diverged run's loss is NaN or inf: kept, it brackets the optimum.
            "loss": _numeric(path, frame, "loss", finite=False)})
    if set(STEPS_REQUIRED) <= present:
        n = len(frame)
        return STEPS, pd.DataFrame({
            "N": _numeric(path, frame, "N", positive=True),
            "D": (_numeric(path, frame, "D", positive=True) if "D" in frame
                  else np.full(n, np.nan)),
            "batch_size": _numeric(path, frame, "batch_size", positive=True),
            "steps": _numeric(path, frame, "steps", positive=True),
            "target": (_numeric(path, frame, "target") if "target" in frame
                       else np.ones(n)),
            "learning_rate": (_numeric(path, frame, "learning_rate", positive=True)
                              if "learning_rate" in frame else np.full(n, np.nan))})
    if "loss" in present or ("learning_rate" in present and "steps" not in present):
        missing = [c for c in FIXED_REQUIRED if c not in present]
        raise AnalysisError(f"{path}: missing column(s) {', '.join(missing)} for a fixed-budget "
                            f"table (needs {', '.join(FIXED_REQUIRED)})")
    missing = [c for c in STEPS_REQUIRED if c not in present]
    raise AnalysisError(f"{path}: missing column(s) {', '.join(missing)}; a fixed-budget table "
                        f"needs {', '.join(FIXED_REQUIRED)}, a steps-to-target table "
                        f"{', '.join(STEPS_REQUIRED)} (optional D, target, learning_rate)")
