"""A figure written to disk: one file a format, each atomically (`store.atomic_path`), the
figure closed after. The drawing itself (`gnsweep.report`) writes no file."""

from __future__ import annotations

from pathlib import Path

from gnsweep import store

FORMATS = ("png", "pdf")


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
