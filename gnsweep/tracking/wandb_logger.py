"""Weights & Biases: one W&B run per gnsweep run (name = run id, group = the sweep), config as
the run's config, per-step metrics. Offline unless the user has configured W&B: `WANDB_MODE`
set, `WANDB_API_KEY` set, or a W&B entry in `~/.netrc` (what `wandb login` writes). Offline runs
live in `<sweep>/wandb/` and upload later with `wandb sync`."""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from gnsweep import store
from gnsweep.paths import SweepPaths
from gnsweep.tracking.run_logger import RunLogger

MODES = ("online", "offline", "disabled")


def configured() -> bool:
    """Whether the user has set W&B up (mode chosen, or an API key available)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc(os.environ.get("NETRC")).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


class WandbLogger(RunLogger):
    kind = "wandb"

    def __init__(self, sweep_dir: Path, *, project: str | None = None,
                 entity: str | None = None, mode: str | None = None) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"logger.mode={mode}: choose one of {', '.join(MODES)}")
        self.sweep_dir = Path(sweep_dir)
        self.project = project or self.sweep_dir.resolve().name
        self.entity = entity
        self.mode = mode or (None if configured() else "offline")
        self.run: Any = None

    def start(self, run_id: str, params: Mapping[str, Any]) -> None:
        import wandb

        self.close()
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        # W&B writes here: a real folder, never a link.
        store.subdir(self.sweep_dir, SweepPaths(self.sweep_dir).wandb)
        self.run = wandb.init(project=self.project, entity=self.entity, name=run_id,
                              group=self.sweep_dir.resolve().name, config=dict(params),
                              dir=str(self.sweep_dir), mode=cast(Any, self.mode))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=step)

    def close(self, *, failed: bool = False) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=1 if failed else 0)
