"""The sweep folder's files: atomic writes, safe reads, parquet schemas, run status.

Every path comes from `gnsweep.paths` (`SweepPaths`, `RunPaths`: the layout, every file name
once); this module reads and writes the files there and joins no name itself. Every file is
written to a temporary name in the same folder and renamed into place, so a crash leaves
either the old file or the new one, never half of one. docs/storage.md lists every column.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import stat
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
from gnsweep.paths import (
    RUN_CONFIG,
    RUN_FILES,
    RUNS,
    STATUS,
    SWEEP_CONFIG,
    RunPaths,
    SweepPaths,
    run_dir,
)
from gnsweep.tables import (  # noqa: F401
    COMPARE_SCHEMA,
    METRICS_SCHEMA,
    OPTIONAL_METRICS,
    OPTIONAL_RESULTS,
    RESULT_KEYS,
    RESULT_SCHEMAS,
    RESULT_TABLES,
)


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
    train_cpu_seconds: float | None = None
    """CPU seconds of the training process (its threads included) while the run trained: the
    run's compute, which other jobs on the machine do not inflate."""
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
        # O_NONBLOCK: a named pipe put there must not hang the writer until someone reads it.
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                     mode)
    except OSError as err:
        if os.path.islink(path):
            raise StoreError(f"{path}: a symbolic link; gnsweep writes only files inside the "
                             "sweep folder: remove the link") from None
        with contextlib.suppress(OSError):
            found = os.lstat(path).st_mode
            if not stat.S_ISREG(found):
                raise StoreError(f"{path}: {_kind(found)} where a file belongs; gnsweep "
                                 "writes only regular files: remove it") from None
        raise OSError(err.errno, err.strerror, str(path)) from None
    found = os.fstat(fd).st_mode
    if not stat.S_ISREG(found):
        os.close(fd)
        raise StoreError(f"{path}: {_kind(found)} where a file belongs; gnsweep writes only "
                         "regular files: remove it")
    os.set_blocking(fd, True)
    return fd


def append_line(path: Path, line: str) -> None:
    """Append one line with one `write` on an O_APPEND file (never through a link)."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def subdir(root: Path, path: Path) -> Path:
    """The folder `path` (a `paths` path) inside `root` (the sweep folder, or a run folder),
    created if missing; StoreError when it is a link or resolves outside `root` (writes there
    would land elsewhere)."""
    inside(root, path)
    path.mkdir(parents=True, exist_ok=True)
    inside(root, path)  # made by someone else between the check and mkdir
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


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file at `path`, the one way gnsweep opens a file of
    a folder it reads: never through a symbolic link (O_NOFOLLOW), never blocking on a named
    pipe a writer never opens (O_NONBLOCK), and a FIFO, device, socket or folder found there
    refused (fstat of what was opened, so nothing swapped in between is read). FileNotFoundError
    when nothing is there; StoreError (one line, exit 2) naming anything else."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as err:
        if os.path.islink(path):
            raise StoreError(f"{path}: a symbolic link; gnsweep reads only files inside the "
                             "sweep folder: replace it by a copy of what it points to") from None
        with contextlib.suppress(OSError):
            found = os.lstat(path).st_mode
            if not stat.S_ISREG(found):  # a folder; a socket (ENXIO); a device it refused
                raise StoreError(f"{path}: {_kind(found)} where a file belongs; gnsweep reads "
                                 "only regular files: remove it") from None
        raise StoreError(f"{path}: cannot open ({err.strerror or type(err).__name__})") \
            from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise StoreError(f"{path}: {_kind(mode)} where a file belongs; gnsweep reads only "
                         "regular files: remove it")
    os.set_blocking(fd, True)  # a regular file never blocks; readers below may use any API
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "a special file"


def is_regular(path: Path) -> bool:
    """Whether `path` is a regular file, not followed if it is a link (lstat: never opens)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_special(path: Path) -> bool:
    """Whether something other than a regular file or a symbolic link is at `path` (a FIFO,
    device, socket or folder): what readers refuse in one line rather than treat as lost."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISLNK(mode))


def require_regular(path: Path) -> Path:
    """`path`, checked (lstat, before a reader that takes a path opens it) to be a regular
    file: FileNotFoundError when nothing is there, StoreError naming anything else."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise StoreError(f"{path}: {_kind(mode)} where a file belongs; gnsweep reads only "
                         "regular files: remove it")
    return path


