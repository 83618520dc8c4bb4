"""Multi-workload tables: one analysis per group (a workload, a model size...), put back
together with the group column in front of every table, and taken apart again for the
printed table, the figures, the report and the baseline check.

The group column's name travels in `Results.meta["group_by"]` (fits.json). Pure: no files.
"""

from __future__ import annotations

import pandas as pd

from gnsweep.analysis.results import Results


def group_of(results: Results) -> str | None:
    """The column the results are grouped by (None: one analysis)."""
    column = results.meta.get("group_by")
    return str(column) if column else None


def combine(parts: dict[str, Results], column: str) -> Results:
    """One Results from one per group: every table with `column` first, warnings prefixed
    with their group."""
    def stacked(name: str) -> pd.DataFrame:
        frames = []
        for value, part in parts.items():
            frame = getattr(part, name).copy()
            frame.insert(0, column, value)
            frames.append(frame)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    first = next(iter(parts.values()))
    meta = {**first.meta, "group_by": column, "groups": list(parts),
            "n_runs": sum(int(p.meta.get("n_runs", 0)) for p in parts.values())}
    warnings = [f"{column} {value}: {w}" for value, part in parts.items() for w in part.warnings]
    return Results(stacked("steps"), stacked("front"), stacked("fits"), warnings=warnings,
                   lr_fits=stacked("lr_fits"), loss_scaling=stacked("loss_scaling"), meta=meta,
                   temperature=stacked("temperature"))


def split(results: Results) -> dict[str, Results]:
    """The results of each group, as if analyzed alone ({"": results} when not grouped)."""
    column = group_of(results)
    if column is None or column not in results.fits:
        return {"": results}
    values = [str(v) for v in pd.unique(results.fits[column].astype(str))]
    out = {}
    for value in values:
        def part(frame: pd.DataFrame, value: str = value) -> pd.DataFrame:
            if column not in frame:
                return frame
            rows = frame[frame[column].astype(str) == value]
            return rows.drop(columns=[column]).reset_index(drop=True)

        prefix = f"{column} {value}: "
        out[value] = Results(
            part(results.steps), part(results.front), part(results.fits),
            warnings=[w.removeprefix(prefix) for w in results.warnings if w.startswith(prefix)],
            lr_fits=part(results.lr_fits), loss_scaling=part(results.loss_scaling),
            temperature=part(results.temperature),
            meta={**results.meta, "group": value}, runs=part(results.runs),
            metrics=part(results.metrics))
    return out
