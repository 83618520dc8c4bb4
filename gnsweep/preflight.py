"""The steps before a sweep folder is written, shared by `launch` and `plan`: the config
composed from the command line, then the task checked (a task that cannot train is refused here,
exit 2), a custom task's unit recorded in the config for the analysis, and the default windows
given in samples converted to the task's unit."""

from __future__ import annotations

import dataclasses
from typing import Any

from gnsweep.config import Config
from gnsweep.tasks import about, checked_task, with_unit


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
    from gnsweep.tasks import SCRIPT
    from gnsweep.tasks.launch_check import check_task

    if config.task.name == SCRIPT:
        return _script(config, overrides)

    checked = check_task(config.task.name, config.task.options, config.sweep.seeds[0],
                         config.sweep.stall_seconds, noise_method=config.noise.method)
    config = dataclasses.replace(config, task=with_unit(config.task, checked.unit))
    return (in_task_units(config, checked.per_sample, list(overrides or [])),
            checked.per_sample, scale_record(config, checked))


def scale_record(config: Config, checked: Any) -> dict[str, Any]:
    """What paths.SCALE holds: the model size N that `gnsweep laws` reads (`params`: the
    one given as sweep.scale.params, else the count without embeddings), both counts, and the
    data budget D (sweep.max_examples, in the task's unit)."""
    given = config.sweep.scale.params
    return {"params": given or checked.params_non_embedding,
            "params_source": "sweep.scale.params" if given else "counted (non-embedding)",
            "params_total": checked.params, "params_non_embedding": checked.params_non_embedding,
            "max_examples": config.sweep.max_examples, "unit": about(config.task).unit,
            "per_sample": checked.per_sample}


def _script(config: Config, overrides: list[str] | None
            ) -> tuple[Config, float, dict[str, Any]]:
    """task=script: its command checked from the folder it runs in (the launch's, recorded as
    `task.cwd` unless given); its examples a sample are `task.examples_per_sample`; its model
    is not counted (its scale's params are sweep.scale.params, or 0: unknown)."""
    import os

    from gnsweep.compose import in_task_units
    from gnsweep.config import TaskConfig
    from gnsweep.tasks.script import ScriptOptions, check_command, microbatch_size

    options = ScriptOptions(**config.task.options)
    cwd = os.path.abspath(options.cwd or os.getcwd())
    if not os.path.isdir(cwd):
        from gnsweep.errors import ConfigError

        raise ConfigError(f"task.cwd={options.cwd}: no such folder")
    check_command(options, cwd)
    for batch in config.sweep.batch_sizes:  # {microbatch_size}: B / task.accumulation
        microbatch_size(batch, options.accumulation)
    task = checked_task(TaskConfig(config.task.name, {**config.task.options, "cwd": cwd}))
    config = dataclasses.replace(config, task=task)
    per_sample = options.examples_per_sample
    given = config.sweep.scale.params
    scale = {"params": given, "params_source": "sweep.scale.params" if given
             else "not counted (task=script: the model is the script's)",
             "params_total": given, "params_non_embedding": given,
             "max_examples": config.sweep.max_examples, "unit": about(config.task).unit,
             "per_sample": per_sample}
    return in_task_units(config, per_sample, list(overrides or [])), per_sample, scale
