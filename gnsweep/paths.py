"""The layout of a sweep folder: every file name once, and every path derived from the root,
as submitit's `JobPaths` derives every path of a job from its folder. `SweepPaths` gives the
sweep folder's paths, `RunPaths` one run folder's (`runs/<run_id>/`), `OutPaths` those of
the folder `gnsweep compare` and `gnsweep laws` write to (`--out`). `store` reads and writes
through these; code that reads or writes a file of the folder asks them for its path and joins
no name itself (tests/test_architecture_facts.py checks). The opened folder
(`gnsweep.folder.SweepFolder`) is a `SweepPaths` with its config and runs.

    <sweep>/config.yaml                 resolved config of the sweep
    <sweep>/runs/<run_id>/config.json   one run's resolved config (workers load it, no Hydra)
    <sweep>/runs/<run_id>/status.json   pending | running | done | failed | diverged, attempts...
    <sweep>/runs/<run_id>/metrics.parquet  one row per logged step (METRICS_SCHEMA)
    <sweep>/runs/<run_id>/metrics.parts/   a training run's rows so far, one parquet file per
                                   flush (compacted into metrics.parquet when the run ends)
    <sweep>/runs/<run_id>/checkpoints/     the run's checkpoints (gnsweep.training.checkpoint)
    <sweep>/steps.parquet, front.parquet, fits.parquet, fits.json   written by `gnsweep analyze`
    <sweep>/adaptive.parquet       adaptive runs against the fits (only when there are some)
    <sweep>/figures/               written by `gnsweep plot`
    <out>/compare.parquet          written by `gnsweep compare` across analysed sweeps

Imports only `errors`: every floor above may ask for a path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gnsweep.errors import StoreError

__all__ = ["OutPaths", "RunPaths", "SweepPaths", "default_sweep_dir", "result_file", "run_dir",
           "sweep_of"]

# ---- every file name of a sweep folder, once (docs/storage.md draws the layout) -------------
RUNS = "runs"
SWEEP_CONFIG = "config.yaml"
RUN_CONFIG = "config.json"
STATUS = "status.json"
METRICS = "metrics.parquet"
METRIC_PARTS = "metrics.parts"
HISTORY = "attempts.jsonl"
"""Append-only log of a run's attempts (start, end, stopped, died), one JSON object a line."""
CLAIM = "claim.json"
"""A run folder's claim: which worker trains it (`executors.claims`)."""
CLAIMS_LOCK = ".claims.lock"
"""The sweep folder's lock around taking and breaking claims."""
CHECKPOINTS = "checkpoints"
"""A run folder's checkpoints (`training.checkpoint`)."""
SCRIPT_ROWS = "script_rows.jsonl"
"""A `task=script` run's rows logged through `gnsweep.current_run().log` (rank 0 appends)."""
NOISE_PROBE_ROWS = "noise_probe.jsonl"
"""A `task=script` run's noise scale measured inside its process (`gnsweep.inscript`), one
JSON line a measured step, joined to the script's rows by step (rank 0 appends)."""
SCRIPT_STOP = "stop"
"""A `task=script` run's flag: present once the run should stop (`should_stop()` reads it)."""
SCRIPT_OUTPUT = ("stdout.log", "stderr.log")
"""A `task=script` run's command output, every attempt's, appended."""
SCRIPT_PROCESS = "process.json"
"""A `task=script` run's running command: its process group's leader (pid and start time),
ended by the next attempt if it is still there."""
PLAN = "plan.json"
"""`gnsweep plan`'s record of its rounds."""
ANSWERS = "answers.json"
"""Each command's last answer and the runs it used (`gnsweep.answer_record`)."""
NEXT_GRIDS = "next_grids.json"
"""`gnsweep plan DIR`'s record: its budget, its rounds of next grids, why it stopped."""
NOISE_PLAN = "noise_plan.json"
"""Which runs measure the noise scale and why (`gnsweep.noise_plan`), each decided once."""
SLURM = "slurm"
"""The sweep folder's Slurm job files (`executors.slurm`)."""
FIGURES = "figures"
"""`gnsweep plot`'s PNG and PDF files (a grouped sweep's in one subfolder a group)."""
JOBS = "jobs.json"
"""In SLURM: run id -> the Slurm job id it was last submitted to."""
FITS = "fits.parquet"
"""The analysis' fits table: a folder with one is an analysed sweep."""
FITS_JSON = "fits.json"
REPORT = "report.html"
"""`gnsweep report`'s one-page HTML, in the sweep folder."""
SCALE = "scale.json"
"""The sweep's model size, counted at launch (`gnsweep laws` reads N from it)."""
LAWS_FAMILY = "laws_family.json"
"""In a sweep folder: where `gnsweep laws` last wrote the laws of a family it is a cell of
(`gnsweep report` shows them)."""
NOTICES = ".notices"
"""The sweep folder's subfolder of markers, one folder per launch (`gnsweep.notices`)."""
QUEUE = "queue"
"""The torchrun executor's run lists and each worker group's scratch (`executors.torchrun`)."""
TENSORBOARD, MLFLOW, WANDB = "tensorboard", "mlflow", "wandb"
"""The experiment trackers' local folders (`gnsweep.tracking`)."""

