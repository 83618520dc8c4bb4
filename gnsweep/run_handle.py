"""`gnsweep.current_run()`: a training script's handle on the sweep run it is (task=script).

    run = gnsweep.current_run()          # None when the script runs outside a sweep
    batch_size = run.batch_size if run else args.batch_size
    monitor = run.monitor(model) if run else None   # B_simple (eq. 2.9) logged with each row
    for step in range(run.resume_step + 1 if run else 1, ...):
        ...; loss.backward(); monitor.step() if monitor else None; optimizer.step()
        if run:
            run.log(step, examples, loss.item(), lr=lr)
            if run.should_stop():        # every target reached, or the budget spent
                break

The sweep starts the script with its run's values in GNSWEEP_* environment variables (the
placeholders of `gnsweep.tasks.script`); the handle reads them. `log` appends one JSON line to
the run folder's `script_rows.jsonl`, which the sweep reads as the run's metrics as it grows
(`gnsweep.training.script_runner`). Under torchrun only rank 0 writes (RANK); every rank may call
`log` and `should_stop` alike.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gnsweep import store, tables
from gnsweep.paths import RunPaths
from gnsweep.tasks.script import ENV_PREFIX

if TYPE_CHECKING:
    from torch import nn

    from gnsweep.measure import NoiseScaleMonitor

__all__ = ["RunHandle", "current_run"]
log = logging.getLogger("gnsweep.integrations")

NOISE_COLUMNS = ("b_simple", "g2", "trace_sigma", "b_simple_se", "drift", "b_noise", "g_h_g",
                 "trace_h_sigma", "g2_precond", "trace_sigma_precond", "b_simple_precond",
                 "b_small", "b_big", "sq_norm_small", "sq_norm_big", "g2_step",
                 "trace_sigma_step")
"""The monitor's estimate fields logged with each row (`noise.NoiseEstimate`, by name)."""


def _env(name: str) -> str | None:
    return os.environ.get(ENV_PREFIX + name.upper())


