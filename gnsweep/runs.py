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
from gnsweep.config import Config, ConfigError
from gnsweep.store import FINISHED, RunState

__all__ = ["FINISHED", "RunSpec", "RunState", "expand_grid", "fresh_retries", "max_attempts",
           "needs_running",
           "parse_run_record", "read_run", "run_record", "write_run"]


@dataclass(frozen=True, order=True)
class RunSpec:
    """One point of the grid, or one adaptive run (`exchange_rate` > 0)."""

    batch_size: int
    """Samples per step; 0 for an adaptive run (its batch size follows the noise scale)."""
    learning_rate: float
    """The learning rate; an adaptive run's eps_max (eq. 2.7: eps(B) = eps_max/(1 + B_noise/B))."""
    seed: int = 0
    exchange_rate: float = 0.0
    """Appendix D's exchange rate r (examples per step) of an adaptive run; 0 for a grid run."""
    lr_noise: float = 0.0
    """An adaptive run's fixed B_noise in its learning-rate rule (0: the measured one)."""
    along: bool = False
    """A run whose batch size follows a measured critical batch size along training
    (`schedule.AlongBatch`, docs/along.md); `learning_rate` is then eq. 2.7's eps_max."""
    at_examples: int = 0
    """A branch run's point: it starts from the base run's checkpoint after this many examples
    (`config.branch.point(at_examples)`, docs/along.md); 0 for a run from initialisation."""

    @property
    def adaptive(self) -> bool:
        return self.exchange_rate > 0

    @property
    def run_id(self) -> str:
        if self.along:  # never a grid run's id: those start with b
            return f"along_lr{self.learning_rate:.4g}_bn{self.lr_noise:.4g}_s{self.seed}"
        if self.adaptive:  # never a grid run's id: those start with b
            noise = f"_bn{self.lr_noise:.4g}" if self.lr_noise > 0 else ""
            return f"r{self.exchange_rate:.4g}_lr{self.learning_rate:.4g}{noise}_s{self.seed}"
        # Zero-padded batch size so that folders sort by batch size; a branch run's id starts
        # with its point (examples seen by the base run there).
        grid = f"b{self.batch_size:05d}_lr{self.learning_rate:.4g}_s{self.seed}"
        return f"at{self.at_examples}_{grid}" if self.at_examples else grid


def expand_grid(config: Config) -> list[RunSpec]:
    """Every (batch size, learning rate, seed) of the sweep, small batches first; with
    sweep.schedule=adaptive then one adaptive run per (exchange rate, seed), at eps_max
    `sweep.eps_max` (resolved from the sweep's fit before the grid is expanded, by
    `gnsweep.sweep.resolve_adaptive_lr`)."""
    sweep = config.sweep
    grid = sorted(RunSpec(b, lr, s) for b in sweep.batch_sizes for lr in sweep.learning_rates
                  for s in sweep.seeds)
    if sweep.schedule == "along":
        if not (sweep.eps_max > 0 and sweep.adaptive_lr_noise > 0 and sweep.along_points):
            raise ConfigError("sweep.schedule=along needs its curve and learning-rate rule: "
                              "sweep.along_from=DIR (an analysed branch sweep) and this "
                              "folder's fixed-batch fit (gnsweep analyze DIR first), or "
                              "sweep.eps_max and sweep.adaptive_lr_noise")
        return grid + [RunSpec(0, sweep.eps_max, s, lr_noise=sweep.adaptive_lr_noise, along=True)
                       for s in sweep.seeds]
    if sweep.schedule != "adaptive":
        return grid
    if not sweep.eps_max > 0:
        raise ConfigError("sweep.schedule=adaptive needs eps_max: set sweep.eps_max=..., or "
                          "analyse the sweep's fixed-batch runs first (gnsweep analyze DIR)")
    return grid + [RunSpec(0, sweep.eps_max, s, r, sweep.adaptive_lr_noise)
                   for r in sweep.exchange_rates for s in sweep.seeds]


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
