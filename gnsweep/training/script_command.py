"""A `task=script` run's command: its placeholders filled, the same values in GNSWEEP_*
variables, split like a shell would, and started by torchrun under `executor=torchrun`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from gnsweep.config import Config
from gnsweep.errors import ConfigError, ScriptFailed
from gnsweep.paths import RunPaths
from gnsweep.runs import RunSpec
from gnsweep.tasks import about
from gnsweep.tasks.script import (
    ENV_PREFIX,
    PLACEHOLDERS,
    ScriptOptions,
    command_args,
    microbatch_size,
)
from gnsweep.training import script_noise


def placeholder_values(config: Config, spec: RunSpec, run_path: Path, resume_step: int,
                       attempt: int) -> dict[str, Any]:
    """The value of every placeholder (`tasks.script.PLACEHOLDERS`) for this attempt."""
    sweep = config.sweep
    run_path = run_path.resolve()
    values: dict[str, Any] = {
        "batch_size": spec.batch_size, "learning_rate": spec.learning_rate, "seed": spec.seed,
        "run_dir": str(run_path), "max_examples": sweep.max_examples,
        "max_steps": sweep.max_steps, "run_id": spec.run_id,
        "sweep_dir": str(RunPaths(run_path).sweep),
        # sweep.targets=auto: none (the analysis chooses them; the run trains its budget).
        "targets": ",".join(f"{t:g}" for t in sweep.targets),
        "target": (about(config.task).hardest(sweep.targets) if sweep.stops_at_target
                   else ""),
        "checkpoint_dir": str(RunPaths(run_path).checkpoints),
        "resume": int(resume_step > 0), "resume_step": resume_step, "attempt": attempt}
    accumulation = ScriptOptions(**config.task.options).accumulation
    try:
        values.update(accumulation=accumulation,
                      microbatch_size=microbatch_size(spec.batch_size, accumulation))
    except ConfigError as err:
        raise ScriptFailed(str(err)) from None
    assert set(values) == set(PLACEHOLDERS)
    return values


def environment(values: dict[str, Any], config: Config, options: ScriptOptions) -> dict[str, str]:
    """The command's environment: this process's, the placeholders as GNSWEEP_<NAME>, what
    `gnsweep.current_run()` reads, unbuffered Python output (rows arrive as they are printed)
    and, unless set, the executor's threads per worker."""
    env = dict(os.environ)
    env.update({ENV_PREFIX + name.upper(): str(value) for name, value in values.items()})
    env[ENV_PREFIX + "EXAMPLES_PER_SAMPLE"] = repr(options.examples_per_sample)
    env[ENV_PREFIX + "LOG_SOURCE"] = source_of(options)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", str(config.executor.threads_per_worker))
    env.update(script_noise.probe_environment(  # B_simple measured inside the script
        config, values, options.examples_per_sample, options.accumulation,
        Path(values["run_dir"])))
    return env


def source_of(options: ScriptOptions) -> str:
    """Where the rows come from: pattern, file or api."""
    return "pattern" if options.log_pattern else "file" if options.log_file else "api"


def torchrun_args(args: list[str], nproc: int) -> list[str]:
    """`args` started by torchrun with `nproc` processes on this machine (the script does its
    own DDP): `python train.py ...` -> `python -m torch.distributed.run --standalone
    --nproc_per_node=N train.py ...` (the same interpreter, so the same environment); any
    other program with torchrun's `--no-python`."""
    head = Path(args[0]).name
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if head.startswith("python") and len(args) > 1:
        return [args[0], *launcher, *args[1:]]
    return [sys.executable, *launcher, "--no-python", *args]


def command(config: Config, values: dict[str, Any]) -> list[str]:
    """The attempt's arguments: `task.command` filled, `task.resume_args` on a resume, under
    torchrun for executor=torchrun, and for executor=slurm with nproc_per_node > 1 (on the
    job's node)."""
    options = ScriptOptions(**config.task.options)
    args = command_args(options.command, "task.command", values)
    if values["resume"] and options.resume_args:
        args += command_args(options.resume_args, "task.resume_args", values)
    executor = config.executor
    if executor.kind == "torchrun" or (executor.kind == "slurm" and executor.nproc_per_node > 1):
        args = torchrun_args(args, executor.nproc_per_node)
    return args
