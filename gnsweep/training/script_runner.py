"""One run of `task=script`: the user's command, started as a process, its log read as the run's
metrics.

The executors take, record and retry a script run exactly as a task's (`executors.run_taken`
calls `run_script` in place of `training.train`). Here, with its rooms beside it
(`script_command`: the command and its placeholders; `script_rows`: the rows read and written;
`script_process`: the child process and its signals):

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
import math
import os
import queue
import shlex
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import regex

from gnsweep import redact, store
from gnsweep.config import Config
from gnsweep.errors import ScriptFailed, StopRequested
from gnsweep.paths import RunPaths
from gnsweep.runs import RunSpec
from gnsweep.tasks.script import (
    ScriptOptions,
    fill,
    log_format,
    match_row,
    pattern_columns,
)
from gnsweep.training import process_tree, script_noise
from gnsweep.training.epochs import EpochSteps
from gnsweep.training.log_reader import LineReader, skipped
from gnsweep.training.loop import RunResult
from gnsweep.training.script_command import (
    command,
    environment,
    placeholder_values,
)
from gnsweep.training.script_process import (
    POLL_S,
    Child,
    _ask_to_stop,
    _escalate,
    _kill,
)
from gnsweep.training.script_rows import (
    RowLog,
    TableLog,
)

DRAIN_LINES = 256
"""Lines of output handled between two looks at the flush, the stop and the process: a command
that prints faster than they are read must not keep its rows from the disk."""
BAD_INPUT_EXITS = (2, 126, 127)
"""Exit statuses that say the command was given bad input, which every attempt repeats: a
usage error (argparse, getopt and Python's own `can't open file` exit 2), a program that
cannot be executed (126) or found (127, a shell's). Any other failure may pass on a retry."""
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
    paths = RunPaths(out_dir)
    if process_tree.end_earlier(paths.script_process, options.stop_seconds):
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
    for flag in (paths.script_rows, paths.script_stop):
        flag.unlink(missing_ok=True)
    table = _table_log(options, values, cwd, out_dir)
    stderr: deque[str] = deque(maxlen=max(1, options.stderr_lines))
    outputs = {path.stem: store.open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
               for path in paths.script_output}
    for fd in outputs.values():
        os.write(fd, f"--- gnsweep attempt {attempt}: {redact.text(shlex.join(args))}\n"
                 .encode())
    child = Child(args, cwd, env, options.stop_seconds)
    process_tree.record(paths.script_process, child.process.pid)
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
            paths.script_stop.unlink(missing_ok=True)  # the command has ended
            if child.process.returncode is not None:
                paths.script_process.unlink(missing_ok=True)
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
            for output in RunPaths(run_path).script_output:
                with contextlib.suppress(OSError):
                    reader = LineReader(output, skip_existing=False)
                    found = [(where, raw) for number, line, _ in reader.lines()
                             if not line.startswith("--- gnsweep attempt")
                             and (raw := match_row(pattern, line,
                                                   where := f"{output}:{number}"))
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
    return TableLog(RunPaths(run_path).script_rows, "jsonl", {}, skip_existing=False)


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
