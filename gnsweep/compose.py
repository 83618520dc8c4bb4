"""The configuration composed from `conf/` with Hydra: the overrides of the command line, the
defaults the dataclasses of `gnsweep.config` hold (given to Hydra once, `_store_defaults`), the
rules that only a composed command line can check (a custom task's own grid, a sweep named
after its task, the loss window in the task's unit), and Hydra's errors in one line each.

Composition happens once, in the process that launches (the CLI); workers read the written
config.yaml back through `gnsweep.config.Config` without Hydra.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import asdict, fields
from pathlib import Path

from gnsweep import redact, store, tasks
from gnsweep.config import MOVED, SECTIONS, Config, SweepConfig
from gnsweep.errors import ConfigError
from gnsweep.targets import LOSS_EMA_SAMPLES
from gnsweep.tasks.script import sweep_name as script_sweep_name

__all__ = ["GRID_FIELDS", "compose", "conf_dir", "in_task_units"]


def _plain_yaml(folder: Path) -> None:
    """Refuse (StoreError naming file and line) a YAML file of the conf folder with an anchor or
    alias or nested too deep (`store.load_yaml`), before Hydra expands it: a few lines of
    aliases expand to billions of nodes. Only files with what may be one (`&name`, `*name`
    after a space or bracket, outside comments) are parsed here."""
    maybe = re.compile(r"(?:^|[\s\[{,])[&*][^\s,\[\]{}]", re.MULTILINE)
    for path in sorted(folder.rglob("*.yaml")):
        text = store.read_text(path)
        if maybe.search(re.sub(r"(?:^|\s)#.*$", "", text, flags=re.MULTILINE)):
            store.load_yaml(text, path)


def conf_dir() -> Path:
    """The `conf/` folder: $GNSWEEP_CONF, else the one beside the package (repo checkout)."""
    env = os.environ.get("GNSWEEP_CONF")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here / "conf", here.parent / "conf"]
    for path in candidates:
        if (path / "config.yaml").is_file():
            return path
    raise ConfigError("cannot find conf/config.yaml; set GNSWEEP_CONF to your conf folder")


def compose(overrides: list[str] | None = None, *, grid: tuple[str, ...] | None = None,
            custom: bool | None = None) -> Config:
    """Compose conf/ with Hydra overrides (e.g. `task=digits sweep.batch_sizes=[8,64]`).

    A custom task must give its own `grid` (GRID_FIELDS by default; a branch sweep, whose
    targets are relative, needs no sweep.targets); `custom` says whether the task is custom when
    the overrides do not (a branch sweep trains its base run's task)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides or [])
    _store_defaults()
    _plain_yaml(conf_dir())
    GlobalHydra.instance().clear()
    given = overrides
    overrides = [_verbatim(o) for o in overrides]
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides,
                                return_hydra_config=True)
            sweep_file = str(cfg.hydra.runtime.choices.get("sweep"))
            with open_dict(cfg):
                del cfg["hydra"]
    except MissingConfigException as err:
        raise ConfigError(_missing_config_message(str(err))) from None
    except (HydraException, OmegaConfBaseException) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(_masked(_override_message(first, overrides), overrides)) from None
    finally:
        GlobalHydra.instance().clear()
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    # Typed (each section checks its values), then the task checked against the registry.
    config = tasks.checked(Config.from_dict({str(k): v for k, v in data.items()}))
    _check_custom_grid(config, sweep_file, given, GRID_FIELDS if grid is None else grid,
                       config.task.name in (tasks.CUSTOM, tasks.SCRIPT) if custom is None
                       else custom)
    return _named_after_task(config, sweep_file, given)


VERBATIM = ("task.command", "task.log_pattern", "task.log_file", "task.resume_args", "task.cwd")
"""Settings taken as written on the command line, never parsed by Hydra's grammar: a command's
`{placeholders}`, spaces and quotes, a regular expression's brackets and backslashes."""


def _verbatim(override: str) -> str:
    """`task.command=python train.py --bs={batch_size}` as Hydra's quoted string (its quotes
    and a trailing backslash escaped, `${` kept literal); a value already in quotes, another
    key, or a deletion (`~key`) unchanged. `task.columns={...}` is added as a new key (Hydra
    cannot add keys to an empty mapping node)."""
    key, sep, value = override.partition("=")
    if key == "task.columns" and sep:
        return f"+{override}"
    if not sep or key.lstrip("+") not in VERBATIM or key.startswith("~") \
            or (len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""):
        return override
    trailing = len(value) - len(value.rstrip("\\"))
    body = value.replace("\\'", "\\\\'").replace("'", "\\'").replace("${", "\\${")
    return f"{key}='{body}" + "\\" * trailing + "'"


def in_task_units(config: Config, per_sample: float, overrides: list[str]) -> Config:
    """The config with the default loss EMA (`LOSS_EMA_SAMPLES` samples, where
    `sweep.loss_ema_examples` is neither overridden nor changed by a sweep file) converted to
    the task's unit at `per_sample` examples a sample, so that it means the same training for
    a task in tokens as for one in examples (128 tokens would be half a step at 16 sequences
    of 16 tokens). A value given is the user's, in the task's unit, and kept."""
    named = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    sweep = config.sweep
    if per_sample == 1 or "sweep.loss_ema_examples" in named \
            or sweep.loss_ema_examples != LOSS_EMA_SAMPLES:
        return config
    ema = float(f"{LOSS_EMA_SAMPLES * per_sample:.6g}")
    return dataclasses.replace(config, sweep=dataclasses.replace(sweep, loss_ema_examples=ema))


