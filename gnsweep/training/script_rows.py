"""A `task=script` run's rows: read from the file its command writes (`TableLog`), checked
and written to the run's metrics parts as they arrive (`RowLog`), with the stop at the hardest
target (`training.stop_rule`) and the budget."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import sys
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gnsweep import store, tables
from gnsweep.config import Config
from gnsweep.errors import ScriptFailed
from gnsweep.runs import RunSpec
from gnsweep.tasks import about
from gnsweep.tasks.script import (
    EPOCH_COLUMNS,
    REQUIRED,
    ScriptOptions,
)
from gnsweep.training.epochs import EpochError, EpochSteps
from gnsweep.training.log_reader import MAX_LINE_BYTES, LineReader
from gnsweep.training.script_command import source_of
from gnsweep.training.stop_rule import analysis_reached, stop_step
from gnsweep.training.watch import Diverged, LossWatch

FLUSH_S = 0.5
"""Rows reach the run's metrics parts at least this often (and at every stop): a worker
killed with -9 loses at most the rows of its last half second."""
COMPACT_PARTS = 64
"""Once a run has this many metrics parts they are rewritten as one (a long run flushes
thousands of times; a reader reads every part)."""
MAX_COUNT = 2**53
"""The largest step or examples count a row may hold: beyond it a float no longer holds each
whole number (and int64 soon overflows)."""


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
