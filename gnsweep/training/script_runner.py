"""One run of `task=script`: the user's command, started as a process, its log read as the run's
metrics.

The executors take, record and retry a script run exactly as a task's (`executors.run_taken`
calls `run_script` in place of `training.train`). Here:

- the command is split like a shell would and started without one, in the folder the sweep
  was launched from, its placeholders filled and the same values in GNSWEEP_* variables
  (`command`); under `executor=torchrun` it is started by torchrun (`torchrun_args`);
- its rows come from the lines it prints (`task.log_pattern`), from the CSV/JSON-lines file it
  writes (`task.log_file`), or from `gnsweep.current_run().log(...)` (a JSON-lines file in the
  run folder); each is checked (`RowLog.add`) and written to the run's metrics parts as it
  arrives, so that `gnsweep status`, the stall watchdog and a live analyze see it;
- once the hardest target is reached (the analysis's centred reading, as the training loop
  stops) or the budget spent, or when the worker is asked to stop (Ctrl-C, a preemption), the
  command is asked to stop: a flag `current_run().should_stop()` reads, then SIGTERM to its
  process group, then SIGKILL after `task.stop_seconds`;
- a relaunch, retry or requeue starts the command again (`{resume}`, `task.resume_args`): its
  first row may go back to the step its checkpoint holds, and the rows after it are replaced,
  so the metrics are those of an uninterrupted run. Steps going back at any other time are
  refused, naming the file and line.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import regex

from gnsweep import redact, store, tables
from gnsweep.config import Config
from gnsweep.errors import ConfigError, ScriptFailed, StopRequested
from gnsweep.paths import RunPaths
from gnsweep.runs import RunSpec
from gnsweep.tasks import about
from gnsweep.tasks.script import (
    ENV_PREFIX,
    EPOCH_COLUMNS,
    PLACEHOLDERS,
    REQUIRED,
    ScriptOptions,
    command_args,
    fill,
    log_format,
    match_row,
    microbatch_size,
    pattern_columns,
)
from gnsweep.training import process_tree, script_noise
from gnsweep.training.epochs import EpochError, EpochSteps
from gnsweep.training.log_reader import MAX_LINE_BYTES, LineReader, read_lines, skipped
from gnsweep.training.loop import RunResult
from gnsweep.training.stop_rule import analysis_reached, stop_step
from gnsweep.training.watch import Diverged, LossWatch

API_ROWS = store.SCRIPT_ROWS
STOP_FLAG = store.SCRIPT_STOP
POLL_S = 0.05
FLUSH_S = 0.5
"""Rows reach the run's metrics parts at least this often (and at every stop): a worker
killed with -9 loses at most the rows of its last half second."""
DRAIN_LINES = 256
"""Lines of output handled between two looks at the flush, the stop and the process: a command
that prints faster than they are read must not keep its rows from the disk."""
COMPACT_PARTS = 64
"""Once a run has this many metrics parts they are rewritten as one (a long run flushes
thousands of times; a reader reads every part)."""
BAD_INPUT_EXITS = (2, 126, 127)
"""Exit statuses that say the command was given bad input, which every attempt repeats: a
usage error (argparse, getopt and Python's own `can't open file` exit 2), a program that
cannot be executed (126) or found (127, a shell's). Any other failure may pass on a retry."""
MAX_COUNT = 2**53
"""The largest step or examples count a row may hold: beyond it a float no longer holds each
whole number (and int64 soon overflows)."""


def placeholder_values(config: Config, spec: RunSpec, run_path: Path, resume_step: int,
                       attempt: int) -> dict[str, Any]:
    """The value of every placeholder (`tasks.script.PLACEHOLDERS`) for this attempt."""
    sweep = config.sweep
    run_path = run_path.resolve()
    values: dict[str, Any] = {
        "batch_size": spec.batch_size, "learning_rate": spec.learning_rate, "seed": spec.seed,
        "run_dir": str(run_path), "max_examples": sweep.max_examples,
        "max_steps": sweep.max_steps, "run_id": spec.run_id,
        "sweep_dir": str(store.sweep_of(run_path)),
        # sweep.targets=auto: none (the analysis chooses them; the run trains its budget).
        "targets": ",".join(f"{t:g}" for t in sweep.targets),
        "target": (about(config.task).hardest(sweep.targets) if sweep.stops_at_target
                   else ""),
        "checkpoint_dir": str(RunPaths(run_path).checkpoints),
        "resume": int(resume_step > 0), "resume_step": resume_step, "attempt": attempt}
    accumulation = ScriptOptions(**config.task.options).accumulation
    try:
        values.update(accumulation=accumulation,
                      microbatch_size=microbatch_size(spec.batch_size, accumulation))
    except ConfigError as err:
        raise ScriptFailed(str(err)) from None
    assert set(values) == set(PLACEHOLDERS)
    return values


def environment(values: dict[str, Any], config: Config, options: ScriptOptions) -> dict[str, str]:
    """The command's environment: this process's, the placeholders as GNSWEEP_<NAME>, what
    `gnsweep.current_run()` reads, unbuffered Python output (rows arrive as they are printed)
    and, unless set, the executor's threads per worker."""
    env = dict(os.environ)
    env.update({ENV_PREFIX + name.upper(): str(value) for name, value in values.items()})
    env[ENV_PREFIX + "EXAMPLES_PER_SAMPLE"] = repr(options.examples_per_sample)
    env[ENV_PREFIX + "LOG_SOURCE"] = source_of(options)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", str(config.executor.threads_per_worker))
    env.update(script_noise.probe_environment(  # B_simple measured inside the script
        config, values, options.examples_per_sample, options.accumulation,
        Path(values["run_dir"])))
    return env


def source_of(options: ScriptOptions) -> str:
    """Where the rows come from: pattern, file or api."""
    return "pattern" if options.log_pattern else "file" if options.log_file else "api"


def torchrun_args(args: list[str], nproc: int) -> list[str]:
    """`args` started by torchrun with `nproc` processes on this machine (the script does its
    own DDP): `python train.py ...` -> `python -m torch.distributed.run --standalone
    --nproc_per_node=N train.py ...` (the same interpreter, so the same environment); any
    other program with torchrun's `--no-python`."""
    head = Path(args[0]).name
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if head.startswith("python") and len(args) > 1:
        return [args[0], *launcher, *args[1:]]
    return [sys.executable, *launcher, "--no-python", *args]


def command(config: Config, values: dict[str, Any]) -> list[str]:
    """The attempt's arguments: `task.command` filled, `task.resume_args` on a resume, under
    torchrun for executor=torchrun, and for executor=slurm with nproc_per_node > 1 (on the
    job's node)."""
    options = ScriptOptions(**config.task.options)
    args = command_args(options.command, "task.command", values)
    if values["resume"] and options.resume_args:
        args += command_args(options.resume_args, "task.resume_args", values)
    executor = config.executor
    if executor.kind == "torchrun" or (executor.kind == "slurm" and executor.nproc_per_node > 1):
        args = torchrun_args(args, executor.nproc_per_node)
    return args


# ---- reading the rows ---------------------------------------------------------------------


class TableLog:
    """A CSV or JSON-lines log as raw rows (metrics column -> text or number), columns mapped
    by `task.columns`."""

    def __init__(self, path: Path, fmt: str, columns: dict[str, str], *,
                 skip_existing: bool) -> None:
        self.reader = LineReader(path, skip_existing=skip_existing)
        self.path, self.fmt, self.columns = path, fmt, columns
        self.header: list[str] | None = None
        self.seen: list[str] = []
        """The names the log had (for a message when no row could be read)."""
        if fmt == "csv" and skip_existing and self.reader.inode is not None:
            with contextlib.suppress(OSError), open(path, "rb") as handle:
                first = handle.readline(MAX_LINE_BYTES + 1)
                if first.endswith(b"\n"):
                    self._set_header(first.decode("utf-8", "replace"))

    def _set_header(self, line: str) -> None:
        try:
            self.header = next(csv.reader([line.strip()]))
        except csv.Error as err:
            raise ScriptFailed(f"{self.path}: its header is not a CSV row ({err})") from None
        self.seen = self.header
        names = set(self.header)
        for column, name in self.columns.items():
            if name not in names:
                raise ScriptFailed(f"{self.path}: no column {name!r} (task.columns maps "
                                   f"{column} to it); its columns: {', '.join(self.header)}")
        for column in REQUIRED:
            if self.columns.get(column, column) not in names:
                raise ScriptFailed(f"{self.path}: no column {column!r}; its columns: "
                                   f"{', '.join(self.header)}; map one with "
                                   f"task.columns={{{column}:NAME}}")

    def rows(self) -> Iterator[tuple[str, dict[str, Any], bool]]:
        """New rows: (where, the row's metrics columns, whether the file started over)."""
        for number, line, restarted in self.reader.lines():
            where = f"{self.path}:{number}"
            if restarted and self.fmt == "csv":
                self.header = None
            if not line.strip():
                continue
            if self.fmt == "csv":
                if self.header is None:
                    self._set_header(line)
                    continue
                try:
                    cells = next(csv.reader([line]))
                except csv.Error as err:
                    raise ScriptFailed(f"{where}: not a CSV row ({err})") from None
                record: dict[str, Any] = dict(zip(self.header, cells, strict=False))
            else:
                try:
                    record = json.loads(line)
                except RecursionError:
                    raise ScriptFailed(f"{where}: a JSON value nested too deep to read") from None
                except ValueError:
                    raise ScriptFailed(f"{where}: not a JSON object (task.log_file is read as "
                                       "JSON lines; set task.log_format=csv for a CSV)") from None
                if not isinstance(record, dict):
                    raise ScriptFailed(f"{where}: not a JSON object")
                self.seen = self.seen or list(record)
            yield where, self._mapped(record), restarted

    def _mapped(self, record: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for column in (*tables.METRICS_SCHEMA.names, *EPOCH_COLUMNS):
            name = self.columns.get(column, column)
            if name in record and record[name] not in ("", None):
                out[column] = record[name]
        return out


class RowLog:
    """The run's rows: checked, completed (examples, smoothed loss, wall time), written to its
    metrics parts, and the reason to stop once it has one (target, budget, diverged)."""

    def __init__(self, config: Config, spec: RunSpec, run_path: Path, kept: dict[str, list],
                 options: ScriptOptions, epochs: EpochSteps | None = None) -> None:
        self.config, self.spec, self.path = config, spec, run_path
        self.source = source_of(options)
        self.epochs = epochs or EpochSteps()
        """Each epoch's offset, learned from every attempt's rows (a counter that restarts
        every epoch)."""
        self.said = len(self.epochs.notes)
        self.rows = _columns(kept)
        self.flushed = len(kept["step"])
        self.parts = 1
        self.kept_step = int(kept["step"][-1]) if kept["step"] else 0
        self.first = True  # the attempt's first row may go back (a resume)
        self.per_sample = options.examples_per_sample
        self.step_offset = options.step_offset
        self.hardest = None if not config.sweep.stops_at_target \
            else about(config.task).hardest(config.sweep.targets)
        self.direction = about(config.task).direction
        self.stop_at: int | None = None
        self.reason: str | None = None
        self.diverged: str | None = None
        self.started = time.monotonic()
        self.wall_before = float(kept["wall_time"][-1]) if kept["step"] else 0.0
        self.last_flush = time.monotonic()
        self.watch = LossWatch(config.sweep.loss_ema_examples, config.sweep.divergence_factor)
        self._replay()

    def _replay(self) -> None:
        """The smoothed loss of the rows kept from earlier attempts, as they were logged."""
        self.watch = LossWatch(self.config.sweep.loss_ema_examples,
                               self.config.sweep.divergence_factor)
        before = 0
        for step, examples, loss in zip(self.rows["step"], self.rows["examples"],
                                        self.rows["loss"], strict=True):
            with contextlib.suppress(Diverged):
                self.watch.update(float(loss), max(1, int(examples) - before), int(step))
            before = int(examples)

    def add(self, where: str, raw: dict[str, Any]) -> dict[str, float] | None:
        """Check and append one row (None: the run already has its reason to stop, or the row
        has no loss). ScriptFailed names `where` for a row that cannot be read."""
        if self.reason is not None or "loss" not in raw:
            return None
        values: dict[str, float] = {}
        for name, value in raw.items():
            try:
                values[name] = float(value)
            except (TypeError, ValueError):
                raise ScriptFailed(f"{where}: {name} {str(value)[:40]!r} is not a number") \
                    from None
        if "step" not in values:
            raise ScriptFailed(f"{where}: a row without its step")
        for name in ("step", "examples"):  # whole numbers the metrics store as int64
            if name in values and abs(values[name]) > MAX_COUNT:
                raise ScriptFailed(f"{where}: {name} {str(raw[name])[:40]} is beyond range (at "
                                   f"most {MAX_COUNT:.0e})")
        step = values["step"]
        if not (math.isfinite(step) and step == int(step)):
            raise ScriptFailed(f"{where}: step {raw['step']!r} is not a whole number")
        step = int(step) + self.step_offset
        if "epoch" in values:
            step = self._global_step(where, values, step)
        if step < 1:
            raise ScriptFailed(f"{where}: step {step}; steps count optimizer steps from 1 (the "
                               "loss of the first step's batch is step 1's): a script that "
                               "counts from 0 needs task.step_offset=1")
        last = int(self.rows["step"][-1]) if self.rows["step"] else 0
        if step <= last:
            if not self.first:
                raise ScriptFailed(f"{where}: steps go backwards (step {step} after step {last}) "
                                   f"outside a resume; a run's steps must grow{self._fix(values)}")
            self._resume_at(step)
        elif self.first and last and step > last + 1:
            # Resumed from a checkpoint ahead of the rows on disk (the worker was killed before
            # it wrote them): those steps have no rows. Said, never silent.
            print(f"gnsweep: run {self.path.name}: steps {last + 1}-{step - 1} have no rows: the "
                  "run was stopped before it wrote them and its command resumed from a later "
                  "checkpoint", file=sys.stderr, flush=True)
        self.first = False
        batch = self.spec.batch_size
        examples = int(values["examples"]) if "examples" in values and math.isfinite(
            values["examples"]) else round(step * batch * self.per_sample)
        before = int(self.rows["examples"][-1]) if self.rows["step"] else 0
        loss = values["loss"]
        row: dict[str, float] = {name: math.nan for name in tables.METRICS_SCHEMA.names}
        row.update(values)
        if not math.isfinite(row.get("batch_size", math.nan)):
            row["batch_size"] = batch
        row.update(step=step, examples=examples)
        if not math.isfinite(row["wall_time"]):
            row["wall_time"] = self.wall_before + time.monotonic() - self.started
        try:
            row["loss_smooth"] = self.watch.update(loss, max(1, examples - before), step)
        except Diverged as err:
            self.diverged = str(err)
            self.reason = "diverged"
        self._append(row)
        if self.reason is None:
            self._check_done(step, examples)
        return row

    def _global_step(self, where: str, values: dict[str, float], step: int) -> int:
        """The run's step of a row whose step counts within its epoch."""
        epoch, total = values["epoch"], values.get("total")
        for name, value in (("epoch", epoch), ("total", total)):
            if value is not None and not (math.isfinite(value) and value == int(value)):
                raise ScriptFailed(f"{where}: {name} {value!r} is not a whole number")
        try:
            step = self.epochs.step(int(epoch), step, None if total is None else int(total))
        except EpochError as err:
            raise ScriptFailed(f"{where}: {err}") from None
        for note in self.epochs.notes[self.said:]:
            print(f"gnsweep: run {self.path.name}: {note}", file=sys.stderr, flush=True)
        self.said = len(self.epochs.notes)
        return step

    def _fix(self, values: dict[str, float]) -> str:
        """How to read a step counter that restarts every epoch, where the log has no epoch."""
        if "epoch" in values:
            return ""
        if self.source == "pattern":
            return ("; a step counter that restarts every epoch needs an epoch group in "
                    "task.log_pattern, e.g. 'epoch (?P<epoch>\\d+)' (and (?P<total>\\d+) for "
                    "the steps an epoch has, where the script prints it)")
        if self.source == "file":
            return ("; a step counter that restarts every epoch needs an epoch column in the "
                    "log file (task.columns={epoch:NAME} where it has another name; a total "
                    "column for the steps an epoch has)")
        return "; log the run's step, counted over the whole run, not within an epoch"

    def _resume_at(self, step: int) -> None:
        """The attempt's first row is at `step`: the rows from it on are replaced (on disk
        too)."""
        self.flush(force=True)
        self.rows = _columns(store.clear_metrics(self.path, step - 1))
        self.flushed = len(self.rows["step"])
        self.stop_at = None
        self._replay()

    def _append(self, row: dict[str, float]) -> None:
        for name in tables.METRICS_SCHEMA.names:
            value = row[name]
            column = self.rows[name]
            if isinstance(column, _Blank):
                if math.isnan(value):
                    column.n += 1
                    continue
                column = self.rows[name] = array("d", [math.nan]) * column.n
            column.append(int(value) if name in ("step", "examples") else float(value))

    def _check_done(self, step: int, examples: int) -> None:
        sweep = self.config.sweep
        smooth = self.rows["loss_smooth"][-1]
        if self.hardest is not None and self.stop_at is None \
                and self.direction.reached(smooth, self.hardest):
            self.stop_at = stop_step(step, self.spec.batch_size)
        if self.stop_at is not None and self.hardest is not None and step >= self.stop_at:
            if analysis_reached(self.rows["step"], self.rows["loss"], self.hardest,
                                self.spec.batch_size):
                self.reason = "target"
                return
            self.stop_at = None  # the centred reading has not crossed: look again later
        if sweep.max_examples and examples >= sweep.max_examples:
            self.reason = "max_examples"
        elif step >= sweep.max_steps:
            self.reason = "max_steps"

    def flush(self, force: bool = False) -> None:
        """The rows not yet on disk as one more metrics part (every `FLUSH_S`, or `force`)."""
        if len(self.rows["step"]) == self.flushed:
            return
        if not force and time.monotonic() - self.last_flush < FLUSH_S:
            return
        store.write_metrics_part(self.path, self.rows, self.flushed)
        self.flushed = len(self.rows["step"])
        self.last_flush = time.monotonic()
        self.parts += 1
        if self.parts >= COMPACT_PARTS:
            store.compact_metrics(self.path)  # the same rows, one part
            self.parts = 1


class _Blank:
    """A metrics column with no value yet (NaN in every row): its length only. Most of the
    metrics columns (the noise scale's) stay blank in a script run."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return np.full(len(range(*index.indices(self.n))), math.nan)
        if not -self.n <= index < self.n:
            raise IndexError(index)
        return math.nan

    def __iter__(self) -> Iterator[float]:
        return iter([math.nan] * self.n)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.full(self.n, math.nan, dtype=dtype or float)


def _columns(rows: dict[str, list]) -> dict[str, Any]:
    """Rows by column as packed arrays (8 bytes a value, not a Python object each) and the
    columns without a value as their length alone: a script that logs a million rows keeps
    them in tens of megabytes, not gigabytes."""
    out: dict[str, Any] = {}
    for name in tables.METRICS_SCHEMA.names:
        values = [math.nan if v is None else v for v in rows.get(name, ())]
        if name in ("step", "examples"):
            out[name] = array("q", values)
        elif all(math.isnan(v) for v in values):
            out[name] = _Blank(len(values))
        else:
            out[name] = array("d", values)
    return out


# ---- the process ---------------------------------------------------------------------------


Line = tuple[str, int, str, bool]
"""A printed line: stdout or stderr, its number, its text, whether it was cut (too long)."""
QUEUED_LINES = 4096
"""Lines read but not yet handled, at most: a command that prints faster than its lines are
handled waits on its pipe, instead of the worker's memory growing with its output."""


def _pump(stream: IO[bytes], name: str, lines: queue.Queue[Line | None]) -> None:
    for number, (line, cut) in enumerate(read_lines(stream), 1):
        lines.put((name, number, line, cut))
    lines.put(None)


class Child:
    """The command's process tree: the command under its guard (`process_tree.GUARD`), in a
    process group of its own, its output pumped into `lines`."""

    def __init__(self, args: list[str], cwd: str, env: dict[str, str], grace: float) -> None:
        self.lines: queue.Queue[Line | None] = queue.Queue(QUEUED_LINES)
        if shutil.which(args[0], path=env.get("PATH")) is None and not Path(cwd, args[0]).is_file():
            raise ScriptFailed(f"cannot start {args[0]}: command not found", repeats=True)
        self.grace = grace
        try:
            self.process = subprocess.Popen(
                process_tree.guarded(args, grace), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=process_tree.die_with_parent if sys.platform.startswith("linux")
                else None)
        except OSError as err:  # not found, not executable: every attempt alike
            raise ScriptFailed(f"cannot start {args[0]}: {err.strerror or err}",
                               repeats=True) from None
        self.open = 2
        for stream, name in ((self.process.stdout, "stdout"), (self.process.stderr, "stderr")):
            threading.Thread(target=_pump, args=(stream, name, self.lines), daemon=True).start()
        self.asked: float | None = None
        self.termed: float | None = None
        self.left: float | None = None  # when the command exited, leaving its group behind

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def exited(self) -> bool:
        """Whether the command (its guard) has exited. Not reaped yet: until then its pid,
        and so its group's id, cannot be another process's."""
        if self.process.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.process.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def ended(self) -> bool:
        """Whether the run's command is over: it exited and its output is read. What it left
        in its group (a helper holding its stdout) is ended then, SIGKILL `grace` s after
        SIGTERM: the command's own exit ends the run."""
        if not self.exited():
            return False
        now = time.monotonic()
        if self.left is None:
            self.left = now
            self.signal(signal.SIGTERM)
        if now - self.left >= self.grace or self.open == 0:
            self.signal(signal.SIGKILL)  # before the guard is reaped: its group id is still ours
        if self.open > 0:
            return False
        self.process.wait()
        return True


def run_script(config: Config, spec: RunSpec, out_dir: Path | None,
               should_stop: Callable[[], bool] | None = None,
               on_row: Callable[[dict[str, float]], None] | None = None) -> RunResult:
    """Run the sweep's command for one run (its folder `out_dir`) and record its rows.

    Returns done (the target reached, the budget spent, or the command ended by itself after
    logging rows) or diverged (a NaN/inf loss, or the smoothed loss far above the first).
    Raises ScriptFailed (a failed run: the command exited non-zero, with its last stderr lines;
    logged no row; a row that cannot be read) and StopRequested when `should_stop()` says so
    (the command is stopped; the run goes back to pending with its rows kept)."""
    if out_dir is None:
        raise ValueError("a script run is started by one process, which writes its folder")
    options = ScriptOptions(**config.task.options)
    cwd = options.cwd or os.getcwd()
    attempt = max(1, int(store.read_status(out_dir).get("attempts", 1)))
    # An earlier attempt's command still running (its worker was killed and its guard is in
    # its grace, or a relaunch came first): ended before this one starts, never two writers.
    if process_tree.end_earlier(out_dir / store.SCRIPT_PROCESS, options.stop_seconds):
        print(f"gnsweep: run {out_dir.name}: an earlier attempt's command was still running; "
              "it was ended first", file=sys.stderr, flush=True)
    kept = store.clear_metrics(out_dir, _last_step(out_dir))
    pattern = pattern_columns(options.log_pattern) if options.log_pattern else None
    # The rows an earlier attempt logged but did not write to disk before it was killed: its
    # output, log file or API rows hold them (and where each epoch of theirs began).
    epochs = EpochSteps()
    lost = recovered(options, placeholder_values(config, spec, out_dir, 0, attempt), cwd,
                     out_dir, pattern, int(kept["step"][-1]) if kept["step"] else 0, epochs)
    rows = RowLog(config, spec, out_dir, kept, options, epochs)
    for where, raw in lost:
        try:
            rows.add(where, raw)
        except ScriptFailed:
            break
    rows.first = True  # this attempt's first row may go back to its command's checkpoint
    rows.flush(force=True)
    if rows.reason is not None:  # the earlier attempt had reached it already
        return _finished(rows, out_dir)
    last = int(rows.rows["step"][-1]) if rows.rows["step"] else 0
    values = placeholder_values(config, spec, out_dir, last, attempt)
    args = command(config, values)
    env = environment(values, config, options)
    for name in (API_ROWS, STOP_FLAG):
        (out_dir / name).unlink(missing_ok=True)
    table = _table_log(options, values, cwd, out_dir)
    stderr: deque[str] = deque(maxlen=max(1, options.stderr_lines))
    outputs = {name.removesuffix(".log"): store.open_nofollow(
        out_dir / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT) for name in store.SCRIPT_OUTPUT}
    for fd in outputs.values():
        os.write(fd, f"--- gnsweep attempt {attempt}: {redact.text(shlex.join(args))}\n"
                 .encode())
    child = Child(args, cwd, env, options.stop_seconds)
    process_tree.record(out_dir / store.SCRIPT_PROCESS, child.process.pid)
    probe = script_noise.ProbeRows(out_dir, options.examples_per_sample) \
        if script_noise.measures(config) else None
    stopped = False
    error: ScriptFailed | None = None

    def take(where: str, raw: dict[str, Any], restarted: bool = False) -> None:
        if restarted:  # the log file was rewritten from its start: like a resume
            rows.first = True
        row = rows.add(where, raw)
        if row is not None and on_row is not None:
            on_row(row)

    try:
        while True:
            item: Any
            try:
                item = child.lines.get(timeout=POLL_S)
            except queue.Empty:
                item = ()
            try:
                drained = 0
                while item != ():
                    if item is None:
                        child.open -= 1
                    else:
                        name, number, line, cut = item
                        os.write(outputs[name], (line + "\n").encode("utf-8", "replace"))
                        if cut:
                            skipped(f"{name} line {number}")
                        elif name == "stderr":
                            stderr.append(line)
                        if pattern is not None and error is None and not cut:
                            found = match_row(pattern, line, f"{name} line {number}")
                            if found is not None:
                                take(f"{name} line {number}", found)
                    drained += 1
                    if drained >= DRAIN_LINES:  # flush and look at the stop now and then
                        break
                    try:
                        item = child.lines.get_nowait()
                    except queue.Empty:
                        item = ()
                if table is not None and error is None:
                    for where, raw, restarted in table.rows():
                        take(where, raw, restarted)
            except ScriptFailed as err:
                error = error or err
            if probe is not None:  # the probe's B_simple joins the rows not yet on disk
                probe.join(rows.rows, rows.flushed)
            rows.flush()
            if child.ended():
                break
            stop = should_stop is not None and should_stop()
            stopped = stopped or (stop and rows.reason is None)
            if child.asked is None and (stop or rows.reason is not None or error is not None):
                _ask_to_stop(child, out_dir)
            _escalate(child, options.stop_seconds, out_dir)
        if table is not None and error is None:  # what it wrote last
            try:
                for where, raw, restarted in table.rows():
                    take(where, raw, restarted)
            except ScriptFailed as err:
                error = err
    except BaseException:
        _kill(child)
        rows.flush(force=True)
        raise
    finally:
        for fd in outputs.values():
            os.close(fd)
        with contextlib.suppress(OSError):
            (out_dir / STOP_FLAG).unlink(missing_ok=True)  # the command has ended
            if child.process.returncode is not None:
                (out_dir / store.SCRIPT_PROCESS).unlink(missing_ok=True)
    rows.flush(force=True)
    if error is not None:  # the output broke a parse rule: it would again
        raise ScriptFailed(str(error), list(stderr), repeats=True)
    if stopped:
        raise StopRequested
    code = child.process.returncode
    if rows.reason is None:
        if code != 0:
            said = next((line for line in reversed(stderr) if line.strip()), "")
            raise ScriptFailed(f"exit status {code}"
                               + (f": {said.strip()[:300]}" if said else ""), list(stderr),
                               repeats=code in BAD_INPUT_EXITS)
        if not rows.rows["step"]:  # it ended well but logged nothing readable: it would again
            raise ScriptFailed(_no_rows(options, table), list(stderr), repeats=True)
    return _finished(rows, out_dir)


def _finished(rows: RowLog, out_dir: Path) -> RunResult:
    """The run's end: metrics.parquet written, its result."""
    reason = rows.reason or "script ended"
    state = "diverged" if rows.diverged else "done"
    measured = script_noise.finish(rows.config, out_dir, rows.rows, rows.per_sample)
    rows.flush(force=True)
    if measured.get("method") == "inscript":  # the probe's late rows joined rows on disk too
        store.end_metrics(out_dir, {name: values[0:] for name, values in rows.rows.items()})
    else:
        store.end_parts(out_dir)  # from the parts on disk, part by part: not the run whole
    logged = rows.rows["step"]
    return RunResult(state, int(logged[-1]) if logged else 0,
                     rows.diverged if rows.diverged else reason,
                     float(rows.rows["loss"][-1]) if logged else math.nan,
                     rows.wall_before + time.monotonic() - rows.started,
                     measured, script_noise.nan_share(measured, rows.rows),
                     rows=len(logged), examples=int(rows.rows["examples"][-1])
                     if logged else None)


def recovered(options: ScriptOptions, values: dict[str, Any], cwd: str, run_path: Path,
              pattern: regex.Pattern[str] | None, after: int,
              epochs: EpochSteps | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Rows after step `after` that earlier attempts logged but never wrote to the run's
    metrics (a worker killed with -9 between two flushes): from the run's stdout.log and
    stderr.log (`task.log_pattern`), the log file, or the API's rows file. Read as the run
    reads them live (a step going back replaces the rows from it on: a resume), so that they
    are the rows of an uninterrupted run. `epochs` learns where each epoch of theirs began
    (a step counter that restarts every epoch)."""
    epochs = epochs if epochs is not None else EpochSteps()
    found: list[tuple[str, dict[str, Any]]] = []
    try:
        if pattern is not None:
            for name in store.SCRIPT_OUTPUT:
                with contextlib.suppress(OSError):
                    reader = LineReader(run_path / name, skip_existing=False)
                    found = [(where, raw) for number, line, _ in reader.lines()
                             if not line.startswith("--- gnsweep attempt")
                             and (raw := match_row(pattern, line,
                                                   where := f"{run_path / name}:{number}"))
                             is not None]
                if found:
                    break
        else:
            table = _table_log(options, values, cwd, run_path, skip_existing=False)
            if table is not None:
                found = [(where, raw) for where, raw, _ in table.rows()]
    except ScriptFailed:
        return []
    effective: list[tuple[int, str, dict[str, Any]]] = []
    for where, raw in found:
        try:
            step = int(float(raw["step"])) + options.step_offset
            if "epoch" in raw:
                total = raw.get("total")
                step = epochs.step(int(float(raw["epoch"])), step,
                                   None if total is None else int(float(total)))
        except (KeyError, TypeError, ValueError, OverflowError):  # EpochError is a ValueError
            continue
        if "loss" not in raw:
            continue
        while effective and effective[-1][0] >= step:
            effective.pop()
        effective.append((step, where, raw))
    return [(where, raw) for step, where, raw in effective if step > after]


def _last_step(run_path: Path) -> int:
    """The last step the run has on disk from earlier attempts (0: none)."""
    last = store.last_metrics_row(run_path)
    return int(last["step"]) if last else 0


def _table_log(options: ScriptOptions, values: dict[str, Any], cwd: str, run_path: Path,
               skip_existing: bool = True) -> TableLog | None:
    """The log file (read from its end: its earlier lines are an earlier attempt's, unless
    `skip_existing` is False) or the API's rows file; None for printed lines."""
    if options.log_pattern:
        return None
    if options.log_file:
        name = fill(options.log_file, values, "task.log_file")
        path = Path(cwd, name)
        return TableLog(path, log_format(options, name), options.columns,
                        skip_existing=skip_existing)
    return TableLog(run_path / API_ROWS, "jsonl", {}, skip_existing=False)


def _ask_to_stop(child: Child, run_path: Path) -> None:
    """The flag `current_run().should_stop()` reads; a command that never made the handle
    (`current_run()` creates the rows file) gets SIGTERM at once."""
    store.write_text(run_path / STOP_FLAG, "stop\n")
    child.asked = time.monotonic()
    if not (run_path / API_ROWS).exists():
        child.termed = child.asked
        child.signal(signal.SIGTERM)


def _escalate(child: Child, grace: float, run_path: Path) -> None:
    """SIGTERM `grace` seconds after the flag, SIGKILL `grace` seconds after SIGTERM."""
    if child.asked is None or child.exited():
        return
    now = time.monotonic()
    if child.termed is None and now - child.asked >= grace:
        child.termed = now
        child.signal(signal.SIGTERM)
    elif child.termed is not None and now - child.termed >= grace:
        child.signal(signal.SIGKILL)


def _kill(child: Child) -> None:
    child.signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not child.exited() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    child.signal(signal.SIGKILL)  # the command's children too, before its pid is released
    child.process.wait()


def _no_rows(options: ScriptOptions, table: TableLog | None) -> str:
    if options.log_pattern:
        return ("the command ended without printing a line that task.log_pattern matches "
                f"({options.log_pattern!r}); its output is in the run's stdout.log and "
                "stderr.log")
    if options.log_file and table is not None:
        seen = f" (its columns: {', '.join(table.seen)})" if table.seen else \
            " (the file was not written)"
        return f"the command ended without writing a row with step and loss to {table.path}{seen}"
    return ("the command ended without logging a row: give task.log_pattern or task.log_file, "
            "or log with gnsweep.current_run().log(step, examples, loss)")
