"""Every path of a sweep folder, derived from its root in one place, as submitit's `JobPaths`
derives every path of a job from its folder: `SweepPaths` for the sweep folder, `RunPaths`
for one run folder (`runs/<run_id>/`). The file names are `store`'s constants; code that
reads or writes a file of the folder asks these for its path and joins no name itself. The
opened folder (`gnsweep.folder.SweepFolder`) is a `SweepPaths` with its config and runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gnsweep import store

__all__ = ["RunPaths", "SweepPaths"]


@dataclass(frozen=True)
class RunPaths:
    """Every path of one run folder (`runs/<run_id>/`), derived from it."""

    folder: Path

    @property
    def run_id(self) -> str:
        return self.folder.name

    @property
    def record(self) -> Path:
        """config.json: the run's grid point and the config it trains with."""
        return self.folder / store.RUN_CONFIG

    @property
    def status(self) -> Path:
        return self.folder / store.STATUS

    @property
    def metrics(self) -> Path:
        """metrics.parquet, written when the run ends."""
        return self.folder / store.METRICS

    @property
    def metric_parts(self) -> Path:
        """The parts a live run appends its rows to."""
        return self.folder / store.METRIC_PARTS

    @property
    def history(self) -> Path:
        """attempts.jsonl: one line an event of each attempt."""
        return self.folder / store.HISTORY

    @property
    def claim(self) -> Path:
        return self.folder / store.CLAIM

    @property
    def checkpoints(self) -> Path:
        return self.folder / store.CHECKPOINTS

    @property
    def script_rows(self) -> Path:
        return self.folder / store.SCRIPT_ROWS

    @property
    def script_stop(self) -> Path:
        return self.folder / store.SCRIPT_STOP

    @property
    def script_output(self) -> tuple[Path, Path]:
        """A script run's stdout and stderr logs."""
        return (self.folder / store.SCRIPT_OUTPUT[0], self.folder / store.SCRIPT_OUTPUT[1])

    @property
    def sweep(self) -> Path:
        """The sweep folder this run folder sits in."""
        return store.sweep_of(self.folder)


class SweepPaths:
    """The paths of the sweep folder at `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    # ---- paths --------------------------------------------------------------------------

    @property
    def config_file(self) -> Path:
        return self.root / store.SWEEP_CONFIG

    @property
    def runs_dir(self) -> Path:
        return self.root / store.RUNS

    def run(self, run_id: str) -> RunPaths:
        """The paths of run `run_id` (`store.run_dir`: a plain name, no link)."""
        return RunPaths(store.run_dir(self.root, run_id))

    def run_ids(self) -> list[str]:
        return store.run_ids(self.root)

    def result(self, table: str) -> Path:
        """Where `gnsweep analyze` writes results table `table`."""
        return self.root / store.result_file(table)

    @property
    def fits_json(self) -> Path:
        return self.root / store.FITS_JSON

    @property
    def report(self) -> Path:
        return self.root / store.REPORT

    @property
    def figures(self) -> Path:
        return self.root / store.FIGURES

    @property
    def plan(self) -> Path:
        """`gnsweep plan`'s record of its rounds."""
        return self.root / store.PLAN

    @property
    def noise_plan(self) -> Path:
        """Which runs measure the noise scale, and why (`gnsweep.noise_plan`)."""
        return self.root / store.NOISE_PLAN

    @property
    def jobs(self) -> Path:
        """Which Slurm job took which run (in the Slurm folder)."""
        return self.slurm / store.JOBS

    @property
    def slurm(self) -> Path:
        return self.root / store.SLURM

    @property
    def lock(self) -> Path:
        """The folder's lock: config.yaml merges and claims are taken under it."""
        return self.root / store.CLAIMS_LOCK

    @property
    def scale(self) -> Path:
        return self.root / store.SCALE

    @property
    def laws_family(self) -> Path:
        """Where the laws of a family this sweep is a cell of were written."""
        return self.root / store.LAWS_FAMILY
