"""`gnsweep analyze`: a sweep folder (or a table of measurements) in, its results out.
`analyze_sweep` reads the runs and the sweep's config, runs the pure pipeline
(`gnsweep.analysis.pipeline`) and writes the tables through the store. Nothing is written until
the whole analysis has succeeded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gnsweep.analysis.decision import floor_warnings, recommend
from gnsweep.analysis.setting import Setting
from gnsweep.commands import Echo
from gnsweep.status_rows import sweep_measurement_note
from gnsweep.sweep_analysis import analyze_sweep, write_outputs
from gnsweep.targets import AUTO

if TYPE_CHECKING:
    pass


def parse_targets(text: str | None) -> list[float] | str | None:
    """`--targets 0.5,0.2` (or `[0.5, 0.2]`) as numbers, `auto` as AUTO; ConfigError for
    anything else."""
    from gnsweep.config import ConfigError

    if not text:
        return None
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        values = [float(part) for part in text.replace(" ", "").strip("[]").split(",") if part]
    except ValueError:
        raise ConfigError(f"--targets: {text!r} is not a comma-separated list of numbers"
                          ) from None
    if not values or any(not (v > 0 and v < float("inf")) for v in values):
        raise ConfigError(f"--targets: {text!r}: give positive finite losses, e.g. 0.5,0.2, "
                          "or auto")
    return values


def run(sweep_dir: Path | None, *, table: Path | None, out: Path | None, targets: str | None,
        loss: str | None, ema_examples: float | None, bootstrap: int | None, optimizer: str,
        group_by: str | None, as_json: bool, skip_corrupt: bool, echo: Echo) -> None:
    """`gnsweep analyze`: check the options, analyze a sweep folder or a --table file, write the
    tables, print the fits (on stderr with --json, which prints fits.json's content instead)."""
    import json

    from gnsweep.analysis.external import analyze_table
    from gnsweep.config import LOSS_KINDS, OPTIMIZERS, ConfigError
    from gnsweep.report.console import format_fits

    if (sweep_dir is None) == (table is None):
        raise ConfigError("give a sweep folder or --table FILE (one of them)")
    if loss is not None and loss not in LOSS_KINDS:
        raise ConfigError(f"--loss: {loss!r} is not one of {', '.join(LOSS_KINDS)}")
    if ema_examples is not None and (loss or "smoothed") != "smoothed":
        raise ConfigError("--ema-examples re-smooths the training loss; it needs --loss smoothed")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    target_list = parse_targets(targets)
    if group_by is not None and table is None:
        raise ConfigError("--group-by groups the rows of a --table FILE; a sweep folder is one "
                          "workload")
    if table is not None:
        if out is None:
            raise ConfigError("--table needs --out DIR for the tables")
        result = analyze_table(table, target_list, loss=loss or "smoothed",
                               ema_examples=ema_examples, bootstrap=bootstrap or 0,
                               optimizer=optimizer, group_by=group_by)
        if group_by is None:  # one workload: one decision
            result.warnings = floor_warnings(result, Setting.from_meta(result.meta))
            result.recommendation = recommend(result).to_json()
        write_outputs(out, result)
    else:
        assert sweep_dir is not None
        result = analyze_sweep(sweep_dir, loss=loss, skip_corrupt=skip_corrupt,
                               ema_examples=ema_examples, bootstrap=bootstrap,
                               targets=target_list, out_dir=out)
        out = out or sweep_dir
    if result.meta.get("targets_held"):
        echo(str(result.meta["targets_held"]), err=as_json)
    if sweep_dir is not None and out is sweep_dir and result.recommendation is not None:
        from gnsweep.answer_record import remember

        for line in remember(sweep_dir, "analyze", result.recommendation, result.meta,
                             result.fits):
            echo(line, err=as_json)
    if result.recommendation is not None:  # the decision first, then what it rests on
        from gnsweep.report.recommendation import lines
        from gnsweep.report.views import quantity

        for line in lines(result.recommendation, quantity(result.meta)):
            echo(line, err=as_json)
    echo(format_fits(result.fits, result.loss_scaling, result.meta.get("group_by"), result.front),
         err=as_json)
    if len(result.along_schedule):  # runs following a measured B_crit (sweep.schedule=along)
        from gnsweep.report.console import format_schedule

        echo(format_schedule(result.along_schedule), err=as_json)
    if len(result.along):  # a branch sweep (`gnsweep branch`): the local B_crit per point
        from gnsweep.report.console import format_along

        echo(format_along(result.along, result.meta.get("unit", "examples")), err=as_json)
    if len(result.adaptive):
        from gnsweep.report.console import format_adaptive

        echo(format_adaptive(result.adaptive), err=as_json)
    if sweep_dir is not None:  # what share of the steps the noise scale was measured on
        note = sweep_measurement_note(sweep_dir)
        if note:
            echo(note, err=as_json)
    for warning in result.warnings:
        echo(f"warning: {warning}", err=True)
    echo(f"tables: {out}/steps.parquet, front.parquet, fits.parquet, lr_fits.parquet, "
         "loss_scaling.parquet, temperature.parquet, fits.json"
         + (", along.parquet" if len(result.along) else ""),
         err=as_json)
    if as_json:
        echo(json.dumps(result.to_json(), indent=2, sort_keys=True))


def command(
    sweep_dir: Annotated[Path | None, typer.Argument(
        help="A sweep folder written by `gnsweep launch` (or use --table).")] = None,
    table: Annotated[Path | None, typer.Option(
        "--table", help="CSV or parquet of measurements made elsewhere: steps-to-target rows "
                        "or loss curves (docs/analysis.md).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Folder for the tables (default: the sweep folder; required with "
                      "--table).")] = None,
    targets: Annotated[str | None, typer.Option(
        "--targets", help="Comma-separated loss targets, or auto: levels chosen from the "
                          "runs (default: the sweep's; required for loss curves).")] = None,
    loss: Annotated[str | None, typer.Option(
        help="Loss deciding a target: smoothed, raw or eval (default: the sweep's "
             "analysis.loss, else smoothed).")] = None,
    ema_examples: Annotated[float | None, typer.Option(
        "--ema-examples", min=1e-9, help="Re-smooth the raw loss with an EMA of this many "
                                         "examples (default: the logged smoothed loss).")] = None,
    bootstrap: Annotated[int | None, typer.Option(
        "--bootstrap", min=0, help="Bootstrap resamples for 95% intervals (default: the "
                                   "sweep's analysis.bootstrap, else 0).")] = None,
    optimizer: Annotated[str, typer.Option(
        help="For --table: sgd, momentum, adam or adamw (picks the eps_opt(B) model).")] = "sgd",
    group_by: Annotated[str | None, typer.Option(
        "--group-by", help="For --table: a column naming the workload; one fit per value, "
                           "that column in every output table (a target column is then "
                           "optional).")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print fits.json's content on stdout; the table goes to stderr.")] = False,
    skip_corrupt: Annotated[bool, typer.Option(
        "--skip-corrupt", help="Leave out runs whose metrics file is unreadable.")] = False,
) -> None:
    """Steps-to-target, best learning rates, Pareto fronts, the fit of eq. 2.11, B_crit against
    B_simple, eps_opt(B) and B_crit(L).

    Writes steps, front, fits, lr_fits and loss_scaling (.parquet) and fits.json.
    Examples: gnsweep analyze runs/digits --bootstrap 1000;
    gnsweep analyze --table docs/examples/steps.csv --out /tmp/ext
    """
    run(sweep_dir, table=table, out=out, targets=targets, loss=loss, ema_examples=ema_examples,
        bootstrap=bootstrap, optimizer=optimizer, group_by=group_by, as_json=as_json,
        skip_corrupt=skip_corrupt, echo=typer.echo)
