"""`gnsweep recommend`: an analysed sweep folder (or `analyze --table` output) in, the batch size
and learning rate to train with out (`analysis.decision`). Runs `gnsweep analyze` first where
the folder has not been analysed; writes nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gnsweep import store
from gnsweep.analysis.decision import PREFERENCES, Recommendation, recommend
from gnsweep.analysis.results import Results
from gnsweep.commands import Echo
from gnsweep.errors import ConfigError
from gnsweep.sweep_analysis import analysed_results, setting_of


def make(sweep_dir: Path, *, target: float | None = None, prefer: str = "balanced",
         notes: list[str] | None = None) -> tuple[Recommendation, Results]:
    """The recommendation for a folder (module doc); ConfigError for a bad --prefer or a
    --target that was not analysed."""
    if prefer not in PREFERENCES:
        raise ConfigError(f"--prefer: {prefer!r} is not one of {', '.join(PREFERENCES)}")
    results = analysed_results(sweep_dir, notes)
    if len(results.along):
        raise ConfigError(f"{sweep_dir}: a branch sweep; its answer is per branch point: "
                          f"gnsweep analyze {sweep_dir} (along.parquet)")
    try:
        return recommend(results, prefer, target, setting_of(sweep_dir, results)), results
    except KeyError as err:
        raise ConfigError(str(err.args[0]).replace("DIR", str(sweep_dir))) from None


def run(sweep_dir: Path, *, target: float | None, prefer: str, as_json: bool,
        echo: Echo) -> int:
    """`gnsweep recommend`: the recommendation as text (or JSON with --json); exit code 0
    whatever its status (a script reads `status`), 2 for bad input."""
    from gnsweep.answer_record import remember
    from gnsweep.report.recommendation import lines
    from gnsweep.report.views import quantity

    notes: list[str] = []
    rec, results = make(sweep_dir, target=target, prefer=prefer, notes=notes)
    data = rec.to_json()
    for note in notes:
        echo(note, err=as_json)
    if store.is_sweep(sweep_dir):  # recorded with its runs; a changed answer says why
        key = "recommend" + (f" --prefer {prefer}" if prefer != "balanced" else "") + (
            f" --target {target:g}" if target is not None else "")
        for line in remember(sweep_dir, key, data, results.meta, results.fits):
            echo(line, err=as_json)
    if as_json:
        echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        for line in lines(data, quantity(results.meta)):
            echo(line)
        if rec.status == "bound" and rec.next_grid is not None and rec.next_grid.runs \
                and store.is_sweep(sweep_dir):
            echo(f"to run exactly those {len(rec.next_grid.runs)} runs: gnsweep plan {sweep_dir}")
    return 0


def command(
    sweep_dir: Annotated[Path, typer.Argument(
        help="A sweep folder (analysed now if it was not) or `analyze --table`'s --out folder.")],
    target: Annotated[float | None, typer.Option(
        "--target", help="The target to recommend for (default: the hardest whose B_crit is "
                         "well determined).")] = None,
    prefer: Annotated[str, typer.Option(
        "--prefer", help="time (4 B_crit: 1.25 S_min, 5 E_min), balanced (B_crit: 2 S_min, "
                         "2 E_min) or compute (B_crit/4: 5 S_min, 1.25 E_min); eq. 2.11.")
    ] = "balanced",
    as_json: Annotated[bool, typer.Option("--json", help="Print the recommendation as JSON.")
                       ] = False,
) -> None:
    """The batch size and learning rate to train with, what they cost in steps and examples
    (eq. 2.11), the tradeoff from B_crit/4 to 4 B_crit, and the next grid when the sweep only
    bounds the answer.

    JSON fields: batch_size (the task's unit), batch_size_samples, learning_rate,
    learning_rate_low, learning_rate_high, steps, examples, target, status (fit, bound or
    refused), next_grid (a bound: the runs to add; `gnsweep plan DIR` runs them).
    Example: gnsweep recommend runs/digits --prefer time --json
    """
    code = run(sweep_dir, target=target, prefer=prefer, as_json=as_json, echo=typer.echo)
    if code:
        raise typer.Exit(code)