def read_bytes(path: Path) -> bytes:
    """The bytes of the regular file at `path` (`open_regular`)."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def read_text(path: Path) -> str:
    """The UTF-8 text of the regular file at `path`; StoreError names a file that is not
    UTF-8 (a byte the writer never wrote), FileNotFoundError a missing one."""
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise StoreError(f"{path}: not UTF-8 text (byte {data[err.start]:#04x} at offset "
                         f"{err.start}); restore the file or remove it") from None


MAX_DEPTH = 64
"""The deepest nesting (objects and lists in each other) a JSON or YAML file of a sweep may
have: gnsweep writes at most about 8; a deeper file is refused in one line, never parsed."""

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(text: str) -> int:
    """How deeply `text`'s JSON objects and lists nest (brackets inside strings not counted)."""
    import numpy as np

    stripped = _JSON_STRING.sub(b"", text.encode())
    codes = np.frombuffer(stripped, dtype=np.uint8)
    steps = (np.isin(codes, (ord("["), ord("{"))).astype(np.int64)
             - np.isin(codes, (ord("]"), ord("}"))))
    return int(np.cumsum(steps).max()) if len(steps) else 0


def parse_json(text: str, where: Path | str) -> Any:
    """`text` as JSON, refused (StoreError naming `where`) when it is not JSON or nests deeper
    than MAX_DEPTH."""
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        raise StoreError(f"{where}: JSON nested {depth} deep, more than the {MAX_DEPTH} gnsweep "
                         "accepts; restore the file gnsweep wrote or remove it")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise StoreError(f"{where}: not valid JSON ({err})") from None


def read_json(path: Path) -> Any:
    """A JSON file of the folder (`read_text`, `parse_json`); StoreError names a missing one."""
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing") from None
    return parse_json(text, path)


def load_yaml(text: str, where: Path | str) -> Any:
    """YAML as plain data (safe types only), refusing anchors and aliases (`&a`, `*a`: a few
    lines of them expand to billions of nodes for any code that walks the result) and nesting
    deeper than MAX_DEPTH. StoreError names `where`."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                mark = event.start_mark
                raise StoreError(f"{where}: line {mark.line + 1}: a YAML anchor or alias "
                                 f"({'*' if isinstance(event, yaml.AliasEvent) else '&'}"
                                 f"{event.anchor}); gnsweep reads no anchors or aliases: "
                                 "write the values out")
            self._depth = getattr(self, "_depth", 0) + 1
            try:
                if self._depth > MAX_DEPTH:
                    raise StoreError(f"{where}: line {event.start_mark.line + 1}: nested "
                                     f"deeper than {MAX_DEPTH}; gnsweep reads no such YAML")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

    try:
        return yaml.load(text, Loader=NoAliases)
    except yaml.YAMLError as err:
        raise StoreError(f"{where}: unreadable ({str(err).splitlines()[0]})") from None
    except RecursionError:
        raise StoreError(f"{where}: nested too deep") from None


def write_table(path: Path, table: pa.Table) -> None:
    """Write a parquet file atomically; the writer is closed before the rename."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def write_frame(path: Path, frame: Any, schema: pa.Schema | None = None) -> None:
    table = pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
    write_table(path, table)


def parquet_path(path: Path) -> str:
    """`path` for pyarrow's own (native) readers, once `require_regular` has found a regular
    file there (lstat: a FIFO, device, socket or link is refused, never opened; pyarrow then
    opens the path itself, without a Python file object in its threads)."""
    return str(require_regular(path))


def read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        return pq.read_table(parquet_path(path), columns=columns)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing") from None
    except (pa.ArrowException, OSError, ValueError) as err:
        raise StoreError(f"{path}: unreadable parquet "
                         f"({(str(err).strip().splitlines() or [type(err).__name__])[0]})") \
            from None


