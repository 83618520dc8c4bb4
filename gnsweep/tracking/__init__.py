"""Run logging to experiment trackers: `make_logger(kind, sweep_dir, **options)`.

Kinds: `none`, `tensorboard`, `mlflow`, `wandb`. Logging never fails a run: a backend that
cannot start or log says so once (with how to fix it) and turns into a no-op. Backends import
their package only when a run starts, so importing this module needs none of them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gnsweep.tracking.mlflow_logger import MlflowLogger
from gnsweep.tracking.run_logger import METRICS, RunLogger, SafeLogger
from gnsweep.tracking.tensorboard_logger import TensorBoardLogger
from gnsweep.tracking.wandb_logger import WandbLogger

__all__ = ["KINDS", "METRICS", "RunLogger", "make_logger", "options_of"]

# kind -> (backend class, taking (sweep_dir, **options); how to fix one that cannot start)
_BACKENDS: dict[str, tuple[Callable[..., RunLogger], str]] = {
    "tensorboard": (TensorBoardLogger, "Install it with: pip install 'gnsweep[tensorboard]'"),
    "mlflow": (MlflowLogger, "Install it with: pip install 'gnsweep[mlflow]'; check that "
               "MLFLOW_TRACKING_URI (or the sweep folder) is reachable and writable"),
    "wandb": (WandbLogger, "Install it with: pip install 'gnsweep[wandb]'; online runs need "
              "`wandb login` (or WANDB_MODE=offline)"),
}
KINDS = ("none", *_BACKENDS)


def make_logger(kind: str, sweep_dir: Path | str, **options: Any) -> RunLogger:
    """The run logger `kind` for the sweep in `sweep_dir`, wrapped so that it never raises
    once made. Bad `kind` or options (user input) raise ValueError with one clear line."""
    if kind == "none":
        if options:
            raise ValueError(f"logger=none takes no options, got {', '.join(sorted(options))}")
        return RunLogger()
    if kind not in _BACKENDS:
        raise ValueError(f"logger={kind}: unknown; choose one of {', '.join(KINDS)}")
    backend, hint = _BACKENDS[kind]
    accepted = options_of(kind)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"logger={kind}: unknown option {', '.join(unknown)}; accepted: "
                         f"{', '.join(accepted)}")
    return SafeLogger(backend(Path(sweep_dir), **options), hint)


def options_of(kind: str) -> list[str]:
    """The options logger `kind` takes (its backend's keyword-only arguments); [] for none or
    an unknown kind."""
    if kind not in _BACKENDS:
        return []
    return [name for name, p in inspect.signature(_BACKENDS[kind][0]).parameters.items()
            if p.kind is p.KEYWORD_ONLY]