# ---- the files `gnsweep compare` and `gnsweep laws` write into --out ------------------------
COMPARE = "compare.parquet"
LAWS = "laws.parquet"
LAWS_JSON = "laws.json"
LAW_CELLS = "law_cells.parquet"
LAWS_HTML = "laws.html"
"""`gnsweep laws --out OUT`: the laws, their JSON (docs/laws.md) and the cells' optima."""

WRITTEN_INTO = (CLAIMS_LOCK, NOTICES, QUEUE, SLURM, FIGURES, TENSORBOARD, MLFLOW, WANDB)
"""Sweep-level names gnsweep writes into or locks: a link there is refused before a launch."""
RUN_WRITTEN_INTO = (HISTORY, CHECKPOINTS, METRIC_PARTS, CLAIM, STATUS, METRICS, SCRIPT_ROWS,
                    SCRIPT_STOP, SCRIPT_PROCESS, *SCRIPT_OUTPUT, NOISE_PROBE_ROWS)
"""Names of a run folder gnsweep appends to or writes into."""
RUN_FILES = (HISTORY, CLAIM, STATUS, METRICS)
"""Those of RUN_WRITTEN_INTO that are files: anything else there (a FIFO) is refused."""

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
"""What a run id may be (`RunSpec.run_id` writes `b00008_lr0.1_s0`, `r100_lr0.5_s0`): one plain
folder name, never a path."""


SWEEPS = "runs"
"""The folder of the working directory a sweep goes into without --sweep-dir."""


def default_sweep_dir(name: str) -> Path:
    """Where `gnsweep launch` (and `gnsweep plan`) put sweep `name` without --sweep-dir:
    runs/<name> in the working directory."""
    return Path(SWEEPS) / name


def run_dir(sweep_dir: Path, run_id: str) -> Path:
    """The folder of run `run_id`; StoreError when the id is not a plain name or the folder (or
    `runs/`) is a symbolic link: writes there would land outside the sweep folder."""
    runs = Path(sweep_dir) / RUNS
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id) or ".." in run_id:
        raise StoreError(f"{runs}: {str(run_id)[:80]!r} is not a run id (one folder "
                         "name such as b00008_lr0.1_s0), so gnsweep did not write it: move that "
                         "folder out of runs/")
    path = runs / run_id
    for part in (runs, path):
        if part.is_symlink():
            raise StoreError(f"{part}: a symbolic link; run folders must be real folders inside "
                             "the sweep folder (writes would land where it points): replace it "
                             "by a copy of what it points to, or remove it")
    return path


def sweep_of(run_path: Path) -> Path:
    """The sweep folder a run folder (`run_dir`) sits in."""
    return run_path.parent.parent


