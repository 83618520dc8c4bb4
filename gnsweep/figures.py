"""Reading a sweep's tables for the figures and writing the figures: the I/O around plots.py.

    <sweep>/figures/<name>.png, <name>.pdf   one pair per figure of gnsweep.plots.FIGURES
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from gnsweep import store
from gnsweep.analysis.results import Results

FORMATS = ("png", "pdf")


def load_tables(sweep_dir: Path, analyze: bool = True) -> Results:
    """The results of an analyzed sweep with its runs and metrics; runs `gnsweep analyze`
    first when they are missing."""
    from gnsweep.analysis.load import load_sweep
    from gnsweep.analysis.report import analyze_sweep

    store.require_sweep(sweep_dir)
    if analyze and not all((sweep_dir / name).exists() for name in (
            "steps.parquet", "front.parquet", "fits.parquet")):
        analyze_sweep(sweep_dir)
    results = store.read_results(sweep_dir)
    results.runs, results.metrics = load_sweep(sweep_dir, skip_corrupt=True)
    return results


def save(fig, stem: str, out_dir: Path, formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """Write one figure in each format atomically and close it; returns the paths."""
    import matplotlib.pyplot as plt

    paths = []
    for fmt in formats:
        path = Path(out_dir) / f"{stem}.{fmt}"
        with store.atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt)
        paths.append(path)
    plt.close(fig)
    return paths


def png_bytes(fig) -> bytes:
    """The figure as PNG bytes, for embedding in the report."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


@dataclass
class Written:
    paths: list[Path]
    skipped: dict[str, str]
    """figure name -> why it was not drawn"""
    notes: list[str]


def write_figures(sweep_dir: Path, formats: tuple[str, ...] = FORMATS) -> Written:
    """Draw every figure the sweep supports into <sweep>/figures/."""
    from gnsweep import plots

    tables = load_tables(sweep_dir)
    paths: list[Path] = []
    skipped: dict[str, str] = {}
    for name, result in plots.draw_all(tables).items():
        if isinstance(result, str):
            skipped[name] = result
        else:
            paths += save(result, name, sweep_dir / "figures", formats)
    return Written(paths, skipped, plots.notes(tables))
