"""Tasks: a torch-free registry (name -> options schema, import path, description), the `Task`
protocol (`gnsweep.tasks.protocol`), and a user's own task by import path (`task=custom`).

The registry is read by the config (validation, `gnsweep tasks`) without importing torch; only
`make_task` imports the task's module, in the process that trains. An entry's `target` is an
import path `module:function`; a user's task is named the Hydra way, `task._target_=module.fn`,
and called with `seed=` and the task node's other keys as keyword arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from gnsweep import redact, targets
from gnsweep.config import Config, TaskConfig, secret_is_text
from gnsweep.errors import ConfigError
from gnsweep.tasks.options import (
    CartpoleOptions,
    CharsOptions,
    DigitsOptions,
    LinregOptions,
    Mnist1dOptions,
    VaeOptions,
)
from gnsweep.tasks.protocol import Batch, Task, examples_of
from gnsweep.tasks.script import SCRIPT, ScriptOptions
from gnsweep.tasks.script import label as script_label

__all__ = [
    "CUSTOM",
    "REGISTRY",
    "SCRIPT",
    "TARGET",
    "UNIT",
    "Batch",
    "ScriptOptions",
    "Task",
    "TaskEntry",
    "TaskFacts",
    "about",
    "checked",
    "checked_task",
    "describe",
    "entry",
    "examples_of",
    "importable_cwd",
    "make_task",
    "resolve",
    "resolve_custom",
    "task_names",
    "validate_options",
    "with_unit",
]

CUSTOM = "custom"
"""`task=custom task._target_=module.function`: a user's own task."""
TARGET = "_target_"
UNIT = "_unit_"
"""A custom task's `unit` attribute (what its batch sizes count), recorded by `gnsweep launch`
beside `_target_` so that the analysis reads it without importing the task."""


@dataclass(frozen=True)
class TaskEntry:
    """One registered task."""

    options: type
    """Dataclass of the task's settings, validated in its `__post_init__` (no torch)."""
    target: str
    """`module:function` building the task: `function(options, seed) -> Task`."""
    description: str
    """One line for `gnsweep tasks`."""
    requires: tuple[str, ...] = ()
    """Optional packages the task needs; it is listed only where they are installed."""
    unit: str = "examples"
    """What a batch size counts (the task's `examples(batch)`): examples, tokens or environment
    steps. B, E_min and B_crit are in this unit."""
    metric: str = "loss"
    """What the sweep's targets are values of: "loss", or the name of the task's own metric
    (its `metric(model)`, logged by the loop in the metrics' `metric` column)."""
    higher_is_better: bool = False
    """The metric's direction: a target is reached when the metric rises to it (True) or falls
    to it (False, every loss). The same as the task object's `higher_is_better`."""


REGISTRY: dict[str, TaskEntry] = {
    "digits": TaskEntry(
        DigitsOptions, "gnsweep.tasks.digits:make",
        "MLP on scikit-learn's bundled digits (1797 x 64, 10 classes), cross-entropy."),
    "linreg": TaskEntry(
        LinregOptions, "gnsweep.tasks.linreg:make",
        "Linear regression, anisotropic Gaussian inputs, label noise; closed-form G, Sigma, H "
        "(true B_simple and B_noise at any parameters)."),
    "mnist1d": TaskEntry(
        Mnist1dOptions, "gnsweep.tasks.mnist1d:make",
        "1-D CNN on MNIST-1D (4000 x 40 signals, 10 classes; generated offline, cached), "
        "cross-entropy.", requires=("mnist1d",)),
    "chars": TaskEntry(
        CharsOptions, "gnsweep.tasks.chars:make",
        "Character-level transformer LM on the standard library's pydoc_data.topics (465k "
        "characters), nats per character; B counted in tokens (windows x context).",
        unit="tokens"),
    "vae": TaskEntry(
        VaeOptions, "gnsweep.tasks.vae:make",
        "VAE on scikit-learn's bundled digits images (8 x 8), negative ELBO in nats per image."),
    "cartpole": TaskEntry(
        CartpoleOptions, "gnsweep.tasks.cartpole:make",
        "Advantage actor-critic on gymnasium's CartPole-v1; B in environment steps "
        "(environments x steps per update); target: mean episode return (higher is better).",
        requires=("gymnasium",), unit="environment steps", metric="return",
        higher_is_better=True),
}


