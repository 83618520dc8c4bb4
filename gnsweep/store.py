"""The sweep folder and its files: layout, parquet schemas, atomic writes, run status.

    <sweep>/config.yaml            resolved config of the sweep
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

Every file is written to a temporary name in the same folder and renamed into place, so a crash
leaves either the old file or the new one, never half of one. docs/storage.md lists every column.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gnsweep.errors import StoreError
from gnsweep.tables import (  # noqa: F401
    COMPARE_SCHEMA,
    METRICS_SCHEMA,
    OPTIONAL_METRICS,
    OPTIONAL_RESULTS,
    RESULT_SCHEMAS,
    RESULT_TABLES,
)

# Every file name of a sweep folder, once (docs/storage.md draws the layout):
#   <sweep>/config.yaml, plan.json, .claims.lock, <table>.parquet, fits.json, slurm/jobs.json
#   <sweep>/runs/<run_id>/config.json, status.json, metrics.parquet, metrics.parts/,
#                         attempts.jsonl, claim.json, checkpoints/
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
SCRIPT_STOP = "stop"
"""A `task=script` run's flag: present once the run should stop (`should_stop()` reads it)."""
SCRIPT_OUTPUT = ("stdout.log", "stderr.log")
"""A `task=script` run's command output, every attempt's, appended."""
PLAN = "plan.json"
"""`gnsweep plan`'s record of its rounds."""
SLURM = "slurm"
"""The sweep folder's Slurm job files (`executors.slurm`)."""
FIGURES = "figures"
"""`gnsweep plot`'s PNG and PDF files (a grouped sweep's in one subfolder a group)."""
JOBS = "jobs.json"
"""In SLURM: run id -> the Slurm job id it was last submitted to."""
FITS = "fits.parquet"
"""The analysis' fits table: a folder with one is an analysed sweep."""

