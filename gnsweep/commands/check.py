"""`gnsweep baseline` and `gnsweep check`: a sweep's fits recorded, then compared with that
record (`gnsweep.analysis.baseline`: the tolerances, JUnit XML)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gnsweep import store
from gnsweep.commands import Echo
from gnsweep.paths import SweepPaths


def fits_of(folder: Path, echo: Echo) -> tuple[Any, str | None]:
    """Fresh fits of a sweep folder (analyzed now, nothing written), or a folder's fits.parquet;
    with the column the fits are grouped by (`analyze --group-by`), else None."""
    from gnsweep.analysis.groups import group_of
    from gnsweep.folder import read_results
    from gnsweep.sweep_analysis import analyze_sweep

    if store.is_sweep(folder):
        analysis = analyze_sweep(folder, write=False)
        for warning in analysis.warnings:
            if "left out" in warning:  # runs missing from these fits: never in silence
                echo(f"warning: {warning}", err=True)
        return analysis.fits, None
    if SweepPaths(folder).result("fits").is_file():
        results = read_results(folder)
        return results.fits, group_of(results)
    store.require_sweep(folder)  # raises with the usual message
    return None, None


def baseline(folder: Path, output: Path, *, rtol: float, k_se: float, echo: Echo) -> None:
    """`gnsweep baseline`: write the fits (B_crit, S_min, E_min per target) as a baseline."""
    from gnsweep.analysis.baseline import make_baseline

    fits, group_by = fits_of(folder, echo)
    record = make_baseline(fits, rtol=rtol, k_se=k_se, source=folder.name, group_by=group_by)
    store.write_json(output, record)
    fitted = sum(1 for t in record["targets"] if t["b_crit"] is not None)
    echo(f"baseline {output}: {fitted} of {len(record['targets'])} target(s) with a fit")


def check(folder: Path, baseline_file: Path, *, rtol: float | None, k_se: float | None,
          junit: Path | None, echo: Echo) -> int:
    """`gnsweep check`: one line a (target, figure); returns 1 when one moved too far, else 0."""
    from gnsweep.analysis.baseline import BaselineError, compare, junit_xml

    record = store.read_json(baseline_file)
    fits, _ = fits_of(folder, echo)
    try:
        cases = compare(record, fits, rtol=rtol, k_se=k_se)
    except BaselineError as err:
        raise store.StoreError(f"{baseline_file}: {err}") from None
    for case in cases:
        mark = "ok  " if case.ok else "FAIL"
        where = f"{case.group} " if case.group else ""
        echo(f"{mark} {where}target {case.target:<8g} {case.figure:<7} {case.message}")
    if junit is not None:
        store.write_text(junit, junit_xml(cases))
    failed = [c for c in cases if not c.ok]
    if failed:
        echo(f"gnsweep check: {len(failed)} of {len(cases)} figure(s) regressed "
             f"against {baseline_file}", err=True)
        return 1
    echo(f"gnsweep check: all {len(cases)} figure(s) within tolerance of {baseline_file}")
    return 0


def baseline_command(
    folder: Annotated[Path, typer.Argument(
        help="A sweep folder (analyzed now) or a folder holding fits.parquet.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Baseline JSON to write.")],
    rtol: Annotated[float, typer.Option(
        min=0.0, help="Relative change `gnsweep check` allows.")] = 0.05,
    k_se: Annotated[float, typer.Option(
        "--k-se", min=0.0, help="Or this many combined standard errors (0: off).")] = 0.0,
) -> None:
    """Record the fits (B_crit, S_min, E_min per target) for `gnsweep check`.

    Example: gnsweep baseline runs/tiny -o tests/baseline/tiny.json
    """
    baseline(folder, output, rtol=rtol, k_se=k_se, echo=typer.echo)


def check_command(
    folder: Annotated[Path, typer.Argument(
        help="A sweep folder (analyzed now) or a folder holding fits.parquet.")],
    baseline_file: Annotated[Path, typer.Option("--baseline", help="From `gnsweep baseline`.")],
    rtol: Annotated[float | None, typer.Option(
        min=0.0, help="Allowed relative change (default: the baseline's).")] = None,
    k_se: Annotated[float | None, typer.Option(
        "--k-se", min=0.0, help="Or this many combined standard errors (default: the "
                                "baseline's).")] = None,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write JUnit XML here.")] = None,
) -> None:
    """Compare fresh fits with a baseline; exit 1 when B_crit, S_min or E_min moved too far.

    Example: gnsweep check runs/tiny --baseline tests/baseline/tiny.json --junit fits.xml
    """
    code = check(folder, baseline_file, rtol=rtol, k_se=k_se, junit=junit, echo=typer.echo)
    if code:
        raise typer.Exit(code)
