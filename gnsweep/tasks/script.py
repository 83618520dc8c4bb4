"""`task=script`: the user's own training command as the sweep's run; its settings and the pure
parts of running it (placeholders, the log's pattern and columns). No torch, no processes: the
runner that starts the command lives in `gnsweep.training.script_runner`.

    gnsweep launch task=script task.command='python train.py --bs={batch_size}
        --lr={learning_rate} --seed={seed} --out={run_dir}'
        task.log_pattern='iter (?P<step>\\d+): loss (?P<loss>[-\\d.e]+)' sweep.batch_sizes=[...]

The command is split like a shell would (`shlex.split`) and run without a shell, once per grid
point, with every `{placeholder}` filled; the same values are in GNSWEEP_* environment
variables. Its metrics come from the lines it prints (`log_pattern`, a regular expression with
named groups `step` and `loss`), from a CSV or JSON-lines file it writes (`log_file`, columns
mapped by `columns`), or, with neither, from `gnsweep.current_run().log(...)`.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex

from gnsweep.config import SCRIPT
from gnsweep.errors import ConfigError, ScriptFailed

PLACEHOLDERS: dict[str, str] = {
    "batch_size": "the run's batch size (samples a step, the grid's B)",
    "learning_rate": "the run's learning rate",
    "seed": "the run's seed",
    "run_dir": "the run's folder (absolute): write checkpoints and logs here",
    "max_examples": "the run's budget in examples (the task's unit; 0: none)",
    "max_steps": "the run's budget in optimizer steps",
    "run_id": "the run's id (e.g. b00008_lr0.1_s0)",
    "sweep_dir": "the sweep folder (absolute)",
    "targets": "the sweep's loss targets, comma-separated (empty for sweep.targets=auto)",
    "target": "the hardest loss target (the run may stop once it is reached; empty for auto)",
    "checkpoint_dir": "<run_dir>/checkpoints (absolute), a place for the script's checkpoints",
    "resume": "1 when an earlier attempt of this run logged rows (resume from your checkpoint "
              "if you have one), else 0",
    "resume_step": "the last step the run has on record (0 for a fresh run)",
    "attempt": "which attempt of the run this is (1, 2 ...)",
    "microbatch_size": "the run's batch size over task.accumulation: samples a micro-batch",
    "accumulation": "task.accumulation: micro-batches a step",
}
"""Every placeholder a command (and `log_file`, `resume_args`) may hold, with its meaning; each
is also in the environment as GNSWEEP_<NAME upper-cased>."""

ENV_PREFIX = "GNSWEEP_"

LOG_FORMATS = ("auto", "csv", "jsonl")
MATCH_SECONDS = 1.0
"""The longest `task.log_pattern` may take on one line: a pattern that backtracks without end
(a nested repeat such as `(a+)+$`) fails the run naming the line, instead of holding it."""
MAX_FORMAT_WIDTH = 64
"""The largest width or precision a placeholder's format spec may give (`{seed:>8}`): a larger
one makes an argument nobody needs (`{seed:>1000000000}` is a 1 GB argument)."""
MAX_REPEAT = 100_000
"""The largest repetition count `task.log_pattern` may hold (`\\d{1,12}`)."""
REQUIRED = ("step", "loss")
"""The columns every row must have: the optimizer step and the training loss (batch mean)."""
EPOCH_COLUMNS = ("epoch", "total")
"""What a log may give beyond the metrics columns (a pattern's named groups, a log file's
columns): the epoch a row belongs to, whose `step` then counts within the epoch, and the steps
an epoch has (`gnsweep.training.epochs`)."""


@dataclass
class ScriptOptions:
    """The settings of `task=script` (the task node's keys: `task.command=...`)."""

    command: str = ""
    """The command run once per grid point, with `{placeholders}` (`PLACEHOLDERS`); split like
    a shell would and run without one, in `cwd`."""
    log_pattern: str = ""
    """A regular expression searched for in each line the command prints (stdout and stderr),
    with named groups `step` and `loss` and optionally other metrics columns (`examples`,
    `eval_loss`, `lr`, `grad_norm` ...), and `epoch` (the step then counts within its epoch)
    with `total` (the steps an epoch has). Lines that do not match are ignored. Python's `re`
    syntax, matched by the `regex` package with a time limit a line (`MATCH_SECONDS`)."""
    log_file: str = ""
    """A CSV (header line first) or JSON-lines file the command writes, one row a line; may
    hold placeholders (`{run_dir}/log.csv`); relative to `cwd`."""
    log_format: str = "auto"
    """The format of `log_file`: csv, jsonl, or auto (by its suffix: .jsonl/.json/.ndjson are
    JSON lines, anything else CSV)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Metrics column -> the log's own name for it, e.g. {step: iter, loss: train_loss}; a
    column not mapped is read under its own name where the log has it."""
    step_offset: int = 0
    """Added to every logged step: steps count optimizer steps from 1 (a row's loss is that of
    the step's batch), so a script that counts from 0 (nanoGPT's `iter 0`) needs 1."""
    examples_per_sample: float = 1.0
    """What one sample (one unit of the batch size) counts in `unit`: tokens a sequence for a
    language model. Examples are step x batch_size x this where the log has no examples."""
    unit: str = "examples"
    """What examples count (examples, tokens ...): B_crit and E_min are reported in it."""
    resume_args: str = ""
    """Arguments appended to the command when an earlier attempt of the run logged rows (a
    relaunch, a retry, a requeue), e.g. `--init_from=resume`; may hold placeholders."""
    stop_seconds: float = 10.0
    """How long a command asked to stop (a target reached, the budget spent, Ctrl-C, a
    preemption) has to exit on SIGTERM before it is killed."""
    stderr_lines: int = 20
    """How many of a failed command's last stderr lines its status.json keeps."""
    cwd: str = ""
    """The folder the command runs in: the one `gnsweep launch` was started from (recorded
    at launch when not given)."""
    accumulation: int = 1
    """Micro-batches the script accumulates a step, over all its ranks (nanoGPT's
    `gradient_accumulation_steps`): `{microbatch_size}` is the batch size over this, and
    every batch size of the grid must divide by it."""
    optimizer: str = ""
    """The script's optimizer as you name it (sgd, momentum, adam, adamw, lion...; empty:
    not said). gnsweep does not train a script, so its own `train.*` settings describe
    nothing here: this is what the report shows, and what decides whether the learning-rate
    law of plain SGD (eq. 2.7) applies."""
    grad_clip: float | None = None
    """The gradient-norm clipping the script applies (0: none; unset: not said)."""
    schedule: str = ""
    """The script's learning-rate schedule in your words (constant, cosine, warmup 2000
    steps then cosine...; empty: not said)."""

    def __post_init__(self) -> None:
        if not isinstance(self.command, str) or not self.command.strip():
            raise ConfigError("task=script needs the command to run: task.command='python "
                              "train.py --batch_size={batch_size} --lr={learning_rate}' "
                              "(docs/scripts.md)")
        for name in ("log_pattern", "log_file", "resume_args", "cwd", "unit", "log_format",
                     "optimizer", "schedule"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"task.{name}: {getattr(self, name)!r} must be a string")
        command_args(self.command, "task.command")
        if self.resume_args:
            command_args(self.resume_args, "task.resume_args")
        if self.log_file:
            fill(self.log_file, example_values(), "task.log_file")
            if not {"run_dir", "run_id"} & set(placeholders(self.log_file, "task.log_file")):
                raise ConfigError(f"task.log_file={self.log_file}: the same file for every run; "
                                  "give each run its own, e.g. task.log_file={run_dir}/log.csv")
        if self.log_pattern and self.log_file:
            raise ConfigError("task.log_pattern and task.log_file both given: read the metrics "
                              "from one of them (drop the other)")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"task.log_format={self.log_format}: choose one of "
                              f"{', '.join(LOG_FORMATS)}")
        if self.log_pattern:
            pattern_columns(self.log_pattern)
        if not isinstance(self.columns, dict):
            raise ConfigError(f"task.columns: {self.columns!r} must map metrics columns to the "
                              "log's names, e.g. task.columns={step:iter,loss:train_loss}")
        self.columns = {str(k): str(v) for k, v in self.columns.items()}
        for key in self.columns:
            _metrics_column(key, "task.columns")
        if self.columns and not self.log_file:
            raise ConfigError("task.columns maps the columns of task.log_file: give the file "
                              "(or drop task.columns)")
        if isinstance(self.examples_per_sample, bool) or not isinstance(
                self.examples_per_sample, (int, float)) or not (
                math.isfinite(self.examples_per_sample) and self.examples_per_sample > 0):
            raise ConfigError(f"task.examples_per_sample: {self.examples_per_sample!r} must be "
                              "a number > 0 (tokens a sequence, or 1)")
        self.examples_per_sample = float(self.examples_per_sample)
        if not self.unit.strip():
            raise ConfigError("task.unit: give a word such as examples or tokens")
        if isinstance(self.stop_seconds, bool) or not isinstance(self.stop_seconds, (int, float)) \
                or not self.stop_seconds >= 0:
            raise ConfigError(f"task.stop_seconds: {self.stop_seconds!r} must be a number >= 0")
        if isinstance(self.step_offset, bool) or not isinstance(self.step_offset, int):
            raise ConfigError(f"task.step_offset: {self.step_offset!r} must be an integer "
                              "(1 for a script whose first step is 0)")
        if isinstance(self.accumulation, bool) or not isinstance(self.accumulation, int) \
                or self.accumulation < 1:
            raise ConfigError(f"task.accumulation: {self.accumulation!r} must be an integer "
                              ">= 1 (micro-batches the script accumulates a step)")
        if self.grad_clip is not None:
            if isinstance(self.grad_clip, bool) or not isinstance(self.grad_clip, (int, float)) \
                    or not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
                raise ConfigError(f"task.grad_clip: {self.grad_clip!r} must be a number >= 0 "
                                  "(the norm the script clips gradients at; 0: no clipping)")
            self.grad_clip = float(self.grad_clip)
        self.optimizer = self.optimizer.strip().lower()
        if isinstance(self.stderr_lines, bool) or not isinstance(self.stderr_lines, int) \
                or self.stderr_lines < 0:
            raise ConfigError(f"task.stderr_lines: {self.stderr_lines!r} must be an integer "
                              ">= 0")


