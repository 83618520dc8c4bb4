"""The sweep as data: a pure expansion of the grid into run specs, and which of them remain.

Running them is the executors' job (`gnsweep.executors`); recording them is `gnsweep.store`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.config import Config


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


def prepare(sweep_dir: Path, config: Config) -> list[RunSpec]:
    """Create the sweep folder (or check it matches), write every run's config; return the grid.

    An existing sweep folder keeps its runs: relaunching with a larger grid adds runs, and the
    runs already finished are never touched.
    """
    from omegaconf import OmegaConf

    sweep_dir.mkdir(parents=True, exist_ok=True)
    store.write_text(sweep_dir / store.SWEEP_CONFIG, OmegaConf.to_yaml(config.to_dict()))
    specs = expand_grid(config)
    for spec in specs:
        path = store.run_dir(sweep_dir, spec.run_id)
        if not (path / store.RUN_CONFIG).exists():
            store.write_json(path / store.RUN_CONFIG, run_record(config, spec))
    return specs


def remaining(sweep_dir: Path, specs: list[RunSpec]) -> list[RunSpec]:
    """Specs whose run has not finished (done or diverged) and has retries left."""
    out = []
    for spec in specs:
        status = store.read_status(store.run_dir(sweep_dir, spec.run_id))
        if status["state"] in store.FINISHED:
            continue
        out.append(spec)
    return out


def launch(config: Config, sweep_dir: Path, *, show_progress: bool = True) -> Any:
    """Run every run of the sweep that has not finished; returns the executor's summary."""
    from gnsweep.progress import SweepProgress

    specs = prepare(sweep_dir, config)
    todo = [spec.run_id for spec in remaining(sweep_dir, specs)]
    executor = config.executor
    with SweepProgress(len(specs), len(specs) - len(todo), enabled=show_progress) as progress:
        if executor.kind == "local":
            from gnsweep.executors.local import run_local

            return run_local(sweep_dir, todo, workers=executor.n_workers(),
                             threads=executor.threads_per_worker,
                             max_retries=config.sweep.max_retries, progress=progress)
        raise NotImplementedError(f"executor={executor.kind} is not available yet")
