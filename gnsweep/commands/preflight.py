"""The steps before a sweep folder is written, shared by `launch` and `plan`: the config
composed from the command line, then the task checked (a task that cannot train is refused here,
exit 2), a custom task's unit recorded in the config for the analysis, and the default windows
given in samples converted to the task's unit."""

from __future__ import annotations

import dataclasses
from typing import Any

from gnsweep.config import Config


def compose_config(overrides: list[str] | None, workers: int | None) -> Config:
    """The config of Hydra `overrides`, `--workers N` as `executor.workers=N`."""
    from gnsweep.compose import compose

    overrides = list(overrides or [])
    if workers is not None:
        overrides.append(f"executor.workers={workers}")
    return compose(overrides)


def preflight(config: Config, overrides: list[str] | None = None
              ) -> tuple[Config, float, dict[str, Any]]:
    """Check that the task trains (ConfigError, exit 2, before anything is written; with
    noise.method=per_example, that per-example norms can measure it); returns the config with
    the task's unit recorded and the default loss EMA in its unit (`config.in_task_units`:
    `overrides` say whether the user gave one), the task's examples a sample, and the sweep's
    scale (`scale_record`)."""
    from gnsweep.compose import in_task_units
    from gnsweep.tasks.check import check_task

    checked = check_task(config.task.name, config.task.options, config.sweep.seeds[0],
                         config.sweep.stall_seconds, noise_method=config.noise.method)
    config = dataclasses.replace(config, task=config.task.with_unit(checked.unit))
    return (in_task_units(config, checked.per_sample, list(overrides or [])),
            checked.per_sample, scale_record(config, checked))


def scale_record(config: Config, checked: Any) -> dict[str, Any]:
    """What store.SCALE holds: the model size N that `gnsweep laws` reads (`params`: the
    one given as sweep.scale.params, else the count without embeddings), both counts, and the
    data budget D (sweep.max_examples, in the task's unit)."""
    given = config.sweep.scale.params
    return {"params": given or checked.params_non_embedding,
            "params_source": "sweep.scale.params" if given else "counted (non-embedding)",
            "params_total": checked.params, "params_non_embedding": checked.params_non_embedding,
            "max_examples": config.sweep.max_examples, "unit": config.task.unit,
            "per_sample": checked.per_sample}
