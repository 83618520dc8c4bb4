"""`gnsweep laws`: read a family of fixed-budget sweeps (or a table made elsewhere), fit the
laws across scale (`gnsweep.analysis.laws`), write them, print them (`gnsweep.report.laws_text`).

    <out>/laws.parquet        one row per law (tables.LAWS_SCHEMAS["laws"])
    <out>/law_cells.parquet   one row per (N, D) cell
    <out>/laws.json           the laws, cells, held-out check and prediction (docs/laws.md)
    <out>/laws_*.png, .pdf    each law with its band and points; each cell's loss landscape
    <out>/laws.html           the report: laws, held-out check, prediction, figures embedded
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer

from gnsweep import store
from gnsweep.analysis.laws.cells import CellRefused
from gnsweep.analysis.laws.export import laws_frame, laws_json
from gnsweep.analysis.laws.family import (
    DEFAULT_BOOTSTRAP,
    DEFAULT_TOLERANCE,
    FIXED_BUDGET,
    Laws,
    fixed_budget_laws,
    parse_point,
    predict,
    steps_laws,
)
from gnsweep.analysis.pipeline import AnalysisError
from gnsweep.commands import Echo
from gnsweep.errors import ConfigError
from gnsweep.paths import SCALE, OutPaths, SweepPaths
from gnsweep.tables import LAWS_SCHEMAS

FORMATS = ("png", "pdf")


def sweep_runs(sweep_dir: Path) -> pd.DataFrame:
    """One fixed-budget sweep folder as rows N, D, batch_size, learning_rate, loss: N from
    the scale recorded at launch (scale.json), D from sweep.max_examples."""
    from gnsweep.analysis.laws.sweeps import final_losses
    from gnsweep.folder import SweepFolder

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ConfigError(f"{sweep_dir}: no such folder; give sweep folders written by "
                          "`gnsweep launch`, or --table FILE")
    folder = SweepFolder.open(sweep_dir)  # config.yaml parsed and run files checked, once
    config = folder.config
    scale = read_scale(sweep_dir)
    runs, metrics = folder.tables()
    # The runs table has B in the task's unit already, as D is (tokens for a language model:
    # samples x tokens a sample; its `samples` column keeps the samples).
    rows = final_losses(str(sweep_dir), runs, metrics, float(config.sweep.max_examples))
    return rows.assign(N=float(scale["N"]), D=float(config.sweep.max_examples),
                       per_sample=scale["per_sample"], sweep=sweep_dir.name)


def read_scale(sweep_dir: Path) -> dict[str, float]:
    """The model size a launch recorded (paths.SCALE) and the task's examples a sample, as
    {"N": ..., "per_sample": ...}; one line when absent."""
    path = SweepPaths(sweep_dir).scale
    if not path.is_file():
        raise AnalysisError(f"{sweep_dir}: no {SCALE} (the model size counted at launch): "
                            "relaunch the sweep with this gnsweep (finished runs are kept), or "
                            "give sweep.scale.params=<parameters> at launch")
    data = store.read_json(path)
    value = data.get("params") if isinstance(data, dict) else None
    if value == 0:
        raise AnalysisError(f"{sweep_dir}: the model's size was not counted at launch (its task "
                            "builds no model gnsweep can count); relaunch it with "
                            "sweep.scale.params=<parameters>")
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise AnalysisError(f"{path}: 'params' must be a positive number")
    per_sample = data.get("per_sample", 1.0)
    if not isinstance(per_sample, (int, float)) or not per_sample > 0:
        raise AnalysisError(f"{path}: 'per_sample' must be a positive number")
    return {"N": float(value), "per_sample": float(per_sample)}


def fit(sweep_dirs: list[Path], table: Path | None, *, tolerance: float, bootstrap: int,
        point: str | None) -> tuple[Laws, pd.DataFrame]:
    """Read every input (all of it first: a bad folder stops before anything is written), fit
    the laws, predict at `point`. Returns the laws and the runs they were fitted on."""
    from gnsweep.analysis.laws.inputs import family_table

    if table is not None and sweep_dirs:
        raise ConfigError("give sweep folders or --table FILE, not both")
    if table is None and not sweep_dirs:
        raise ConfigError("give fixed-budget sweep folders (one per model size and budget) or "
                          "--table FILE")
    if not (0 < tolerance < 1):
        raise ConfigError(f"--tolerance {tolerance:g}: give a relative loss tolerance in (0, 1), "
                          "e.g. 0.01")
    where = parse_point(point) if point else None
    if table is not None:
        kind, runs = family_table(Path(table))
    else:
        seen: set[Path] = set()
        for path in sweep_dirs:
            if Path(path).resolve() in seen:
                raise ConfigError(f"{path}: given twice")
            seen.add(Path(path).resolve())
        kind, runs = FIXED_BUDGET, pd.concat([sweep_runs(Path(p)) for p in sweep_dirs],
                                             ignore_index=True)
    try:
        result = (fixed_budget_laws(runs, tolerance=tolerance, bootstrap=bootstrap)
                  if kind == FIXED_BUDGET else steps_laws(runs, bootstrap=bootstrap))
    except CellRefused as err:
        raise AnalysisError(f"{table or 'the sweeps'}: {err}") from None
    if where is not None:
        result.prediction = predict(result, where[0], where[1], runs["N"].to_numpy(float),
                                    runs["D"].to_numpy(float), flops_per_token=where[2])
        per_sample = runs["per_sample"].unique() if "per_sample" in runs else []
        if len(per_sample) == 1 and result.prediction.get("batch_size") is not None:
            # B also in samples (sequences for a language model), as a launch takes it.
            result.prediction["batch_size_samples"] = (result.prediction["batch_size"]
                                                       / float(per_sample[0]))
    return result, runs


def write(result: Laws, runs: pd.DataFrame, out_dir: Path,
          formats: tuple[str, ...] = FORMATS) -> tuple[list[Path], dict[str, str]]:
    """laws.parquet, law_cells.parquet, laws.json and the figures; (paths, skipped figures)."""
    from gnsweep.figure_files import save
    from gnsweep.report.laws_figures import draw_all
    from gnsweep.report.laws_html import render_laws

    out_dir = Path(out_dir)
    out = OutPaths(out_dir)
    store.write_frame(out.laws, laws_frame(result), schema=LAWS_SCHEMAS["laws"])
    store.write_frame(out.law_cells, result.cells, schema=LAWS_SCHEMAS["law_cells"])
    store.write_json(out.laws_json, laws_json(result))
    paths = [out.laws, out.law_cells, out.laws_json]
    skipped: dict[str, str] = {}
    embedded: dict[str, bytes | str] = {}
    for name, figure in draw_all(result, runs).items():
        if isinstance(figure, str):
            skipped[name] = embedded[name] = figure
        else:
            saved = save(figure, name, out_dir, formats)
            paths += saved
            embedded[name] = saved[0].read_bytes() if saved[0].suffix == ".png" else ""
    store.write_text(out.laws_html, render_laws(laws_json(result), embedded))
    paths.append(out.laws_html)
    return paths, skipped


def run(sweep_dirs: list[Path], *, table: Path | None, out: Path, point: str | None,
        tolerance: float = DEFAULT_TOLERANCE, bootstrap: int = DEFAULT_BOOTSTRAP,
        as_json: bool = False, svg: bool = False, echo: Echo) -> None:
    """`gnsweep laws DIR... --out OUT`: the summary (stderr with --json, which prints
    laws.json on stdout), then the files written."""
    import json

    from gnsweep.report.laws_text import format_laws

    result, runs = fit(sweep_dirs, table, tolerance=tolerance, bootstrap=bootstrap,
                       point=point)
    paths, skipped = write(result, runs, out, formats=("png", "svg" if svg else "pdf"))
    for sweep_dir in sweep_dirs:  # each cell's own report shows the family's laws
        store.write_json(SweepPaths(Path(sweep_dir)).laws_family,
                         {"laws": str(Path(out).resolve())})
    data = laws_json(result)
    echo(format_laws(data), err=as_json)
    if as_json:
        echo(json.dumps(data, indent=2))
    for name, reason in skipped.items():
        echo(f"skipped {name}: {reason}", err=True)
    for path in paths:
        echo(str(path), err=as_json)


def command(
    out: Annotated[Path, typer.Option("--out", help="Folder for laws.json and the rest.")],
    sweep_dirs: Annotated[list[Path] | None, typer.Argument(
        help="Fixed-budget sweep folders, one per model size N and budget D.")] = None,
    table: Annotated[Path | None, typer.Option("--table", help="CSV or parquet made elsewhere: "
        "N, D, batch_size, learning_rate, loss; or N, batch_size, steps.")] = None,
    predict: Annotated[str | None, typer.Option(help="A new scale: N=7e9,D=1.4e12 (and "
        "M=<FLOPs a token> for DeepSeek's law).")] = None,
    tolerance: Annotated[float, typer.Option(help="Near-optimal: within this relative loss "
                                             "(Step Law's 0.25%).")] = 0.0025,
    bootstrap: Annotated[int, typer.Option(min=0, help="Draws for 95% intervals.")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="laws.json on stdout.")] = False,
) -> None:
    """Batch size and learning rate laws across model size N and data D (docs/laws.md): each
    cell's optimum, power laws c * N^a * D^b with 95% intervals, the largest cell held out.

    Example: gnsweep laws runs/d1k runs/d2k runs/d4k runs/d8k --out runs/laws --predict N=17,D=65536
    """
    run(list(sweep_dirs or []), table=table, out=out, point=predict, tolerance=tolerance,
        bootstrap=bootstrap, as_json=as_json, echo=typer.echo)