def _named_after_task(config: Config, sweep_file: str, overrides: list[str]) -> Config:
    """A custom task on the default sweep file, its name not given: the sweep is named after
    the task (its `_target_`, e.g. `mytask.make_task`), so that its default folder is
    runs/<that>, not the digits sweep's."""
    named = {o.lstrip("+").split("=", 1)[0] for o in overrides}
    if config.task.name not in (tasks.CUSTOM, tasks.SCRIPT) or sweep_file != SweepConfig.name \
            or "sweep.name" in named or config.sweep.name != SweepConfig.name:
        return config
    if config.task.name == tasks.SCRIPT:  # named after its script: python train.py -> train
        name = script_sweep_name(str(config.task.options.get("command", "")))
    else:
        label = tasks.about(config.task).label
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or tasks.CUSTOM
    return dataclasses.replace(config, sweep=dataclasses.replace(config.sweep, name=name))


GRID_FIELDS = ("batch_sizes", "learning_rates", "targets")
"""What a grid is made of: a custom task has to give each (or a sweep file that does), but for
its targets, which default to `auto` (chosen from the runs)."""


def _check_custom_grid(config: Config, sweep_file: str, overrides: list[str],
                       grid: tuple[str, ...], custom: bool) -> None:
    """A custom task with the default sweep file's grid would silently run the digits grid
    (its batch sizes, its learning rates, its loss targets): ConfigError asking for a grid.

    A grid field counts as given when an override names it or its value is not the default
    (a `+experiment=` bundle may set it)."""
    if not custom or sweep_file != SweepConfig.name:
        return
    defaults = SweepConfig()
    named = {o.lstrip("+").split("=", 1)[0] for o in overrides}
    missing = [f"sweep.{name}" for name in grid
               if f"sweep.{name}" not in named
               and getattr(config.sweep, name) == getattr(defaults, name)]
    if "sweep.targets" in missing:  # a loss scale nobody knows yet: chosen from the runs
        missing.remove("sweep.targets")
        config.sweep.targets = []
    if missing:
        raise ConfigError(f"task={config.task.name} needs a grid of its own "
                          f"({', '.join(missing)} would be "
                          f"the {SweepConfig.name} task's): add sweep=NAME (a file of conf/sweep, "
                          "e.g. sweep=tiny) or " + " ".join(f"{m}=[...]" for m in missing))


def _store_defaults() -> None:
    """Give Hydra the dataclass defaults, the one place they are kept: `gnsweep_defaults` (every
    section but the task) is merged first, so a group's YAML lists only what it changes and
    every setting can be overridden; `task_defaults/<name>` holds a task's options, which its
    YAML file extends."""
    from hydra.core.config_store import ConfigStore

    store_ = ConfigStore.instance()
    base = Config().to_dict()
    del base["task"]
    store_.store(name="gnsweep_defaults", node=base)
    for name in tasks.task_names():
        options = asdict(tasks.REGISTRY[name].options())
        store_.store(group="task_defaults", name=name, node={"name": name, **options})
    # `columns` (a mapping) is left out: Hydra cannot add keys to an empty mapping node, so
    # `task.columns={...}` is added as a new key instead (`_verbatim`).
    script = {f.name: f.default for f in fields(tasks.ScriptOptions) if f.name != "columns"}
    store_.store(group="task_defaults", name=tasks.SCRIPT, node={"name": tasks.SCRIPT, **script})


def _override_message(first: str, overrides: list[str]) -> str:
    """Hydra's first line about an override, with the fix where it is known: a key the task
    node lacks is added with `+task.KEY=VALUE` (a task's options are open); a key another
    section lacks is not a setting, and the known ones are listed."""
    ambiguous = re.match(r"Ambiguous value for argument '([+~]?[\w.]+)=(.*)'", first)
    if ambiguous:  # Hydra reads `key=a,b` as a sweep over a and b
        key, value = ambiguous.groups()
        if redact.is_secret_name(key.lstrip("+~")):  # one string, never a list
            return (f"{key}: a comma in its value reads as a list of values; give it as one "
                    f"string in quotes, e.g. '{key}=\"...\"'")
        return f"{key}={value}: write a list in brackets, {key}=[{value}]"
    match = re.match(r"Could not override '((\w+)\.([\w.]+))'", first)
    if not match:
        return f"bad override: {first}"
    key, section, name = match.groups()
    value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key), "VALUE")
    if (section, name) in MOVED:
        return f"{key} is now {MOVED[section, name]}: write {MOVED[section, name]}={value}"
    if section == "task":
        return (f"task.{name}: the task node has no key {name}; to add one, write "
                f"+task.{name}={value}")
    schema = SECTIONS.get(section)
    if schema is None:
        return f"bad override: {first}"
    known = ", ".join(sorted(f.name for f in fields(schema)))
    return f"{key}: unknown option; known: {known}"


def _masked(message: str, overrides: list[str]) -> str:
    """`message` with the value of every secret override (`+task.api_key=...`) masked wherever
    it appears, whole or in part: a parser quotes what it could not read ("no viable
    alternative at input '[s3cret'"), with no name beside it to mask by."""
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not value or not redact.is_secret_name(key.lstrip("+~")):
            continue
        pieces = [value, *re.split(r"[\s\[\]{}(),'\"]+", value)]
        for piece in sorted({p for p in pieces if len(p) >= 3}, key=len, reverse=True):
            message = message.replace(piece, redact.MASK)
    return message


def _missing_config_message(text: str) -> str:
    match = re.search(r"Could not load '(\w+)/(\w[\w-]*)'", text) or re.search(
        r"'(\w+)/(\w[\w-]*)'", text)
    if not match:
        return text.strip().splitlines()[0]
    group, choice = match.groups()
    options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
    return f"{group}={choice}: no such {group}; choose one of {', '.join(options)}"
