"""Measurements made elsewhere: a CSV or parquet table in, the same analysis out.

Two shapes (docs/analysis.md): steps-to-target rows (`batch_size, target, steps`, optional
`learning_rate, seed, b_simple, b_simple_mean, b_noise, run_id`) or loss curves (`run_id,
batch_size, learning_rate, step, loss`, optional `loss_smooth, eval_loss, b_simple, b_noise,
seed`). Every problem is an AnalysisError naming the file and the column.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from gnsweep.analysis.groups import combine
from gnsweep.analysis.pipeline import AnalysisError, analyze_steps, analyze_tables
from gnsweep.analysis.results import Results
from gnsweep.analysis.steps import STEPS_COLUMNS, curves_from_frames
from gnsweep.errors import shown as show_value
from gnsweep.tables import BEST_VALUE

STEPS_REQUIRED = ("batch_size", "target", "steps")
CURVES_REQUIRED = ("run_id", "batch_size", "learning_rate", "step", "loss")


def read_table_file(path: Path) -> pd.DataFrame:
    """A CSV or parquet file as a DataFrame; unreadable files raise AnalysisError naming them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    suffix = path.suffix.lower()
    if not path.is_file():
        raise AnalysisError(f"{path}: no such file")
    try:
        if suffix in (".parquet", ".pq"):
            return pq.read_table(path).to_pandas()
        if suffix in (".csv", ".txt"):
            return pd.read_csv(path, skipinitialspace=True)
        if suffix == ".tsv":
            return pd.read_csv(path, sep="\t")
    except (pa.ArrowException, OSError, pd.errors.ParserError, pd.errors.EmptyDataError,
            UnicodeDecodeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AnalysisError(f"{path}: unreadable {suffix.lstrip('.')} file ({first})") from None
    raise AnalysisError(f"{path}: unknown table format {suffix or '(no suffix)'}; "
                        "give a .csv or .parquet file")


def table_shape(path: Path, frame: pd.DataFrame) -> str:
    """'curves' or 'steps', from the columns present."""
    columns = {str(c).strip() for c in frame.columns}
    if set(CURVES_REQUIRED) <= columns:
        return "curves"
    if set(STEPS_REQUIRED) <= columns:
        return "steps"
    if {"step", "loss"} & columns:
        missing = [c for c in CURVES_REQUIRED if c not in columns]
        raise AnalysisError(f"{path}: missing column(s) {', '.join(missing)} for a loss-curve "
                            f"table (needs {', '.join(CURVES_REQUIRED)})")
    missing = [c for c in STEPS_REQUIRED if c not in columns]
    raise AnalysisError(f"{path}: missing column(s) {', '.join(missing)}; a steps table needs "
                        f"{', '.join(STEPS_REQUIRED)}, a loss-curve table "
                        f"{', '.join(CURVES_REQUIRED)}")


def _numeric(path: Path, frame: pd.DataFrame, column: str, *, positive: bool = False,
             nonnegative: bool = False, finite: bool = True, integer: bool = False) -> np.ndarray:
    raw = frame[column]
    values = pd.to_numeric(raw, errors="coerce").to_numpy(float)
    bad_text = np.isnan(values) & raw.notna().to_numpy()
    checks = [(bad_text, "is not a number")]
    if finite:
        checks.append((~np.isfinite(values), "is missing or not finite"))
    with np.errstate(invalid="ignore"):
        if positive:
            checks.append((values <= 0, "must be > 0"))
        if nonnegative:
            checks.append((values < 0, "must be >= 0"))
        if integer:
            checks.append((np.isfinite(values) & (values != np.round(values)),
                           "must be a whole number"))
    for mask, why in checks:
        rows = np.flatnonzero(mask)
        if len(rows):
            # Row numbers as a spreadsheet shows them: the header is row 1.
            shown = ", ".join(str(_row_number(frame, r)) for r in rows[:5]) + (
                " ..." if len(rows) > 5 else "")
            raise AnalysisError(f"{path}: column {column!r}: {show_value(raw.iloc[rows[0]])} {why} "
                                f"(row(s) {shown})")
    return values


def _row_number(frame: pd.DataFrame, position: int) -> int:
    """The row as a spreadsheet shows it (the header is row 1), also within one group."""
    label = frame.index[position]
    return int(label) + 2 if isinstance(label, (int, np.integer)) else position + 2


def steps_from_table(path: Path, frame: pd.DataFrame) -> pd.DataFrame:
    """A steps-to-target table as steps.parquet rows: every row reached its target."""
    n = len(frame)
    batch = _numeric(path, frame, "batch_size", positive=True, integer=True)
    target = _numeric(path, frame, "target", positive=True)
    steps = _numeric(path, frame, "steps", positive=True)
    lr = (_numeric(path, frame, "learning_rate", positive=True) if "learning_rate" in frame
          else np.full(n, np.nan))
    seed = (_numeric(path, frame, "seed", integer=True).astype(int) if "seed" in frame
            else np.zeros(n, int))
    optional = {name: (_numeric(path, frame, name, finite=False) if name in frame
                       else np.full(n, np.nan))
                for name in ("b_simple", "b_simple_mean", "b_noise", "b_noise_mean")}
    run_id = (frame["run_id"].astype(str).to_numpy() if "run_id" in frame
              else np.array([f"row{_row_number(frame, i)}" for i in range(n)]))
    out = pd.DataFrame({
        "run_id": run_id, "batch_size": batch.astype(int), "learning_rate": lr, "seed": seed,
        "target": target, "state": "done", "reached": True, "steps": steps,
        "examples": steps * batch, "b_simple_at_target": optional["b_simple"],
        "b_simple_mean": optional["b_simple_mean"], "outcome": "reached",
        "b_noise_at_target": optional["b_noise"], "b_noise_mean": optional["b_noise_mean"],
        BEST_VALUE: np.nan, "last_step": np.nan, "b_simple_true_mean": np.nan,
        "b_noise_true_mean": np.nan, "drift_share": np.nan,
        "b_simple_precond_at_target": np.nan, "b_simple_precond_mean": np.nan, "lr_share": np.nan})
    return out[STEPS_COLUMNS]


def curves_from_table(path: Path, frame: pd.DataFrame, loss: str):
    """(runs, metrics) frames from a loss-curve table."""
    metrics = pd.DataFrame({"run_id": frame["run_id"].astype(str)})
    metrics["batch_size"] = _numeric(path, frame, "batch_size", positive=True, integer=True)
    metrics["learning_rate"] = _numeric(path, frame, "learning_rate", positive=True)
    metrics["step"] = _numeric(path, frame, "step", nonnegative=True)
    metrics["loss"] = _numeric(path, frame, "loss", finite=False)
    metrics["seed"] = (_numeric(path, frame, "seed", integer=True) if "seed" in frame else 0)
    for name in ("loss_smooth", "eval_loss", "b_simple", "b_noise"):
        metrics[name] = (_numeric(path, frame, name, finite=False) if name in frame else np.nan)
    if loss == "eval" and not np.isfinite(metrics["eval_loss"]).any():
        raise AnalysisError(f"{path}: --loss eval needs an 'eval_loss' column with values")
    per_run = metrics.groupby("run_id", sort=True)
    for name in ("batch_size", "learning_rate", "seed"):
        varying = per_run[name].nunique()
        if (varying > 1).any():
            raise AnalysisError(f"{path}: column {name!r} changes within run "
                                f"{varying[varying > 1].index[0]!r}; one value per run_id")
    duplicated = metrics.duplicated(["run_id", "step"])
    if duplicated.any():
        row = metrics[duplicated].iloc[0]
        raise AnalysisError(f"{path}: run {row['run_id']!r} logs step {row['step']:g} twice")
    runs = per_run[["batch_size", "learning_rate", "seed"]].first().reset_index()
    runs["batch_size"] = runs["batch_size"].astype(int)
    runs["seed"] = runs["seed"].astype(int)
    # A loss that became NaN or infinite means the run diverged.
    blew_up = per_run["loss"].apply(lambda s: bool((~np.isfinite(s)).any()))
    runs["state"] = np.where(runs["run_id"].map(blew_up), "diverged", "done")
    return runs, metrics


def analyze_table(path: Path, targets: list[float] | str | None = None, loss: str = "smoothed",
                  ema_examples: float | None = None, bootstrap: int = 0,
                  optimizer: str = "sgd", group_by: str | None = None) -> Results:
    """Analyze a table of external measurements; writes nothing.

    `group_by` names a column (workload, model...): one analysis per value, put back together
    with that column in front of every table (`gnsweep.analysis.groups`). A grouped steps table
    may leave out `target`: each group's steps are then to its own quality target, numbered 1.
    """
    frame = read_table_file(path)
    frame.columns = [str(c).strip() for c in frame.columns]
    if frame.empty:
        raise AnalysisError(f"{path}: the table has no rows")
    options = dict(targets=targets, loss=loss, ema_examples=ema_examples, bootstrap=bootstrap,
                   optimizer=optimizer)
    if group_by is None:
        return _analyze_frame(path, frame, **options)  # type: ignore[arg-type]
    if group_by not in frame:
        raise AnalysisError(f"{path}: --group-by {group_by}: no such column (columns: "
                            f"{', '.join(frame.columns)})")
    if group_by in (*CURVES_REQUIRED, *STEPS_REQUIRED, "learning_rate", "seed"):
        raise AnalysisError(f"{path}: --group-by {group_by}: that column is a measurement; "
                            "group by a column naming the workload")
    empty = np.flatnonzero(frame[group_by].isna().to_numpy())
    if len(empty):
        raise AnalysisError(f"{path}: column {group_by!r} is empty in row(s) "
                            f"{', '.join(str(r + 2) for r in empty[:5])}")
    if "target" not in frame and not {"step", "loss"} & set(frame.columns):
        frame = frame.assign(target=1.0)  # one quality target per workload (MLPerf style)
    labels = frame[group_by].astype(str)
    parts = {}
    for value in pd.unique(labels):
        rows = frame[labels == value].drop(columns=[group_by])
        try:
            parts[str(value)] = _analyze_frame(path, rows, **options)  # type: ignore[arg-type]
        except AnalysisError as err:
            raise AnalysisError(f"{group_by} {value}: {err}") from None
    return combine(parts, group_by)


def _analyze_frame(path: Path, frame: pd.DataFrame, targets: list[float] | str | None, loss: str,
                   ema_examples: float | None, bootstrap: int, optimizer: str) -> Results:
    shape = table_shape(path, frame)
    if shape == "steps":
        steps = steps_from_table(path, frame)
        present = sorted(set(steps["target"]), reverse=True)
        if isinstance(targets, str):  # auto: a steps table's targets are its rows'
            targets = None
        if targets:
            for target in targets:
                if not np.isclose(present, target).any():
                    raise AnalysisError(f"{path}: target {target:g}: no row has it (targets in "
                                        f"the table: {', '.join(f'{t:g}' for t in present)})")
            keep = np.isclose(steps["target"].to_numpy()[:, None], targets).any(axis=1)
            steps = steps[keep]
        meta = {"source": str(path), "loss": "table", "ema_examples": None}
        return analyze_steps(steps, targets or present, bootstrap=bootstrap,
                             optimizer=optimizer, meta=meta)
    if not targets:
        raise AnalysisError(f"{path}: a loss-curve table needs --targets (e.g. --targets 2.5,2.0, "
                            "or --targets auto: levels chosen from the curves)")
    runs, metrics = curves_from_table(path, frame, loss)
    # The default smoothed loss is the centred, lag-free smooth of `loss` (analysis.steps);
    # a table with only `loss_smooth` uses that column, --ema-examples the former causal EMA.
    curves = curves_from_frames(runs, metrics)
    return analyze_tables(None, curves, targets, loss=loss, ema_examples=ema_examples,
                          bootstrap=bootstrap, optimizer=optimizer, source=str(path))