def metrics_columns() -> tuple[str, ...]:
    """The columns a run's metrics table has (`tables.METRICS_SCHEMA`), which a log may fill."""
    from gnsweep.tables import METRICS_SCHEMA

    return tuple(METRICS_SCHEMA.names)


def _metrics_column(name: str, where: str) -> None:
    if name not in metrics_columns() and name not in EPOCH_COLUMNS:
        raise ConfigError(f"{where}: {name!r} is not a metrics column; known: "
                          f"{', '.join((*metrics_columns(), *EPOCH_COLUMNS))}")


def example_values() -> dict[str, Any]:
    """A value for every placeholder, to check a template before any run exists."""
    return {"batch_size": 8, "learning_rate": 0.1, "seed": 0, "run_dir": "/run",
            "max_examples": 0, "max_steps": 1, "run_id": "b00008_lr0.1_s0",
            "sweep_dir": "/sweep", "targets": "1", "target": 1.0,
            "checkpoint_dir": "/run/checkpoints", "resume": 0, "resume_step": 0, "attempt": 1,
            "microbatch_size": 8, "accumulation": 1}


def microbatch_size(batch_size: int, accumulation: int) -> int:
    """The samples of one micro-batch (`{microbatch_size}`); ConfigError, one line, where the
    batch size does not divide by `task.accumulation`."""
    if batch_size % accumulation:
        raise ConfigError(f"sweep.batch_sizes: {batch_size} does not divide into "
                          f"task.accumulation={accumulation} micro-batches; use multiples of "
                          f"{accumulation}")
    return batch_size // accumulation


