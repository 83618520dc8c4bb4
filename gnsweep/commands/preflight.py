"""The steps before a sweep folder is written, shared by `launch` and `plan`: the config
composed from the command line, then the task checked (a task that cannot train is refused here,
exit 2), a custom task's unit recorded in the config for the analysis, and the default windows
given in samples converted to the task's unit."""

from __future__ import annotations

import dataclasses

from gnsweep.config import Config


def compose_config(overrides: list[str] | None, workers: int | None) -> Config:
    """The config of Hydra `overrides`, `--workers N` as `executor.workers=N`."""
    from gnsweep.compose import compose

    overrides = list(overrides or [])
    if workers is not None:
        overrides.append(f"executor.workers={workers}")
    return compose(overrides)


def preflight(config: Config, overrides: list[str] | None = None) -> tuple[Config, float]:
    """Check that the task trains (ConfigError, exit 2, before anything is written; with
    noise.method=per_example, that per-example norms can measure it); returns the config with
    the task's unit recorded and the default loss EMA in its unit (`config.in_task_units`:
    `overrides` say whether the user gave one), and the task's examples a sample."""
    from gnsweep.compose import in_task_units
    from gnsweep.tasks.check import check_task

    checked = check_task(config.task.name, config.task.options, config.sweep.seeds[0],
                         config.sweep.stall_seconds, noise_method=config.noise.method)
    config = dataclasses.replace(config, task=config.task.with_unit(checked.unit))
    return in_task_units(config, checked.per_sample, list(overrides or [])), checked.per_sample