class RunState(StrEnum):
    """A run's state in its status.json (a str: files and tables hold the plain value)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    DIVERGED = "diverged"


STATES = tuple(RunState)
FINISHED = (RunState.DONE, RunState.DIVERGED)
"""Final states: a relaunch never trains these runs again."""


@dataclass(frozen=True)
class RunStatus(Mapping[str, Any]):
    """A run's status.json, typed: the executors fill it (`write_status`), every reader reads
    it (`read_status`). It also reads as the JSON mapping it is stored as (`status["state"]`),
    holding only the keys that were written; keys a newer gnsweep wrote are kept in `extra`
    and written back unchanged."""

    state: RunState = RunState.PENDING
    attempts: int = 0
    """Attempts started (a stopped attempt is given back)."""
    retry_base: int = 0
    """`attempts` when the current launch began: each launch gives a failed run fresh retries."""
    updated: float | None = None
    """When the file was written (seconds since the epoch)."""
    error: str | None = None
    """Why the last attempt failed, one line (secrets masked)."""
    traceback: str | None = None
    stderr: list[str] | None = None
    """task=script: the command's last lines of stderr when it failed (`task.stderr_lines`)."""
    reason: str | None = None
    """How a run ended: the target reached, its budget, diverged, stalled..."""
    host: str | None = None
    pid: int | None = None
    slurm_job_id: str | None = None
    started: float | None = None
    gpus: str | None = None
    """The CUDA_VISIBLE_DEVICES the run was given (None: not set)."""
    device: str | None = None
    steps: int | None = None
    """Optimizer steps the run took."""
    final_loss: float | None = None
    train_seconds: float | None = None
    rows: int | None = None
    """Rows of metrics.parquet as the run ended (a table cut short or rewritten is found)."""
    examples: int | None = None
    """The last logged row's examples."""
    noise_method: dict[str, Any] | None = None
    """How the noise scale was measured (`NoiseScaleMonitor.describe`)."""
    b_simple_nan_share: float | None = None
    noise_measured: dict[str, Any] | None = None
    """The share of steps each method measured."""
    lost: str | None = None
    """Not stored: `runs.read_state` says why a run recorded finished needs running again."""
    recorded: str | None = None
    """Not stored: the state recorded for a `lost` run."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not know, kept as they are."""
    written: frozenset[str] = field(default=frozenset({"state", "attempts"}), compare=False,
                                    repr=False)
    """The fields status.json holds (a field never written reads as absent, not as None)."""

    @classmethod
    def from_json(cls, data: Any, path: Path | str = STATUS) -> RunStatus:
        """The status read from status.json's contents; StoreError, one line, on a shape no
        gnsweep writes (not an object, an unknown state, a count that is not a count)."""
        if not isinstance(data, dict):
            raise StoreError(f"{path}: not a run status (a JSON object); remove the file and "
                             "relaunch to run the run again")
        known = {f.name for f in fields(cls)} - {"extra", "written", "lost", "recorded"}
        values: dict[str, Any] = {}
        try:
            values["state"] = RunState(data.get("state", RunState.PENDING))
        except (ValueError, TypeError):
            raise StoreError(f"{path}: unknown state {str(data.get('state'))[:40]!r}; remove "
                             "the file and relaunch to run the run again") from None
        for name in ("attempts", "retry_base"):
            value = data.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StoreError(f"{path}: {name} is {str(value)[:40]!r}, not a count; remove "
                                 "the file and relaunch to run the run again")
            values[name] = value
        for name, value in data.items():
            if name in known and name not in values:
                values[name] = value
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**values, extra=extra, written=frozenset(values) | {"state", "attempts"})

    def to_json(self) -> dict[str, Any]:
        """What status.json holds: the keys written, in a stable order."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                               if f.name in self.written}
        out["state"] = self.state.value
        return {**out, **self.extra}

    def updated_with(self, state: RunState, **changes: Any) -> RunStatus:
        """This status moved to `state` with `changes` (field names of this class; TypeError on
        any other), the previous error dropped."""
        unknown = set(changes) - ({f.name for f in fields(self)} - {"extra", "written"})
        if unknown:
            raise TypeError(f"RunStatus has no field {sorted(unknown)}")
        keep = {name: getattr(self, name) for name in self.written
                if name not in ("error", "stderr", "lost", "recorded")}
        keep.update(changes, state=state, updated=time.time())
        return RunStatus(**keep, extra=self.extra, written=frozenset(keep))

    # The mapping of status.json, for readers of the plain file (and older scripts).
    def __getitem__(self, key: str) -> Any:
        if key in self.extra:
            return self.extra[key]
        if key in self.written:
            value = getattr(self, key)
            return value.value if isinstance(value, RunState) else value
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter([*sorted(self.written), *self.extra])

    def __len__(self) -> int:
        return len(self.written) + len(self.extra)

    def replace(self, **changes: Any) -> RunStatus:
        """A copy with `changes`, which count as written."""
        return dataclasses.replace(self, **changes, written=self.written | set(changes))



@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an advisory lock on `lock_path` (created if missing) for the block: processes on
    this machine that share the path take turns."""
    import fcntl

    fd = open_nofollow(lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` that refuses a symbolic link at `path` (O_NOFOLLOW): a file of a sweep folder
    that someone replaced by a link must not send writes wherever it points. An OSError names
    the file and says so."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as err:
        if os.path.islink(path):
            raise StoreError(f"{path}: a symbolic link; gnsweep writes only files inside the "
                             "sweep folder: remove the link") from None
        raise OSError(err.errno, err.strerror, str(path)) from None


def append_line(path: Path, line: str) -> None:
    """Append one line with one `write` on an O_APPEND file (never through a link)."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def subdir(sweep_dir: Path, name: str) -> Path:
    """The sweep folder's subfolder `name`, created if missing; StoreError when it is a link
    or resolves outside the sweep folder (writes there would land elsewhere)."""
    path = sweep_dir / name
    inside(sweep_dir, path)
    path.mkdir(parents=True, exist_ok=True)
    inside(sweep_dir, path)  # made by someone else between the check and mkdir
    return path


def inside(sweep_dir: Path, path: Path) -> Path:
    """`path`, checked to be a real (not linked) file or folder below `sweep_dir`."""
    root = Path(os.path.realpath(sweep_dir))
    relative = Path(os.path.relpath(os.path.abspath(path), os.path.abspath(sweep_dir)))
    if relative.parts[:1] == ("..",) or relative.is_absolute():
        raise StoreError(f"{path}: outside the sweep folder {sweep_dir}; gnsweep writes only "
                         "inside it")
    current = root
    for part in relative.parts:
        if part in ("", "."):
            continue
        current = current / part
        if current.is_symlink():
            raise StoreError(f"{sweep_dir / relative}: a symbolic link inside the sweep folder; "
                             "gnsweep writes only inside the folder: replace the link by a "
                             "real folder (or remove it)")
    return path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path`, renamed onto it when the block ends without error. An
    OSError names `path` (a full disk, say, reports no file), so that the user sees which."""
    path.parent.mkdir(parents=True, exist_ok=True)  # names the folder it cannot make
    try:
        with _atomic_path(path) as tmp:
            yield tmp
    except OSError as err:
        named = err.filename
        if named is not None and not os.path.basename(str(named)).startswith(f".{path.name}."):
            raise  # about another file, which it names
        # pyarrow's errors carry the errno but wrap the reason in their own words.
        reason = os.strerror(err.errno) if err.errno else (
            err.strerror or (str(err).strip().splitlines() or [type(err).__name__])[0])
        raise OSError(err.errno, reason, str(path)) from err


@contextmanager
def _atomic_path(path: Path) -> Iterator[Path]:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp makes the file private (0600); results are for sharing, so honour the umask.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StoreError(f"{path}: not valid JSON ({err})") from None


def write_table(path: Path, table: pa.Table) -> None:
    """Write a parquet file atomically; the writer is closed before the rename."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def write_frame(path: Path, frame: Any, schema: pa.Schema | None = None) -> None:
    table = pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
    write_table(path, table)


def read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing") from None
    except (pa.ArrowInvalid, pa.ArrowKeyError, OSError) as err:
        raise StoreError(f"{path}: unreadable parquet ({str(err).splitlines()[0]})") from None


def metrics_problem(run_path: Path, status: Mapping[str, Any] | None = None) -> str | None:
    """Why a run's metrics cannot be analysed ("missing", "unreadable: ..."), None when they
    can: its parquet footer and schema read (cheap: no data pages). With the run's `status`
    (finished), also when its rows disagree with what the run recorded as it ended: the row
    count (`rows`), the last row's examples (`examples`) and its step (within `log_every` of
    `steps`), a table rewritten or cut short that would change the answer in silence."""
    path = run_path / METRICS
    try:
        if path.is_symlink():
            return "a symbolic link"
        meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except FileNotFoundError:
        return "missing"
    except (pa.ArrowException, OSError, ValueError) as err:
        return f"unreadable ({(str(err).strip().splitlines() or [type(err).__name__])[0]})"
    if "step" not in schema.names or "loss" not in schema.names:
        return "unreadable (no step and loss columns)"
    if status is None or status.get("state") not in FINISHED:
        return None
    return _rows_disagree(run_path, meta, status)


def _rows_disagree(run_path: Path, meta: Any, status: Mapping[str, Any]) -> str | None:
    def last() -> dict[str, Any]:
        return read_table(run_path / METRICS, columns=["step", "examples"]).slice(
            meta.num_rows - 1).to_pylist()[0]

    try:
        return rows_disagree(status, meta.num_rows, last, lambda: log_every(run_path))
    except StoreError:
        return "unreadable (its step and examples columns)"


def rows_disagree(status: Mapping[str, Any], num_rows: int, last: Callable[[], dict[str, Any]],
                  every: Callable[[], int]) -> str | None:
    """How a finished run's rows (`num_rows`, `last()`: its last row's step and examples)
    disagree with its status.json, None if they do not."""
    rows, steps, examples = status.get("rows"), status.get("steps"), status.get("examples")
    if isinstance(rows, int) and num_rows != rows:
        return f"cut short or rewritten: {num_rows} rows where the run logged {rows} ({STATUS})"
    # A status written before rows and examples were recorded: a done run logged its last
    # step (at the target) or one of the last `every()` (its log_every; at its budget).
    by_step = status.get("state") == RunState.DONE and isinstance(steps, int)
    if num_rows == 0 or not (isinstance(examples, int) or by_step):
        return None
    row = last()
    if isinstance(examples, int):
        if row.get("examples") == examples:
            return None
        return (f"cut short or rewritten: its last row at {row.get('examples')} examples where "
                f"the run's last logged row was at {examples} ({STATUS})")
    step = row.get("step")
    if isinstance(step, int) and isinstance(steps, int) and steps - every() < step <= steps:
        return None
    return (f"cut short or rewritten: its last row at step {step} where the run ended at step "
            f"{steps} ({STATUS})")


def log_every(run_path: Path) -> int:
    """The run's `sweep.log_every` from its config.json (1 when it does not say)."""
    try:
        value = read_json(run_path / RUN_CONFIG)["config"]["sweep"]["log_every"]
    except (StoreError, KeyError, TypeError):
        return 1
    return value if isinstance(value, int) and value >= 1 else 1




def metrics_table(rows: dict[str, list]) -> pa.Table:
    n = len(rows["step"])
    columns = {}
    for f in METRICS_SCHEMA:
        values = rows.get(f.name, []) if f.name in OPTIONAL_METRICS else rows[f.name]
        if f.name in OPTIONAL_METRICS and not len(values):
            values = [float("nan")] * n
        columns[f.name] = pa.array(values, type=f.type)
    return pa.table(columns, schema=METRICS_SCHEMA)


def write_metrics_part(path: Path, rows: dict[str, list], start: int) -> Path | None:
    """Rows `start:` of `rows` (by column, METRICS_SCHEMA) as one more part of a training run's
    metrics, named by its first and last step so that the names sort in step order. Atomic:
    a reader sees the part whole or not at all. Returns the part (None: no rows)."""
    part = {name: values[start:] for name, values in rows.items()}
    steps = part["step"]
    if not len(steps):
        return None
    # subdir: a real folder of the run, never a link that sends the rows elsewhere.
    target = subdir(path, METRIC_PARTS) / f"{int(steps[0]):012d}-{int(steps[-1]):012d}.parquet"
    write_table(target, metrics_table(part))
    return target


def metric_parts(path: Path) -> list[Path]:
    """A training run's metrics parts in step order (none once the run has ended)."""
    folder = path / METRIC_PARTS
    try:
        names = sorted(p for p in os.listdir(folder) if p.endswith(".parquet")
                       and not p.startswith("."))
    except FileNotFoundError:
        return []
    return [folder / name for name in names]


def read_metrics(path: Path, columns: list[str] | None = None) -> pa.Table | None:
    """A run's logged rows: metrics.parquet once it has ended, else the parts a training run
    has flushed so far, in step order (None when there are neither). Safe while the run trains:
    parts are whole, and parts compacted away under the reader are read from metrics.parquet."""
    for _ in range(3):
        if (path / METRICS).exists():
            return read_table(path / METRICS, columns)
        parts = metric_parts(path)
        if not parts:
            return None
        try:
            return _unique_steps(pa.concat_tables([read_table(p, columns) for p in parts]))
        except StoreError:
            if all(p.exists() for p in parts):
                raise  # a part is unreadable, not gone
    return read_table(path / METRICS, columns)


def _unique_steps(table: pa.Table) -> pa.Table:
    """Each step's row once, in step order (a resume interrupted while it rewrote the parts
    leaves a step in two of them: the same row, since a resumed run logs it alike)."""
    if "step" not in table.column_names:
        return table
    import numpy as np

    steps = table.column("step").to_numpy()
    _, first = np.unique(steps, return_index=True)
    return table if len(first) == len(steps) else table.take(pa.array(first))


def last_metrics_row(path: Path) -> dict[str, Any] | None:
    """The last row a run has logged to disk (its last part while it trains), or None."""
    parts = metric_parts(path)
    try:
        table = read_table(parts[-1]) if parts else read_metrics(path)
    except StoreError:
        return None
    if table is None or not table.num_rows:
        return None
    return table.slice(table.num_rows - 1).to_pylist()[0]


def clear_metrics(path: Path, keep_through: int | None = None) -> dict[str, list]:
    """Drop a run's on-disk rows after step `keep_through` (None: all of them) and return the
    rows kept, by column: what a run resumed at that step has logged. The kept rows are written
    as one part before the old parts go (a crash in between leaves rows twice, read once)."""
    kept: dict[str, list] = {f.name: [] for f in METRICS_SCHEMA}
    table = read_metrics(path) if keep_through is not None else None
    if table is not None:
        rows = table.filter(pc.less_equal(table.column("step"), keep_through))
        kept.update({name: rows.column(name).to_pylist() for name in rows.column_names})
    old = metric_parts(path)
    new = write_metrics_part(path, kept, 0)
    for part in old:
        if part != new:
            part.unlink(missing_ok=True)
    (path / METRICS).unlink(missing_ok=True)
    return kept


def end_metrics(path: Path, rows: dict[str, list]) -> None:
    """A run's final rows as metrics.parquet (atomic), then its parts removed."""
    write_table(path / METRICS, metrics_table(rows))
    for part in metric_parts(path):
        part.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        (path / METRIC_PARTS).rmdir()


# ---- the sweep folder -------------------------------------------------------------------


def is_sweep(sweep_dir: Path) -> bool:
    return (sweep_dir / SWEEP_CONFIG).is_file() and (sweep_dir / RUNS).is_dir()


def require_sweep(sweep_dir: Path) -> None:
    if not sweep_dir.is_dir():
        raise StoreError(f"{sweep_dir}: no such folder; run `gnsweep launch` first")
    if not is_sweep(sweep_dir):
        raise StoreError(f"{sweep_dir}: not a sweep folder (no {SWEEP_CONFIG} and {RUNS}/); "
                         "give the folder that `gnsweep launch` wrote")


def read_sweep_config(sweep_dir: Path) -> dict[str, Any]:
    """The sweep's config.yaml as plain data; StoreError names a bad file.

    Only `Config.load` (the typed reader) and the relaunch check (which compares raw settings,
    also those of another version's schema) read it.
    """
    import yaml

    path = sweep_dir / SWEEP_CONFIG
    try:
        loaded = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; give the folder that `gnsweep launch` wrote") \
            from None
    except (OSError, yaml.YAMLError) as err:
        raise StoreError(f"{path}: unreadable ({str(err).splitlines()[0]})") from None
    if not isinstance(loaded, dict):
        raise StoreError(f"{path}: not a sweep config (no mapping at the top)")
    return {str(k): v for k, v in loaded.items()}


RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
"""What a run id may be (`RunSpec.run_id` writes `b00008_lr0.1_s0`, `r100_lr0.5_s0`): one plain
folder name, never a path."""


def run_dir(sweep_dir: Path, run_id: str) -> Path:
    """The folder of run `run_id`; StoreError when the id is not a plain name or the folder (or
    `runs/`) is a symbolic link: writes there would land outside the sweep folder."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id) or ".." in run_id:
        raise StoreError(f"{sweep_dir / RUNS}: {str(run_id)[:80]!r} is not a run id (one folder "
                         "name such as b00008_lr0.1_s0), so gnsweep did not write it: move that "
                         "folder out of runs/")
    path = sweep_dir / RUNS / run_id
    for part in (sweep_dir / RUNS, path):
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


WRITTEN_INTO = (CLAIMS_LOCK, ".notices", "queue", SLURM, FIGURES, "tensorboard", "mlflow",
                "wandb")
"""Sweep-level names gnsweep writes into or locks: a link there is refused before a launch."""
RUN_WRITTEN_INTO = (HISTORY, CHECKPOINTS, METRIC_PARTS, CLAIM, STATUS, METRICS, SCRIPT_ROWS,
                    SCRIPT_STOP, *SCRIPT_OUTPUT)
"""Names of a run folder gnsweep appends to or writes into."""


def check_links(sweep_dir: Path) -> None:
    """StoreError (exit 2, nothing claimed, nothing run) naming the first file or folder of the
    sweep gnsweep writes into that is a symbolic link: writes are refused there anyway (they
    are never followed), but refused up front the run is not half-started, claimed or failed."""
    names = [sweep_dir / name for name in WRITTEN_INTO]
    for run_id in run_ids(sweep_dir):
        names += [sweep_dir / RUNS / run_id / name for name in RUN_WRITTEN_INTO]
    for path in names:
        if path.is_symlink():
            raise StoreError(f"{path}: a symbolic link; gnsweep writes only files inside the "
                             "sweep folder and never follows one: remove the link (or replace "
                             "it by a copy of what it points to)")


def run_ids(sweep_dir: Path) -> list[str]:
    """The runs of a sweep folder (those with a config.json); StoreError names a run folder
    that is a link or a name that is not a run id."""
    root = sweep_dir / RUNS
    if not root.is_dir():
        return []
    names = sorted(p.name for p in root.iterdir() if (p / RUN_CONFIG).is_file())
    for name in names:
        run_dir(sweep_dir, name)
    return names


def read_status(path: Path) -> RunStatus:
    """A run folder's status; a run never started is pending. StoreError, one line, on a file
    gnsweep cannot have written."""
    try:
        data = read_json(path / STATUS)
    except StoreError:
        if (path / STATUS).exists():
            raise
        return RunStatus()
    return RunStatus.from_json(data, path / STATUS)


def write_status(path: Path, state: str, **changes: Any) -> RunStatus:
    """Move a run's status to `state` with `changes` (`RunStatus` fields), atomically; the
    previous attempt's error is dropped."""
    status = read_status(path).updated_with(RunState(state), **changes)
    write_json(path / STATUS, status.to_json())
    return status


# ---- the results of `gnsweep analyze` -----------------------------------------------------

# The tables' columns and types live in `gnsweep.tables` (no analysis import from here).
COMPARE = "compare.parquet"
LAWS = "laws.parquet"
LAWS_JSON = "laws.json"
LAW_CELLS = "law_cells.parquet"
LAWS_HTML = "laws.html"
SCALE = "scale.json"
"""The sweep's model size, counted at launch (`gnsweep laws` reads N from it)."""
"""`gnsweep laws --out OUT`: the laws, their JSON (docs/laws.md) and the cells' optima."""
FITS_JSON = "fits.json"
REPORT = "report.html"
"""`gnsweep report`'s one-page HTML, in the sweep folder."""


def write_results(out_dir: Path, results: Any) -> None:
    """Every table of the results (a `gnsweep.analysis.results.Results`), each atomically;
    then fits.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in RESULT_TABLES:
        frame = getattr(results, name)
        if name in OPTIONAL_RESULTS and not len(frame):
            continue  # e.g. a sweep without adaptive runs gets no adaptive.parquet
        write_frame(out_dir / result_file(name), frame,
                    schema=_schema_of(frame, RESULT_SCHEMAS[name]))
    write_json(out_dir / FITS_JSON, results.to_json())


def _schema_of(frame: Any, schema: pa.Schema) -> pa.Schema:
    """The table's schema for the frame's columns: declared types, inferred for the others."""
    inferred = pa.Schema.from_pandas(frame, preserve_index=False)
    return pa.schema([schema.field(f.name) if f.name in schema.names else f for f in inferred])


def read_result_tables(sweep_dir: Path) -> dict[str, Any]:
    """The tables and fits.json an analysis wrote into a sweep folder, as plain data: each table
    present by name (a DataFrame; steps, front and fits must exist, the others are left out
    where an older version did not write them), `warnings` and `meta` from fits.json.
    `gnsweep.analysis.results.read_results` makes them one `Results`."""

    def frame(name: str) -> Any:
        path = sweep_dir / result_file(name)
        try:
            return read_table(path).to_pandas()
        except StoreError as err:
            raise StoreError(f"{err}; run the `gnsweep analyze` that wrote it again (it "
                             "rewrites the table)") from None

    out: dict[str, Any] = {name: frame(name) for name in ("steps", "front", "fits")}
    for name in ("lr_fits", "loss_scaling", "temperature", *OPTIONAL_RESULTS):
        if (sweep_dir / result_file(name)).exists():
            out[name] = frame(name)
    out["warnings"], out["meta"] = [], {}
    if (sweep_dir / FITS_JSON).exists():
        saved = read_json(sweep_dir / FITS_JSON)
        out["warnings"] = [str(w) for w in saved.get("warnings", [])]
        out["meta"] = dict(saved.get("meta") or {})
    return out