def placeholders(template: str, where: str) -> list[str]:
    """The placeholder names in `template` (`{name}`, `{{` for a literal brace); ConfigError
    naming an unknown one or a brace left open."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template)
                 if name is not None]
    except ValueError as err:
        raise ConfigError(f"{where}: {err} in {template!r} (write {{{{ and }}}} for a literal "
                          "brace)") from None
    for name in names:
        if name not in PLACEHOLDERS:
            raise ConfigError(f"{where}: unknown placeholder {{{name}}}; known: "
                              + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS))
    for _, field_name, spec, _ in string.Formatter().parse(template):
        if field_name is not None and spec and any(int(n) > MAX_FORMAT_WIDTH
                                                   for n in re.findall(r"\d+", spec)):
            raise ConfigError(f"{where}: the format spec {{{field_name}:{spec}}} asks for more "
                              f"than {MAX_FORMAT_WIDTH} characters; give a width and precision "
                              f"of at most {MAX_FORMAT_WIDTH}")
    return names


def fill(template: str, values: dict[str, Any], where: str) -> str:
    """`template` with its placeholders filled from `values`."""
    placeholders(template, where)
    try:
        return template.format(**values)
    except (ValueError, IndexError) as err:
        raise ConfigError(f"{where}: {err} in {template!r}") from None


def command_args(template: str, where: str, values: dict[str, Any] | None = None) -> list[str]:
    """The command's arguments: split like a shell would (`shlex`), each placeholder filled
    (from `values`; example values to check a template). ConfigError: no command, an unknown
    placeholder, an unclosed quote."""
    try:
        parts = shlex.split(template)
    except ValueError as err:
        raise ConfigError(f"{where}: {err} in {template!r}") from None
    if not parts and where == "task.command":
        raise ConfigError(f"{where}: empty; give the command to run")
    filled = example_values() if values is None else values
    return [fill(part, filled, where) for part in parts]


def pattern_columns(pattern: str) -> regex.Pattern[str]:
    """The compiled `task.log_pattern` (the `regex` package, whose search takes a time limit:
    `MATCH_SECONDS`); ConfigError when it does not compile, repeats more than `MAX_REPEAT`
    times, lacks a named group `step` or `loss`, or names a group that is no metrics column."""
    try:
        re.compile(pattern)  # Python's own syntax: what the docs promise
        compiled = regex.compile(pattern)
    except (re.error, regex.error, OverflowError, RecursionError) as err:
        raise ConfigError(f"task.log_pattern: not a regular expression ({err})") from None
    counts = re.findall(r"(?<!\\)\{(\d*),?(\d*)\}", pattern)
    if any(n and int(n) > MAX_REPEAT for pair in counts for n in pair):
        raise ConfigError(f"task.log_pattern: a repetition count above {MAX_REPEAT} in "
                          f"{pattern!r}; no log line needs one")
    missing = [name for name in REQUIRED if name not in compiled.groupindex]
    if missing:
        raise ConfigError(f"task.log_pattern: no named group {' or '.join(missing)}; write "
                          "e.g. 'iter (?P<step>\\d+): loss (?P<loss>[-+.\\deE]+)'")
    for name in compiled.groupindex:
        _metrics_column(name, "task.log_pattern group")
    if "total" in compiled.groupindex and "epoch" not in compiled.groupindex:
        raise ConfigError("task.log_pattern: a total group (the steps an epoch has) needs an "
                          "epoch group, e.g. 'epoch (?P<epoch>\\d+) \\| (?P<step>\\d+)/"
                          "(?P<total>\\d+) batches'")
    return compiled


def match_row(pattern: regex.Pattern[str], line: str, where: str) -> dict[str, str] | None:
    """The named groups `pattern` finds in `line` (None: no match). ScriptFailed naming `where`
    when the match takes longer than `MATCH_SECONDS` (a pattern that backtracks)."""
    try:
        match = pattern.search(line, timeout=MATCH_SECONDS)
    except TimeoutError:
        raise ScriptFailed(f"{where}: task.log_pattern did not finish matching this line in "
                           f"{MATCH_SECONDS:g} s (a pattern that backtracks, such as a nested "
                           "repeat like (a+)+: write it without one)") from None
    if match is None:
        return None
    return {k: v for k, v in match.groupdict().items() if v is not None}


def check_command(options: ScriptOptions, cwd: str) -> None:
    """ConfigError (exit 2 at launch, nothing run) when the command's program cannot be found,
    or a Python script it names is not there, seen from `cwd`."""
    args = command_args(options.command, "task.command", example_values())
    program = args[0]
    if "/" in program:
        found = Path(cwd, program)
        if not (found.is_file() and os.access(found, os.X_OK)):
            raise ConfigError(f"task.command: {program}: no such executable file (seen from "
                              f"{cwd})")
    elif shutil.which(program) is None:
        raise ConfigError(f"task.command: {program}: command not found on PATH")
    if Path(program).name.startswith("python") and len(args) > 1:
        script = args[1]
        if not script.startswith("-") and script.endswith(".py") \
                and not Path(cwd, script).is_file():
            raise ConfigError(f"task.command: {script}: no such file in {cwd} (commands run "
                              "in the folder gnsweep launch was started from, or task.cwd)")


def log_format(options: ScriptOptions, path: str) -> str:
    """csv or jsonl: `log_format`, or by the file's suffix."""
    if options.log_format != "auto":
        return options.log_format
    return "jsonl" if path.lower().endswith((".jsonl", ".json", ".ndjson")) else "csv"


def label(command: str) -> str:
    """A command as a reader knows it: its Python script (`train.py`), else its program."""
    try:
        parts = shlex.split(command)
    except ValueError:
        parts = command.split()
    named = [p for p in parts if p.endswith(".py") and not p.startswith("-")] or parts[:1]
    return named[0].rsplit("/", 1)[-1] if named else SCRIPT


def sweep_name(command: str) -> str:
    """A default sweep name for a command: its Python script's stem (`python train.py` ->
    train), else its program's name."""
    stem = label(command).removesuffix(".py")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or SCRIPT