@dataclass
class RunHandle:
    """The run a script is inside a sweep: its grid point, its budget and targets, and where it
    logs. Made by `current_run()` from the environment the sweep started the script with."""

    run_dir: Path
    """The run's folder (write checkpoints here: `checkpoint_dir`)."""
    run_id: str
    batch_size: int
    """The grid's batch size (samples a step, global under DDP)."""
    learning_rate: float
    seed: int
    max_examples: int
    """The run's budget in examples (the task's unit; 0: none)."""
    max_steps: int
    targets: list[float]
    """The sweep's loss targets; the run may stop once the hardest is reached."""
    resume_step: int
    """The last step the run has on record from an earlier attempt (0: a fresh run). A
    script that resumes from its own checkpoint logs on from the checkpoint's step; rows
    after it are replaced."""
    attempt: int
    examples_per_sample: float = 1.0
    """What a sample counts in the sweep's unit (tokens a sequence)."""
    source: str = "api"
    """Where the sweep reads the rows: api (`log`), or the script's printed lines (pattern) or
    log file (file), whose rows `log` then leaves alone."""
    rank: int = 0
    _monitor: NoiseScaleMonitor | None = field(default=None, repr=False)
    _examples: int = field(default=0, repr=False)
    _step: int = field(default=0, repr=False)
    _warned: bool = field(default=False, repr=False)

    @property
    def checkpoint_dir(self) -> Path:
        """`<run_dir>/checkpoints`, a place for the script's own checkpoints."""
        return RunPaths(self.run_dir).checkpoints

    @property
    def resuming(self) -> bool:
        """Whether an earlier attempt of this run logged rows (resume from a checkpoint)."""
        return self.resume_step > 0

    @property
    def writer(self) -> bool:
        """Whether this process writes the run's rows (rank 0)."""
        return self.rank == 0

    def monitor(self, model: nn.Module, **options: Any) -> NoiseScaleMonitor:
        """A `gnsweep.NoiseScaleMonitor` on `model` (keyword `options` as it takes them) whose
        estimate is logged with every row: call its `step()` after backward, before the
        optimizer's step, as anywhere else. Under DDP, give it the DDP-wrapped model."""
        from gnsweep.measure import NoiseScaleMonitor

        self._monitor = NoiseScaleMonitor(model, **options)
        return self._monitor

    def attach(self, monitor: NoiseScaleMonitor | None) -> None:
        """Log `monitor`'s estimate with every row (a monitor made elsewhere)."""
        self._monitor = monitor

    def log(self, step: int, examples: int | None, loss: float, **columns: float) -> None:
        """One metrics row: the optimizer step (from 1), the examples trained on so far (None:
        step x batch_size x examples_per_sample), the training loss of this step's batch, and
        any other metrics columns (`eval_loss`, `lr`, `grad_norm` ...). The monitor's noise
        scale, when there is one, is added. Only rank 0 writes."""
        known = set(tables.METRICS_SCHEMA.names)
        unknown = sorted(set(columns) - known)
        if unknown:
            raise ValueError(f"log(): {unknown[0]!r} is not a metrics column; known: "
                             f"{', '.join(sorted(known))}")
        self._step = int(step)
        if examples is not None:
            self._examples = int(examples)
        if not self.writer:
            return
        if self.source != "api":
            if not self._warned:
                self._warned = True
                log.warning("gnsweep: this sweep reads the run's rows from the script's %s "
                            "(task.log_pattern/task.log_file); current_run().log() is not read",
                            "printed lines" if self.source == "pattern" else "log file")
            return
        row: dict[str, Any] = {"step": int(step), "loss": _number(loss)}
        if examples is not None:
            row["examples"] = int(examples)
        estimate = self._monitor.estimate if self._monitor is not None else None
        if estimate is not None:
            for name in NOISE_COLUMNS:
                value = getattr(estimate, name, math.nan)
                if value is not None and math.isfinite(float(value)):
                    row[name] = float(value)
        row.update({k: _number(v) for k, v in columns.items()})
        store.append_line(RunPaths(self.run_dir).script_rows, json.dumps(row) + "\n")

    def should_stop(self) -> bool:
        """Whether the run has what it needs: the sweep has seen every target reached (as the
        analysis reads it) or the budget spent, or asks the script to stop (Ctrl-C, a
        preemption: save a checkpoint and exit). Under torch.distributed the ranks agree (one
        small all-reduce: every rank calls it at the same step), so that all stop together."""
        stop = RunPaths(self.run_dir).script_stop.exists() \
            or bool(self.max_examples and self._examples >= self.max_examples) \
            or bool(self.max_steps and self._step >= self.max_steps)
        return _agreed(stop)


def _agreed(stop: bool) -> bool:
    """`stop` on any rank, on every rank (no process group: `stop` itself)."""
    import sys

    if "torch" not in sys.modules:
        return stop
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stop
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([float(stop)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _number(value: Any) -> float | None:
    """A float for JSON (NaN and inf as null: the row is read as not a number there)."""
    number = float(value.item() if hasattr(value, "item") else value)
    return number if math.isfinite(number) else _non_finite(number)


def _non_finite(number: float) -> Any:
    # JSON has no NaN: written as a string the runner reads back with float().
    return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")


_current: RunHandle | None = None


def current_run() -> RunHandle | None:
    """The sweep run this process trains (task=script), or None outside a sweep: the same
    script then runs alone, on its own arguments. The same handle on every call."""
    global _current
    run_dir = _env("run_dir")
    if not run_dir:
        return None
    if _current is not None and str(_current.run_dir) == run_dir:
        return _current
    targets = [float(t) for t in (_env("targets") or "").split(",") if t]
    handle = RunHandle(
        run_dir=Path(run_dir), run_id=_env("run_id") or Path(run_dir).name,
        batch_size=int(_env("batch_size") or 0), learning_rate=float(_env("learning_rate") or 0),
        seed=int(_env("seed") or 0), max_examples=int(_env("max_examples") or 0),
        max_steps=int(_env("max_steps") or 0), targets=targets,
        resume_step=int(_env("resume_step") or 0), attempt=int(_env("attempt") or 1),
        examples_per_sample=float(_env("examples_per_sample") or 1.0),
        source=_env("log_source") or "api", rank=int(os.environ.get("RANK", "0")))
    if handle.writer:
        # Present from the start: the sweep then asks this script to stop through
        # should_stop() before it sends a signal (whatever it reads the rows from).
        store.append_line(RunPaths(handle.run_dir).script_rows, "")
    _current = handle
    return handle
