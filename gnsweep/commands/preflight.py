"""The steps before a sweep folder is written, shared by `launch` and `plan`: the config
composed from the command line, then the task checked (a task that cannot train is refused here,
exit 2) and a custom task's unit recorded in the config for the analysis."""

from __future__ import annotations

import dataclasses

from gnsweep.config import Config


def compose_config(overrides: list[str] | None, workers: int | None) -> Config:
    """The config of Hydra `overrides`, `--workers N` as `executor.workers=N`."""
    from gnsweep.config import compose

    overrides = list(overrides or [])
    if workers is not None:
        overrides.append(f"executor.workers={workers}")
    return compose(overrides)


def preflight(config: Config) -> Config:
    """Check that the task trains (ConfigError, exit 2, before anything is written); returns the
    config with the task's unit recorded."""
    from gnsweep.tasks.check import check_task

    unit = check_task(config.task.name, config.task.options, config.sweep.seeds[0],
                      config.sweep.stall_seconds)
    return dataclasses.replace(config, task=config.task.with_unit(unit))