def result_file(table: str) -> str:
    """The file a results table is written to: `<table>.parquet`."""
    return f"{table}.parquet"


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
        return self.folder / RUN_CONFIG

    @property
    def status(self) -> Path:
        return self.folder / STATUS

    @property
    def metrics(self) -> Path:
        """metrics.parquet, written when the run ends."""
        return self.folder / METRICS

    @property
    def metric_parts(self) -> Path:
        """The parts a live run appends its rows to."""
        return self.folder / METRIC_PARTS

    def metric_part(self, first: int, last: int) -> Path:
        """The part holding steps `first` to `last`: named by them, so that names sort in step
        order."""
        return self.metric_parts / f"{first:012d}-{last:012d}.parquet"

    @property
    def history(self) -> Path:
        """attempts.jsonl: one line an event of each attempt."""
        return self.folder / HISTORY

    @property
    def claim(self) -> Path:
        return self.folder / CLAIM

    @property
    def checkpoints(self) -> Path:
        return self.folder / CHECKPOINTS

    @property
    def script_rows(self) -> Path:
        return self.folder / SCRIPT_ROWS

    @property
    def noise_probe_rows(self) -> Path:
        return self.folder / NOISE_PROBE_ROWS

    @property
    def script_stop(self) -> Path:
        return self.folder / SCRIPT_STOP

    @property
    def script_output(self) -> tuple[Path, Path]:
        """A script run's stdout and stderr logs."""
        return (self.folder / SCRIPT_OUTPUT[0], self.folder / SCRIPT_OUTPUT[1])

    @property
    def script_process(self) -> Path:
        return self.folder / SCRIPT_PROCESS

    @property
    def written_into(self) -> list[Path]:
        """What gnsweep appends to or writes into in this run folder (RUN_WRITTEN_INTO)."""
        return [self.folder / name for name in RUN_WRITTEN_INTO]

    @property
    def sweep(self) -> Path:
        """The sweep folder this run folder sits in."""
        return sweep_of(self.folder)


class SweepPaths:
    """The paths of the sweep folder at `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    # ---- paths --------------------------------------------------------------------------

    @property
    def config_file(self) -> Path:
        return self.root / SWEEP_CONFIG

    @property
    def runs_dir(self) -> Path:
        return self.root / RUNS

    def run(self, run_id: str) -> RunPaths:
        """The paths of run `run_id` (`run_dir`: a plain name, no link)."""
        return RunPaths(run_dir(self.root, run_id))

    def result(self, table: str) -> Path:
        """Where `gnsweep analyze` writes results table `table`."""
        return self.root / result_file(table)

    @property
    def fits_json(self) -> Path:
        return self.root / FITS_JSON

    @property
    def report(self) -> Path:
        return self.root / REPORT

    @property
    def figures(self) -> Path:
        return self.root / FIGURES

    def figures_of(self, group: str | None) -> Path:
        """Where `gnsweep plot` writes a group's figures (`group`: its folder name; None: the
        figures of an ungrouped sweep)."""
        return self.figures / group if group else self.figures

    @property
    def plan(self) -> Path:
        """`gnsweep plan`'s record of its rounds."""
        return self.root / PLAN

    @property
    def next_grids(self) -> Path:
        """`gnsweep plan DIR`'s record of its next grids."""
        return self.root / NEXT_GRIDS

    @property
    def answers(self) -> Path:
        """Each command's last answer and the runs it used."""
        return self.root / ANSWERS

    @property
    def noise_plan(self) -> Path:
        """Which runs measure the noise scale, and why (`gnsweep.noise_plan`)."""
        return self.root / NOISE_PLAN

    @property
    def jobs(self) -> Path:
        """Which Slurm job took which run (in the Slurm folder)."""
        return self.slurm / JOBS

    @property
    def slurm(self) -> Path:
        return self.root / SLURM

    @property
    def lock(self) -> Path:
        """The folder's lock: config.yaml merges and claims are taken under it."""
        return self.root / CLAIMS_LOCK

    @property
    def scale(self) -> Path:
        return self.root / SCALE

    @property
    def laws_family(self) -> Path:
        """Where the laws of a family this sweep is a cell of were written."""
        return self.root / LAWS_FAMILY

    @property
    def notices(self) -> Path:
        """The markers of the notices said once a launch (a folder per launch)."""
        return self.root / NOTICES

    @property
    def queue(self) -> Path:
        return self.root / QUEUE

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def mlflow(self) -> Path:
        return self.root / MLFLOW

    @property
    def wandb(self) -> Path:
        return self.root / WANDB

    @property
    def written_into(self) -> list[Path]:
        """What gnsweep writes into or locks at the sweep's level (WRITTEN_INTO)."""
        return [self.root / name for name in WRITTEN_INTO]


@dataclass(frozen=True)
class OutPaths:
    """The files `gnsweep compare` and `gnsweep laws` write into their `--out` folder."""

    folder: Path

    @property
    def compare(self) -> Path:
        return self.folder / COMPARE

    @property
    def laws(self) -> Path:
        return self.folder / LAWS

    @property
    def law_cells(self) -> Path:
        return self.folder / LAW_CELLS

    @property
    def laws_json(self) -> Path:
        return self.folder / LAWS_JSON

    @property
    def laws_html(self) -> Path:
        return self.folder / LAWS_HTML
