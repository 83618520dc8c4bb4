"""TensorBoard: event files under `<sweep>/tensorboard/<run_id>/` (`tensorboard --logdir
<sweep>/tensorboard` lists one run per gnsweep run)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.paths import SweepPaths
from gnsweep.tracking.run_logger import RunLogger, flatten


class TensorBoardLogger(RunLogger):
    kind = "tensorboard"

    def __init__(self, sweep_dir: Path, *, flush_secs: int = 10) -> None:
        self.root = SweepPaths(sweep_dir).tensorboard
        self.flush_secs = flush_secs
        self.writer: Any = None

    def start(self, run_id: str, params: Mapping[str, Any]) -> None:
        # torch's writer needs the tensorboard package (its protobuf event format).
        from torch.utils.tensorboard import SummaryWriter

        self.close()
        # A real folder inside the sweep folder, never a link that sends the events elsewhere.
        log_dir = store.subdir(self.root.parent, self.root / run_id)
        self.writer = SummaryWriter(log_dir=str(log_dir),
                                    flush_secs=self.flush_secs)
        # The config as one text entry (TensorBoard's hparams plugin writes extra sub-runs).
        table = "\n".join(f"| {k} | {json.dumps(v, default=str)} |"
                          for k, v in flatten(params).items())
        self.writer.add_text("config", "| parameter | value |\n|---|---|\n" + table, 0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def close(self, *, failed: bool = False) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()