def metrics_problem(run_path: Path, status: Mapping[str, Any] | None = None) -> str | None:
    """Why a run's metrics cannot be analysed ("missing", "unreadable: ..."), None when they
    can: its parquet footer and schema read (cheap: no data pages). With the run's `status`
    (finished), also when its rows disagree with what the run recorded as it ended: the row
    count (`rows`), the last row's examples (`examples`) and its step (within `log_every` of
    `steps`), a table rewritten or cut short that would change the answer in silence."""
    path = RunPaths(run_path).metrics
    try:
        if path.is_symlink():
            return "a symbolic link"
        meta = pq.read_metadata(parquet_path(path))
        schema = meta.schema.to_arrow_schema()
    except FileNotFoundError:
        return "missing"
    except StoreError as err:
        if is_special(path):
            raise  # a FIFO, device or folder put there: refused in one line, never rerun over
        return f"unreadable ({str(err).removeprefix(f'{path}: ')})"
    except (pa.ArrowException, OSError, ValueError) as err:
        return f"unreadable ({(str(err).strip().splitlines() or [type(err).__name__])[0]})"
    if "step" not in schema.names or "loss" not in schema.names:
        return "unreadable (no step and loss columns)"
    if status is None or status.get("state") not in FINISHED:
        return None
    return _rows_disagree(run_path, meta, status)


