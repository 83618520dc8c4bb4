"""Runs as data: the grid point (`RunSpec`), the grid's expansion (pure), a run's record (what a
worker needs to train it, `runs/<id>/config.json`), its typed state and how retries are counted.

A leaf under the orchestration: the sweep, the executors and training import it; it imports
only the config and the store.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.config import Config
from gnsweep.store import FINISHED, RunState

__all__ = ["FINISHED", "RunSpec", "RunState", "expand_grid", "fresh_retries", "max_attempts",
           "needs_running",
           "parse_run_record", "read_run", "run_record", "write_run"]


@dataclass(frozen=True, order=True)
class RunSpec:
    """One point of the grid."""

    batch_size: int
    learning_rate: float
    seed: int = 0

    @property
    def run_id(self) -> str:
        # Zero-padded batch size so that folders sort by batch size.
        return f"b{self.batch_size:05d}_lr{self.learning_rate:.4g}_s{self.seed}"


def expand_grid(config: Config) -> list[RunSpec]:
    """Every (batch size, learning rate, seed) of the sweep, small batches first."""
    sweep = config.sweep
    return sorted(RunSpec(b, lr, s) for b in sweep.batch_sizes for lr in sweep.learning_rates
                  for s in sweep.seeds)


def run_record(config: Config, spec: RunSpec) -> dict[str, Any]:
    """What a worker needs to train one run, as JSON: the resolved config and the grid point."""
    return {"run_id": spec.run_id, "run": asdict(spec), "config": config.to_dict()}


def parse_run_record(data: dict[str, Any]) -> tuple[Config, RunSpec]:
    return Config.from_dict(data["config"]), RunSpec(**data["run"])


def write_run(sweep_dir: Path, config: Config, spec: RunSpec) -> None:
    """Write a run's record unless it exists (a run's record never changes once written)."""
    path = store.run_dir(sweep_dir, spec.run_id) / store.RUN_CONFIG
    if not path.exists():
        store.write_json(path, run_record(config, spec))


def read_run(sweep_dir: Path, run_id: str) -> tuple[Config, RunSpec]:
    """A run's record: the config it trains with and its grid point."""
    return parse_run_record(store.read_json(store.run_dir(sweep_dir, run_id) / store.RUN_CONFIG))


def needs_running(status: dict[str, Any], max_retries: int) -> bool:
    """Whether a run still needs running: not finished, and retries left if it failed.

    The one place retries are counted. `retry_base` is the attempt count when the current
    launch began (`fresh_retries`): each launch gives failed runs a fresh `max_retries`.
    """
    state = RunState(status["state"])
    if state in FINISHED:
        return False
    if state is RunState.FAILED:
        tries = int(status.get("attempts", 0)) - int(status.get("retry_base", 0))
        return tries <= max_retries
    return True


def max_attempts(max_retries: int) -> int:
    """Rounds one launch gives a run whose worker or job dies before it records the death: the
    first try, `max_retries` retries, and one more for the attempt the death itself cost."""
    return max_retries + 2


def fresh_retries(sweep_dir: Path, run_ids: list[str]) -> None:
    """Give every failed run of this launch a fresh `max_retries` (a relaunch means: try again)."""
    for run_id in run_ids:
        path = store.run_dir(sweep_dir, run_id)
        status = store.read_status(path)
        if status["state"] == RunState.FAILED:
            store.write_status(path, RunState.FAILED, error=status.get("error"),
                               retry_base=int(status.get("attempts", 0)))