def task_names() -> list[str]:
    """The registered tasks whose optional packages are installed."""
    return [name for name, entry in REGISTRY.items()
            if all(importlib.util.find_spec(p) is not None for p in entry.requires)]


def entry(name: str) -> TaskEntry:
    if name not in REGISTRY or name not in task_names():
        raise ConfigError(f"task={name}: no such task; choose one of "
                          f"{', '.join([*task_names(), CUSTOM, SCRIPT])}")
    return REGISTRY[name]


def describe() -> dict[str, str]:
    """Task name -> one-line description with its default options."""
    out = {}
    for name in task_names():
        task = REGISTRY[name]
        defaults = ", ".join(f"{k}={v}" for k, v in asdict(task.options()).items())
        out[name] = f"{task.description} Options: {defaults}."
    out[CUSTOM] = ("Your own task (docs/tasks.md): task=custom task._target_=module.function "
                   "+task.key=value ...; called with seed= and the other keys.")
    out[SCRIPT] = ("Your own training command (docs/scripts.md): task=script "
                   "task.command='python train.py --bs={batch_size} --lr={learning_rate}' "
                   "with task.log_pattern, task.log_file or gnsweep.current_run().")
    return out


def validate_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Check a task's options against its schema; return them complete with defaults.

    A custom task's options are its `_target_` and whatever keyword arguments it takes (its
    own function checks those when it is built)."""
    if name == CUSTOM:
        return _custom_options(options)
    if name == SCRIPT:
        return asdict(ScriptOptions(**_known(name, options, ScriptOptions)))
    schema = entry(name).options
    known = {f.name for f in fields(schema)}
    unknown = set(options) - known
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"task.{key}: not an option of task {name}; "
                          f"known: {', '.join(sorted(known))}")
    return asdict(schema(**options))


def checked_task(task: TaskConfig) -> TaskConfig:
    """A config's task checked against the registry where the config enters (the composition,
    the sweep folder's open, a run record): its name is a task, its options are the task's
    (complete with their defaults), a secret among them is a string. ConfigError names what is
    wrong."""
    for key, value in task.options.items():
        secret_is_text(f"task.{key}", value, secret_name=redact.is_secret_name(f"task.{key}"))
    return TaskConfig(task.name, validate_options(task.name, dict(task.options)))


def checked(config: Config) -> Config:
    """`config` with its task checked (`checked_task`); the rules that tie a task to the other
    sections (a training script's) are `Config.check`'s."""
    return replace(config, task=checked_task(config.task))


@dataclass(frozen=True)
class TaskFacts:
    """What a configured task declares: what its targets are values of, which way they are
    reached, what a batch size counts, and its name as a reader knows it. From the registry
    (no torch), not from config.yaml: a sweep folder names its task, and the task declares what
    its targets mean. A task outside the registry (a user's own, by import path) declares
    nothing there: its targets are losses and B counts its examples (or its recorded unit)."""

    name: str
    """The task's registered name (custom, script or a registry entry)."""
    label: str
    """The task as a reader knows it: its name, a custom task's `_target_`, `script train.py`."""
    unit: str
    """What a batch size counts: examples, tokens or environment steps."""
    metric: str
    """What the targets are values of: "loss" or the task's metric (e.g. "return")."""
    direction: targets.Direction
    """Which way the targets are reached: the task's declared flag (`targets.KEY`), mapped to
    the direction type here, once."""

    @property
    def higher_is_better(self) -> bool:
        """True when a target is reached by rising to it (a return), False for a loss."""
        return self.direction.rises

    def reached(self, value: float, target: float) -> bool:
        """Whether a (smoothed) metric value has reached `target` in the task's direction."""
        return self.direction.reached(value, target)

    def hardest(self, values: list[float]) -> float:
        """The target a run stops at: the largest return, the smallest loss."""
        return self.direction.hardest(values)


def about(task: TaskConfig) -> TaskFacts:
    """What the configured `task` declares (`TaskFacts`)."""
    registered = REGISTRY.get(task.name)

    def declared(name: str, default: Any) -> Any:
        return getattr(registered, name) if registered is not None else default

    if task.name == CUSTOM:
        unit = str(task.options.get(UNIT) or "examples")
        label = str(task.options.get(TARGET) or task.name)
    elif task.name == SCRIPT:  # its script or program: `script train.py`
        unit = str(task.options.get("unit") or "examples")
        label = f"script {script_label(str(task.options.get('command', '')))}"
    else:
        unit, label = str(declared("unit", "examples")), task.name
    return TaskFacts(name=task.name, label=label, unit=unit,
                     metric=str(declared("metric", "loss")),
                     direction=targets.Direction.of(declared(targets.KEY, False)))


def with_unit(task: TaskConfig, unit: str | None) -> TaskConfig:
    """`task` with a custom task's declared unit recorded (unchanged for a registered task,
    whose registry entry says it, or for `unit` None)."""
    if task.name != CUSTOM or unit is None:
        return task
    return TaskConfig(task.name, {**task.options, UNIT: unit})


def _known(name: str, options: dict[str, Any], schema: type) -> dict[str, Any]:
    """`options`, ConfigError naming the first key `schema` does not have."""
    known = {f.name for f in fields(schema)}
    unknown = set(options) - known
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"task.{key}: not an option of task {name}; "
                          f"known: {', '.join(sorted(known))}")
    return options


def _custom_options(options: dict[str, Any]) -> dict[str, Any]:
    target = options.get(TARGET)
    if not isinstance(target, str) or not target.strip():
        raise ConfigError("task=custom needs the function that builds your task: "
                          "task._target_=mymodule.make_task (docs/tasks.md)")
    module, _, attr = target.replace(":", ".").rpartition(".")
    if not module or not attr:
        raise ConfigError(f"task._target_={target}: give module.function, e.g. "
                          "mymodule.make_task")
    unit = options.get(UNIT)
    if unit is not None and (not isinstance(unit, str) or not unit.strip()):
        raise ConfigError(f"task.{UNIT}: {unit!r} is not a unit; give a word such as tokens")
    return dict(options)


def resolve(target: str) -> Any:
    """The object a `module:function` (or dotted `module.function`) path names."""
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def importable_cwd() -> None:
    """Make the working directory importable here and in every process started from here
    (local workers, torchrun, Slurm jobs inherit PYTHONPATH): a user's task module beside the
    command is found as it is by `python -m`."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *paths])


def resolve_custom(target: str) -> Any:
    """A user's task-building function; ConfigError naming what is wrong if it cannot be."""
    importable_cwd()
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    # No __pycache__ beside the user's module: a launch writes only inside its sweep folder.
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module.startswith(err.name):
            raise ConfigError(f"task._target_={target}: no module named {err.name!r} (put "
                              f"{module.replace('.', '/')}.py in the working directory or on "
                              "PYTHONPATH)") from None
        raise
    finally:
        sys.dont_write_bytecode = saved
    if not hasattr(loaded, attr):
        raise ConfigError(f"task._target_={target}: module {module!r} has no {attr!r}")
    function = getattr(loaded, attr)
    if not callable(function):
        raise ConfigError(f"task._target_={target}: {attr!r} is a "
                          f"{type(function).__name__}, not a callable that builds the task")
    return function


def make_task(name: str, options: dict[str, Any], seed: int) -> Task:
    """Build a task: a registered one from its options, a custom one by calling its
    `_target_` with `seed=` and the other options as keyword arguments."""
    if name == SCRIPT:
        raise ConfigError("task=script runs a command, not a task object: its runs are "
                          "started by gnsweep.training.script_runner")
    if name == CUSTOM:
        kwargs = {k: v for k, v in options.items() if k not in (TARGET, UNIT)}
        made_custom: Task = resolve_custom(options[TARGET])(seed=seed, **kwargs)
        return made_custom
    task = entry(name)
    made: Task = resolve(task.target)(task.options(**options), seed)
    return made
