"""The noise scale of a script run, measured inside the script's process with no line of it
changed (`gnsweep.inscript`): the environment that starts the probe, and its rows joined to
the script's own rows by step.

The probe is on for `noise.method=auto` (the default of a script sweep) and off for
`noise.method=none` (`measures`): the one switch a plan of which runs measure turns per run.
It appends one JSON line a measured optimizer step to the run folder's
`paths.NOISE_PROBE_ROWS` (the step, counted from 1 like the script's rows, `span`: the most
steps the schedule of `noise.every` lets pass before its next measurement, and the
estimate's fields in samples), and a `note` line for what it could not measure. Each script
row whose own `b_simple` is NaN takes the probe's estimate at its step (`join`): the row of
that step, or, across steps not measured (`noise.every`) or skipped by the script, the last
one before it while the probe measured on, and after the last row for at most its span.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from array import array
from dataclasses import fields
from pathlib import Path
from typing import Any

from gnsweep.config import Config
from gnsweep.inscript.probe import ENV
from gnsweep.measure.common import say_once
from gnsweep.noise import Method, NoiseEstimate
from gnsweep.paths import RunPaths
from gnsweep.runs import unmeasured_share
from gnsweep.tables import METRICS_SCHEMA
from gnsweep.training.backward import in_task_units

BOOT = Path(__file__).resolve().parents[1] / "inscript" / "boot"
"""The folder put first on the script's PYTHONPATH: its `sitecustomize.py` starts the probe."""
HOME = Path(__file__).resolve().parents[2]
"""The folder holding the gnsweep package, for a script run by another interpreter."""
COLUMNS = tuple(f.name for f in fields(NoiseEstimate) if f.name in METRICS_SCHEMA.names)
"""The metrics columns the probe fills."""


def measures(config: Config) -> bool:
    """Whether the run's script is measured: `noise.method` auto (on) or none (off)."""
    return config.noise.method != Method.NONE


def probe_environment(config: Config, values: dict[str, Any], per_sample: float,
                      accumulation: int, run_path: Path) -> dict[str, str]:
    """The variables that start the probe in the script's process (none when it is off):
    its settings, and `BOOT` first on PYTHONPATH before what the environment has."""
    if not measures(config):
        return {}
    noise = config.noise
    settings = {"rows": str(RunPaths(run_path.resolve()).noise_probe_rows),
                "batch_size": values["batch_size"], "accumulation": accumulation,
                "every": noise.every, "pooled": noise.pooled,
                "ema_fraction": noise.ema_fraction, "ema_steps": noise.ema_steps,
                # The probe counts samples; noise.ema_examples is in the task's unit.
                "ema_examples": noise.ema_examples / per_sample}
    path = os.environ.get("PYTHONPATH", "")
    return {ENV: json.dumps(settings), "GNSWEEP_NOISE_PROBE_HOME": str(HOME),
            "PYTHONPATH": os.pathsep.join([str(BOOT), *([path] if path else [])])}


class ProbeRows:
    """The probe's rows file, read as it grows: its estimates by step and its notes."""

    def __init__(self, run_path: Path, per_sample: float) -> None:
        self.path = RunPaths(run_path).noise_probe_rows
        self.per_sample = per_sample
        self.offset = 0
        self.by_step: dict[int, dict[str, float]] = {}
        self.steps: list[int] = []
        self.span = 1
        """The last row's span: steps after it that it stands for (its own included)."""
        self.notes: list[str] = []

    def read(self) -> None:
        """The lines appended since the last read (a later line of a step replaces an
        earlier one: a resumed attempt measures its steps again)."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        complete = data.rfind(b"\n") + 1
        self.offset += complete
        changed = False
        spans: dict[int, int] = {}
        for line in data[:complete].splitlines():
            try:
                record = json.loads(line)
                if "note" in record:
                    self.notes.append(str(record["note"]))
                    continue
                step = int(record.pop("step"))
                span = max(1, int(record.pop("span", 1)))
                estimate = in_task_units(NoiseEstimate(**record), self.per_sample)
            except (ValueError, TypeError, KeyError):
                continue  # a line cut by a kill, or written by another version: not a row
            assert estimate is not None
            self.by_step[step] = {name: float(getattr(estimate, name)) for name in COLUMNS}
            spans[step] = span
            changed = True
        if changed:
            self.steps = sorted(self.by_step)
            self.span = spans.get(self.steps[-1], self.span)

    def at(self, step: int) -> dict[str, float] | None:
        """The estimate at `step`: its own row, or the last before it where the probe has a
        row after it (steps not measured or skipped), or within the last row's span after
        it; None where the probe has none."""
        if step in self.by_step:
            return self.by_step[step]
        i = bisect.bisect_right(self.steps, step)
        if i == 0:
            return None
        last = self.steps[i - 1]
        if i == len(self.steps) and step >= last + self.span:
            return None
        return self.by_step[last]

    def join(self, rows: dict[str, Any], start: int = 0) -> None:
        """Fill the noise columns of rows `start:` whose `b_simple` the script did not log."""
        self.read()
        if not self.by_step:
            return
        for i in range(start, len(rows["step"])):
            if math.isfinite(rows["b_simple"][i]):
                continue
            found = self.at(int(rows["step"][i]))
            if found is not None:
                for name, value in found.items():
                    column = rows[name]
                    if not hasattr(column, "__setitem__"):  # a blank column until now
                        column = rows[name] = array("d", column)
                    column[i] = value


def nan_share(measured: dict[str, Any], rows: dict[str, list]) -> float | None:
    """The share of the rows whose B_simple is NaN where the probe measured (the status'
    `b_simple_nan_share`, which `gnsweep status` and `analyze` warn on); None where it was off,
    by design."""
    if measured.get("method") != "inscript":
        return None
    return unmeasured_share(list(rows["b_simple"]))


def finish(config: Config, run_path: Path, rows: dict[str, Any], per_sample: float
           ) -> dict[str, Any]:
    """At the run's end: every row joined, the probe's notes said once a launch; the run's
    measurement for its status.json."""
    if not measures(config):
        return {"method": "none", "reason": "noise.method=none: the script is not measured"}
    probe = ProbeRows(run_path, per_sample)
    probe.join(rows)
    measured = sum(1 for value in rows["b_simple"] if math.isfinite(value))
    if measured and not probe.by_step:  # its own monitor (current_run().monitor, a callback)
        return {"method": "script", "reason": "the script logged its own b_simple"}
    for note in probe.notes:
        say_once(f"probe {note}", f"noise scale: run {run_path.name}: {note}", per_launch=True)
    reason = probe.notes[0] if probe.notes else (
        f"measured in the script's process from its backward passes, {len(probe.by_step)} "
        "steps" if probe.by_step else "the script ran no optimizer step the probe saw")
    return {"method": "inscript", "reason": reason, "rows_with_b_simple": measured}