def _rows_disagree(run_path: Path, meta: Any, status: Mapping[str, Any]) -> str | None:
    def last() -> dict[str, Any]:
        return read_table(RunPaths(run_path).metrics, columns=["step", "examples"]).slice(
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
        value = read_json(RunPaths(run_path).record)["config"]["sweep"]["log_every"]
    except (StoreError, KeyError, TypeError):
        return 1
    return value if isinstance(value, int) and value >= 1 else 1




def metrics_table(rows: dict[str, Any]) -> pa.Table:
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
    paths = RunPaths(path)
    subdir(path, paths.metric_parts)
    target = paths.metric_part(int(steps[0]), int(steps[-1]))
    write_table(target, metrics_table(part))
    return target


def metric_parts(path: Path) -> list[Path]:
    """A training run's metrics parts in step order (none once the run has ended)."""
    folder = RunPaths(path).metric_parts
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
    metrics = RunPaths(path).metrics
    for _ in range(3):
        if metrics.exists():
            return read_table(metrics, columns)
        parts = metric_parts(path)
        if not parts:
            return None
        try:
            return _unique_steps(pa.concat_tables([read_table(p, columns) for p in parts]))
        except StoreError:
            if all(p.exists() for p in parts):
                raise  # a part is unreadable, not gone
    return read_table(metrics, columns)


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
    RunPaths(path).metrics.unlink(missing_ok=True)
    return kept


def _merge_parts(path: Path, target: Path) -> bool:
    """A training run's metrics parts written as one parquet file at `target` (atomic), part
    by part (one row group each): memory holds one part, not the run. Each step once, in
    order (a step a resume left in two parts is the same row). False when there is no part."""
    parts = metric_parts(path)
    if not parts:
        return False
    last: int | None = None
    with atomic_path(target) as tmp, pq.ParquetWriter(tmp, METRICS_SCHEMA) as writer:
        for part in parts:
            table = read_table(part)
            if last is not None:
                table = table.filter(pc.greater(table.column("step"), last))
            if table.num_rows:
                for f in METRICS_SCHEMA:  # a part an older version wrote, without a column
                    if f.name not in table.column_names:
                        table = table.append_column(f, pa.nulls(table.num_rows, f.type))
                writer.write_table(table.select(METRICS_SCHEMA.names).cast(METRICS_SCHEMA))
                last = int(table.column("step")[-1].as_py())
    return True


def compact_metrics(path: Path) -> None:
    """A training run's metrics parts rewritten as one (the same rows), part by part."""
    old = metric_parts(path)
    if len(old) < 2:
        return
    first = old[0].name.split("-")[0]
    last = old[-1].name.split("-")[-1]
    target = subdir(path, RunPaths(path).metric_parts) / f"{first}-{last}"
    if not _merge_parts(path, target):
        return
    for part in old:
        if part != target:
            part.unlink(missing_ok=True)


def end_parts(path: Path) -> None:
    """A run's metrics parts as its metrics.parquet (atomic, part by part: `_merge_parts`),
    then the parts removed; an empty metrics.parquet when it has none."""
    paths = RunPaths(path)
    if not _merge_parts(path, paths.metrics):
        write_table(paths.metrics, metrics_table({f.name: [] for f in METRICS_SCHEMA}))
    for part in metric_parts(path):
        part.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        paths.metric_parts.rmdir()


def end_metrics(path: Path, rows: dict[str, Any]) -> None:
    """A run's final rows as metrics.parquet (atomic), then its parts removed."""
    paths = RunPaths(path)
    write_table(paths.metrics, metrics_table(rows))
    for part in metric_parts(path):
        part.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        paths.metric_parts.rmdir()


# ---- the sweep folder -------------------------------------------------------------------


def is_sweep(sweep_dir: Path) -> bool:
    paths = SweepPaths(sweep_dir)
    return paths.config_file.is_file() and paths.runs_dir.is_dir()


def require_sweep(sweep_dir: Path) -> None:
    if not sweep_dir.is_dir():
        raise StoreError(f"{sweep_dir}: no such folder; run `gnsweep launch` first")
    config = SweepPaths(sweep_dir).config_file
    if is_special(config):  # a FIFO, socket, device or folder where the config belongs
        raise StoreError(f"{config}: {_kind(os.lstat(config).st_mode)} where a file belongs; "
                         "gnsweep reads only regular files: put the sweep's config.yaml back")
    if not is_sweep(sweep_dir):
        raise StoreError(f"{sweep_dir}: not a sweep folder (no {SWEEP_CONFIG} and {RUNS}/); "
                         "give the folder that `gnsweep launch` wrote")


def read_sweep_config(sweep_dir: Path) -> dict[str, Any]:
    """The sweep's config.yaml as plain data; StoreError names a bad file.

    Only `folder.read_config` (the typed reader, called where the folder is opened) reads it.
    """
    path = SweepPaths(sweep_dir).config_file
    try:
        loaded = load_yaml(read_text(path), path)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; give the folder that `gnsweep launch` wrote") \
            from None
    except OSError as err:
        raise StoreError(f"{path}: unreadable ({err.strerror or type(err).__name__})") \
            from None
    if not isinstance(loaded, dict):
        raise StoreError(f"{path}: not a sweep config (no mapping at the top)")
    return {str(k): v for k, v in loaded.items()}


def sweep_owning(path: Path) -> Path | None:
    """The sweep folder that `path` (existing or not) is, or lies in the `runs/` folder of;
    None when it belongs to no sweep. A command writing its own files (compare's --out) must
    not write them there: a sweep's folder and runs hold only what its runs and analysis
    wrote."""
    target = Path(os.path.abspath(path))
    for folder in (target, *target.parents):
        if is_sweep(folder):
            inner = target.relative_to(folder).parts
            return folder if not inner or inner[0] == RUNS else None
    return None


def check_links(sweep_dir: Path) -> None:
    """StoreError (exit 2, nothing claimed, nothing run) naming the first file or folder of the
    sweep gnsweep writes into that is a symbolic link: writes are refused there anyway (they
    are never followed), but refused up front the run is not half-started, claimed or failed."""
    folder = SweepPaths(sweep_dir)
    names = folder.written_into
    for run_id in run_ids(sweep_dir):
        names += folder.run(run_id).written_into
    for path in names:
        if path.is_symlink():
            raise StoreError(f"{path}: a symbolic link; gnsweep writes only files inside the "
                             "sweep folder and never follows one: remove the link (or replace "
                             "it by a copy of what it points to)")
        if path.name in RUN_FILES and is_special(path):
            raise StoreError(f"{path}: {_kind(os.lstat(path).st_mode)} where a file belongs; "
                             "gnsweep reads and writes only regular files: remove it")


def run_ids(sweep_dir: Path) -> list[str]:
    """The runs of a sweep folder (those with a config.json); StoreError names a run folder
    that is a link or a name that is not a run id."""
    root = SweepPaths(sweep_dir).runs_dir
    if not root.is_dir():
        return []
    names = sorted(p.name for p in root.iterdir() if RunPaths(p).record.is_file())
    for name in names:
        run_dir(sweep_dir, name)
    return names


def unreadable_runs(sweep_dir: Path) -> dict[str, str]:
    """The folders of `runs/` that hold no readable run record (config.json missing, a folder,
    a FIFO, ...): folder name -> why. `run_ids` lists only the others, so the readers that
    show the sweep (status, analyze) name these, never leave them out in silence."""
    root = SweepPaths(sweep_dir).runs_dir
    out = {}
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return {}
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        record = RunPaths(Path(entry.path)).record
        if record.is_file():
            continue  # a run (`run_ids`): its readers check its record
        try:
            mode = os.lstat(record).st_mode
        except FileNotFoundError:
            out[entry.name] = f"no {RUN_CONFIG} (the run's record)"
            continue
        except OSError as err:
            out[entry.name] = f"{RUN_CONFIG} unreadable ({err.strerror})"
            continue
        if not stat.S_ISREG(mode):
            out[entry.name] = f"{RUN_CONFIG} is {_kind(mode)}, not a file"
    return out


def read_status(path: Path) -> RunStatus:
    """A run folder's status; a run never started is pending. StoreError, one line, on a file
    gnsweep cannot have written (`RunStatus.from_json`), or on a FIFO, device or folder there."""
    file = RunPaths(path).status
    try:
        data = read_json(file)
    except StoreError:
        if file.exists() or file.is_symlink():
            raise
        return RunStatus()
    return RunStatus.from_json(data, file)


def write_status(path: Path, state: str, **changes: Any) -> RunStatus:
    """Move a run's status to `state` with `changes` (`RunStatus` fields), atomically; the
    previous attempt's error is dropped."""
    status = read_status(path).updated_with(RunState(state), **changes)
    write_json(RunPaths(path).status, status.to_json())
    return status


# ---- the results of `gnsweep analyze` -----------------------------------------------------

# The tables' columns and types live in `gnsweep.tables` (no analysis import from here).

GENERATION = "generation"
"""One analysis' id: in every results table's parquet metadata (b"gnsweep.generation") and in
fits.json; `read_result_tables` refuses a set whose ids differ (two analyses mixed)."""
_GENERATION_KEY = b"gnsweep." + GENERATION.encode()


def write_results(out_dir: Path, results: Any) -> None:
    """Every table of the results (a `gnsweep.analysis.results.Results`) and fits.json, as one
    generation: each stamped with one new id, all written to temporary names first and renamed
    into place only once every one is written (a full disk or a kill while writing leaves the
    previous set whole), then the previous analysis' optional tables this one has not are
    removed. A kill between the renames leaves a mix that `read_result_tables` refuses."""
    import uuid

    out_dir.mkdir(parents=True, exist_ok=True)
    folder = SweepPaths(out_dir)
    generation = uuid.uuid4().hex
    tables: dict[str, pa.Table] = {}
    for name in RESULT_TABLES:
        frame = getattr(results, name)
        if name in OPTIONAL_RESULTS and not len(frame):
            continue  # e.g. a sweep without adaptive runs gets no adaptive.parquet
        table = pa.Table.from_pandas(frame, schema=_schema_of(frame, RESULT_SCHEMAS[name]),
                                     preserve_index=False)
        tables[name] = table.replace_schema_metadata(
            {**(table.schema.metadata or {}), _GENERATION_KEY: generation.encode()})
    saved = {**results.to_json(), GENERATION: generation}
    with contextlib.ExitStack() as stack:
        # Entered in order, renamed in reverse (fits.json, the mark of an analysed folder,
        # first): every temporary file is whole before the first rename.
        written = {name: stack.enter_context(atomic_path(folder.result(name)))
                   for name in tables}
        for name, table in tables.items():
            pq.write_table(table, written[name])
        with atomic_path(folder.fits_json) as tmp:
            tmp.write_text(json.dumps(saved, indent=2, sort_keys=True, default=str) + "\n",
                           encoding="utf-8")
    for name in OPTIONAL_RESULTS:
        if name not in tables:
            folder.result(name).unlink(missing_ok=True)


def _schema_of(frame: Any, schema: pa.Schema) -> pa.Schema:
    """The table's schema for the frame's columns: declared types, inferred for the others."""
    inferred = pa.Schema.from_pandas(frame, preserve_index=False)
    return pa.schema([schema.field(f.name) if f.name in schema.names else f for f in inferred])


def _family(kind: pa.DataType) -> str:
    if pa.types.is_boolean(kind):
        return "booleans"
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return "numbers"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "text"
    return "null" if pa.types.is_null(kind) else str(kind)


def result_table_problem(name: str, table: pa.Table) -> str | None:
    """How a results table read from a folder breaks its schema (`tables.RESULT_SCHEMAS`), None
    when it does not: a key column missing (`tables.RESULT_KEYS`), a column holding another kind
    of value than its schema says (text where numbers belong, say), a target or batch size that
    is not a finite number."""
    import numpy as np

    schema = RESULT_SCHEMAS.get(name)
    if schema is None:
        return None
    missing = [c for c in RESULT_KEYS.get(name, ()) if c not in table.column_names]
    if missing:
        return f"no {missing[0]} column"
    for column in table.schema:
        if column.name not in schema.names:
            continue
        want, have = _family(schema.field(column.name).type), _family(column.type)
        if have not in (want, "null") and not (want == "numbers" and have == "booleans"):
            return f"its {column.name} column holds {have}, not {want}"
    for key in ("target", "batch_size"):
        if key in table.column_names and table.num_rows:
            values = table.column(key).to_numpy(zero_copy_only=False).astype(float)
            if not np.isfinite(values).all():
                return f"a {key} that is not a finite number"
            if key == "batch_size" and (values <= 0).any():
                return "a batch_size that is not positive"
    return None


def read_result_tables(sweep_dir: Path) -> dict[str, Any]:
    """The tables and fits.json an analysis wrote into a sweep folder, as plain data: each table
    present by name (a DataFrame; steps, front and fits must exist, the others are left out
    where an older version did not write them), `warnings` and `meta` from fits.json.
    `gnsweep.folder.read_results` makes them one `Results`. StoreError when the files
    come from two analyses (their generation ids differ): never a mix read in silence."""
    generations: dict[str, str | None] = {}
    folder = SweepPaths(sweep_dir)
    fits_json = folder.fits_json

    def frame(name: str) -> Any:
        path = folder.result(name)
        try:
            table = read_table(path)
            generations[path.name] = (table.schema.metadata or {}).get(
                _GENERATION_KEY, b"").decode(errors="replace") or None
        except StoreError as err:
            raise StoreError(f"{err}; run the `gnsweep analyze` that wrote it again (it "
                             "rewrites the table)") from None
        problem = result_table_problem(name, table)
        if problem:
            raise StoreError(f"{path}: not a {name} table of gnsweep ({problem}); run "
                             "`gnsweep analyze` again (it rewrites the table)")
        try:
            return table.to_pandas()
        except (pa.ArrowException, ValueError, TypeError) as err:
            raise StoreError(f"{path}: unreadable as a results table "
                             f"({(str(err).strip().splitlines() or [type(err).__name__])[0]}); "
                             "run `gnsweep analyze` again (it rewrites the table)") from None

    out: dict[str, Any] = {name: frame(name) for name in ("steps", "front", "fits")}
    for name in ("lr_fits", "loss_scaling", "temperature", *OPTIONAL_RESULTS):
        if os.path.lexists(folder.result(name)):
            out[name] = frame(name)
    out["warnings"], out["meta"] = [], {}
    if os.path.lexists(fits_json):
        saved = read_json(fits_json)
        if not isinstance(saved, dict):
            raise StoreError(f"{fits_json}: not an analysis' fits.json (a JSON "
                             "object); run `gnsweep analyze` again (it rewrites it)")
        warnings, meta = saved.get("warnings", []), saved.get("meta") or {}
        if not isinstance(warnings, list) or not isinstance(meta, dict):
            raise StoreError(f"{fits_json}: its warnings are not a list or its "
                             "meta not an object; run `gnsweep analyze` again (it rewrites it)")
        out["warnings"], out["meta"] = [str(w) for w in warnings], dict(meta)
        generation = saved.get(GENERATION)
        generations[fits_json.name] = generation if isinstance(generation, str) else None
    if len(set(generations.values())) > 1:
        groups: dict[str | None, list[str]] = {}
        for name, generation in generations.items():
            groups.setdefault(generation, []).append(name)
        parts = sorted(groups.values(), key=len, reverse=True)
        raise StoreError(
            f"{sweep_dir}: its results come from {len(parts)} different analyses ("
            + "; ".join(", ".join(names) for names in parts)
            + "): an analysis was cut short between its files; run `gnsweep analyze "
            f"{sweep_dir}` again (it rewrites them all)")
    return out
