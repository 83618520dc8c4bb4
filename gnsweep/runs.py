"""Runs as data: the grid point (`RunSpec`), the grid's expansion (pure), a run's record (what a
worker needs to train it, `runs/<id>/config.json`), its typed state and how retries are counted.

A leaf under the orchestration: the sweep folder (`gnsweep.folder`), the sweep, the executors
and training import it; it imports the config, the task registry (a record's task checked,
`tasks.checked`) and the store.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from gnsweep import redact, store, tasks
from gnsweep.config import Config, ConfigError
from gnsweep.noise import Method
from gnsweep.paths import METRICS, RUN_ID, SWEEP_CONFIG, SweepPaths, run_dir
from gnsweep.store import FINISHED, RunState, RunStatus, StoreError

__all__ = [
    "EVALS_PER_OCTAVE",
    "FINISHED",
    "OUT_OF_SPACE",
    "RELAUNCH_MAY_CHANGE",
    "WILL_REPEAT",
    "RunSpec",
    "RunState",
    "branch_budget",
    "check_record",
    "check_records",
    "checked_record",
    "config_differences",
    "distinct_ids",
    "expand_grid",
    "fresh_retries",
    "ids_free",
    "max_attempts",
    "needs_running",
    "parse_run_record",
    "parse_spec",
    "read_state",
    "run_config",
    "run_record",
    "unmeasured_line",
    "unmeasured_share",
    "write_run",
]

OUT_OF_SPACE = "out_of_space"
"""The `reason` of a run that failed because the disk (or its quota) was full: the launch it
failed in does not retry it (the next attempt would fail alike); a relaunch tries it again."""

WILL_REPEAT = "will_repeat"
"""The `reason` of a run whose failure every attempt would repeat (a script's output breaking
a parse rule, its program not found, a bad-input exit): recorded failed after one attempt,
not retried by its launch; a relaunch (after the fix) tries it again."""

UNMEASURED_SHARE = 0.1
"""A run whose B_simple is NaN on more than this share of its logged steps is named by the
launch's summary, `gnsweep status` and the report (`unmeasured_line`): a noise scale missing
on most of a run must never pass in silence."""

# Settings a relaunch may change: where and how runs execute, the grid (runs are added), the
# analysis and where runs are logged. Anything else changes what a run trains, and mixing them
# would corrupt the fits.
# Adaptive runs name their exchange rate and eps_max in their id: adding them (or more) to a
# folder adds runs, as a larger grid does.
RELAUNCH_MAY_CHANGE = ("executor", "analysis", "logger", "sweep.name", "sweep.batch_sizes",
                       "sweep.learning_rates", "sweep.seeds", "sweep.max_retries",
                       "sweep.schedule", "sweep.exchange_rates", "sweep.eps_max",
                       "sweep.along_from", "sweep.along_points",
                       "sweep.adaptive_lr", "sweep.adaptive_lr_noise", "sweep.stall_seconds",
                       "train.checkpoint_every", "train.checkpoint_seconds",
                       "train.keep_checkpoints")


def config_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """`key: old -> new` for every setting that differs (nested keys dotted), sorted."""
    out = []
    # Keys only one side has come from another gnsweep version's schema, not from the user.
    for key in sorted(set(old) & set(new)):
        name = f"{prefix}{key}"
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{name}.")
        elif not same_value(a, b):
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def same_value(a: Any, b: Any) -> bool:
    """Whether two settings are the same value: equal, NaN and NaN (a NaN never equals itself,
    so a folder whose config holds one would refuse its own files), lists alike item by item."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return bool(a == b)


@dataclass(frozen=True, order=True)
class RunSpec:
    """One point of the grid, or one adaptive run (`exchange_rate` > 0)."""

    batch_size: int
    """Samples per step; 0 for an adaptive run (its batch size follows the noise scale)."""
    learning_rate: float
    """The learning rate; an adaptive run's eps_max (eq. 2.7: eps(B) = eps_max/(1 + B_noise/B))."""
    seed: int = 0
    exchange_rate: float = 0.0
    """Appendix D's exchange rate r (examples per step) of an adaptive run; 0 for a grid run."""
    lr_noise: float = 0.0
    """An adaptive run's fixed B_noise in its learning-rate rule (0: the measured one)."""
    along: bool = False
    """A run whose batch size follows a measured critical batch size along training
    (`schedule.AlongBatch`, docs/along.md); `learning_rate` is then eq. 2.7's eps_max."""
    at_examples: int = 0
    """A branch run's point: it starts from the base run's checkpoint after this many examples
    (`config.branch.point(at_examples)`, docs/along.md); 0 for a run from initialisation."""

    @property
    def adaptive(self) -> bool:
        return self.exchange_rate > 0

    @property
    def run_id(self) -> str:
        if self.along:  # never a grid run's id: those start with b
            return f"along_lr{self.learning_rate:.4g}_bn{self.lr_noise:.4g}_s{self.seed}"
        if self.adaptive:  # never a grid run's id: those start with b
            noise = f"_bn{self.lr_noise:.4g}" if self.lr_noise > 0 else ""
            return f"r{self.exchange_rate:.4g}_lr{self.learning_rate:.4g}{noise}_s{self.seed}"
        # Zero-padded batch size so that folders sort by batch size; a branch run's id starts
        # with its point (examples seen by the base run there).
        grid = f"b{self.batch_size:05d}_lr{self.learning_rate:.4g}_s{self.seed}"
        return f"at{self.at_examples}_{grid}" if self.at_examples else grid


def expand_grid(config: Config) -> list[RunSpec]:
    """Every (batch size, learning rate, seed) of the sweep, small batches first; with
    sweep.schedule=adaptive then one adaptive run per (exchange rate, seed), at eps_max
    `sweep.eps_max` (resolved from the sweep's fit before the grid is expanded, by
    `gnsweep.sweep.resolve_adaptive_lr`)."""
    sweep = config.sweep
    grid = sorted(RunSpec(b, lr, s) for b in sweep.batch_sizes for lr in sweep.learning_rates
                  for s in sweep.seeds)
    distinct_ids(grid)
    if sweep.schedule == "along":
        if not (sweep.eps_max > 0 and sweep.adaptive_lr_noise > 0 and sweep.along_points):
            raise ConfigError("sweep.schedule=along needs its curve and learning-rate rule: "
                              "sweep.along_from=DIR (an analysed branch sweep) and this "
                              "folder's fixed-batch fit (gnsweep analyze DIR first), or "
                              "sweep.eps_max and sweep.adaptive_lr_noise")
        return grid + [RunSpec(0, sweep.eps_max, s, lr_noise=sweep.adaptive_lr_noise, along=True)
                       for s in sweep.seeds]
    if sweep.schedule != "adaptive":
        return grid
    if not sweep.eps_max > 0:
        raise ConfigError("sweep.schedule=adaptive needs eps_max: set sweep.eps_max=..., or "
                          "analyse the sweep's fixed-batch runs first (gnsweep analyze DIR)")
    return grid + [RunSpec(0, sweep.eps_max, s, r, sweep.adaptive_lr_noise)
                   for r in sweep.exchange_rates for s in sweep.seeds]


def distinct_ids(specs: list[RunSpec]) -> list[RunSpec]:
    """`specs`, checked to make one run id each: two grid points whose values differ only
    below the id's 4 significant digits (learning rates 0.3 and 0.3000000000001) would share
    one folder and one of them never train. ConfigError (exit 2) naming both."""
    seen: dict[str, RunSpec] = {}
    for spec in specs:
        other = seen.setdefault(spec.run_id, spec)
        if other != spec:
            differ = [f"{f.name} {getattr(other, f.name)!r} and {getattr(spec, f.name)!r}"
                      for f in fields(RunSpec) if getattr(other, f.name) != getattr(spec, f.name)]
            raise ConfigError(f"grid points with {', '.join(differ)} make one run id "
                              f"{spec.run_id!r} (ids keep 4 significant digits), so one would "
                              "never train: give values that differ in their first 4 digits")
    return specs


def ids_free(sweep_dir: Path, specs: list[RunSpec]) -> None:
    """Refuse (ConfigError, before the folder's config.yaml changes) a grid point whose run id
    is taken in the folder by another grid point, one within the id's precision of it."""
    for spec in specs:
        path = SweepPaths(sweep_dir).run(spec.run_id).record
        if not store.is_regular(path):
            continue  # none yet, or refused with its reason where the record is read
        data = store.read_json(path)
        if isinstance(data, dict):
            recorded = parse_spec(data.get("run"), path)
            if recorded != spec:
                distinct_ids([recorded, spec])


def run_config(config: Config, spec: RunSpec) -> Config:
    """What one run trains with, derived from the sweep's config and its grid point alone: the
    sweep's config, except for a branch run (`branch_budget`): with `branch.targets` it stops at
    its branch point's own targets (the fractions of the loss there,
    `Direction.relative_target`); with automatic targets it trains one window of examples
    and stops at no target. A branch sweep read on the eval loss evaluates EVALS_PER_OCTAVE
    times per doubling of its steps unless `sweep.eval_every` or `eval_per_octave` say
    otherwise."""
    if not spec.at_examples:
        return config
    branch, sweep = config.branch, config.sweep
    point = branch.point(spec.at_examples)
    changes: dict[str, Any] = {}
    if branch.automatic:
        steps, examples = branch_budget(config, spec.batch_size)
        changes.update(max_steps=steps or sweep.max_steps, max_examples=examples)
    else:
        direction = tasks.about(config.task).direction
        changes["targets"] = [direction.relative_target(point["at_loss"], f)
                              for f in branch.targets]
    if config.analysis.loss == "eval" and not (sweep.eval_every or sweep.eval_per_octave):
        changes["eval_per_octave"] = EVALS_PER_OCTAVE
    return replace(config, sweep=replace(sweep, **changes))


EVALS_PER_OCTAVE = 16
"""How often a branch run read on the eval loss evaluates by default: 16 times per doubling of
its steps (every step up to 32, every 2nd up to 64, ...), a resolution of 1/16 of the steps to
any target however near or far (every 32nd step of a 1,024-step run read a linreg target 48
steps away as 48.8 at B = 4 and 55.4 at B = 8, and the fit's B_crit at 0.5-0.6 x the exact)."""


def branch_budget(config: Config, batch_size: int) -> tuple[int, int]:
    """(max_steps, max_examples) of a branch run with automatic targets: one window, the same
    examples at every batch size. `branch.window` examples (in the task's unit; steps 0: as
    many as it takes), else `branch.window_steps` steps of the grid's largest batch size
    (examples 0), so that a batch size k times smaller trains k times the steps."""
    branch = config.branch
    if branch.window:
        return 0, branch.window
    largest = max(config.sweep.batch_sizes)
    return max(1, math.ceil(branch.window_steps * largest / batch_size)), 0


def run_record(config: Config, spec: RunSpec) -> dict[str, Any]:
    """What a worker needs to train one run, as JSON: the sweep's resolved config (secrets
    masked, `gnsweep.redact`) and the grid point. A script run's has no `train` section: gnsweep's
    own loop's recipe describes nothing its command does (its recipe is `task.optimizer` ...)."""
    written = config.to_dict()
    if config.task.name == tasks.SCRIPT:
        written.pop("train", None)
    return {"run_id": spec.run_id, "run": asdict(spec), "config": redact.config(written)}


def parse_spec(data: Any, where: Path | str) -> RunSpec:
    """A run's grid point from its record, every field type-checked (a seed must be an int, not
    "0/../X"); StoreError naming `where` otherwise."""
    if not isinstance(data, dict):
        raise StoreError(f"{where}: no run spec (a mapping under \"run\")")
    known = {f.name: f for f in fields(RunSpec)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise StoreError(f"{where}: run.{unknown[0]}: not a field of a run")
    for name, value in data.items():
        kind = known[name].type
        if kind == "bool":
            ok, wanted = isinstance(value, bool), "true or false"
        elif kind == "int":
            ok, wanted = isinstance(value, int) and not isinstance(value, bool), "an integer"
        else:
            ok, wanted = (isinstance(value, int | float) and not isinstance(value, bool)
                          and math.isfinite(value)), "a finite number"
        if not ok:
            raise StoreError(f"{where}: run.{name}: {str(value)[:60]!r} is not {wanted}")
    try:
        return RunSpec(**data)
    except TypeError as err:
        raise StoreError(f"{where}: no valid run spec ({err})") from None


def _record_differences(expected: dict[str, Any], recorded: Any) -> list[str]:
    """Settings of a run's recorded config that make it train otherwise than the sweep's."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("task"), dict):
        return ["config: missing"]
    out = [d for d in config_differences(recorded, expected)
           if not d.split(":")[0].startswith(RELAUNCH_MAY_CHANGE)]
    # A planned run (`gnsweep plan`) may have a smaller step budget than the sweep: a cap.
    steps = (recorded.get("sweep") or {}).get("max_steps")
    if (isinstance(steps, int) and not isinstance(steps, bool)
            and 1 <= steps <= expected["sweep"]["max_steps"]):
        out = [d for d in out if not d.startswith("sweep.max_steps:")]
    task, want = recorded["task"], expected["task"]
    if task.get("name") != want.get("name"):
        out.append(f"task.name: {task.get('name')!r} -> {want.get('name')!r}")
    options, wanted = task.get("options") or {}, want.get("options") or {}
    if not isinstance(options, dict):
        out.append("task.options: not a mapping")
    else:
        # An option the sweep does not name (a custom `_target_`, say) is never taken from a
        # run file; one the sweep names that an older record lacks reads as its default.
        out += [f"task.{key}: {options[key]!r} is not in the sweep's config.yaml"
                for key in sorted(set(options) - set(wanted))]
    return sorted(set(out))


def check_record(data: Any, path: Path, run_id: str, expected: dict[str, Any]) -> RunSpec:
    """A run file's grid point, once the file is checked against the sweep: its id is its
    folder's, its grid point makes that id, and its config trains as the sweep's config.yaml
    (`expected`, redacted) says. StoreError (exit 2) naming the file and the first setting
    that disagrees, and what to do."""
    if not isinstance(data, dict) or "run" not in data:
        raise StoreError(f"{path}: not a run file of gnsweep (no \"run\" entry); remove "
                         f"{path.parent} and relaunch to write it again")
    spec = parse_spec(data["run"], path)
    named = data.get("run_id")
    if not isinstance(named, str) or not RUN_ID.fullmatch(named) or ".." in named:
        raise StoreError(f"{path}: its run_id {str(named)[:80]!r} is not a valid run id (one "
                         "folder name such as b00008_lr0.1_s0; a path would escape the run's "
                         f"folder); remove {path.parent} and relaunch to write it again")
    if named != run_id:
        raise StoreError(f"{path}: names run {named!r} but lies in folder {run_id!r}; remove "
                         f"{path.parent} and relaunch to write it again")
    if spec.run_id != run_id:
        raise StoreError(f"{path}: its grid point makes run {spec.run_id!r}, not {run_id!r} "
                         f"(its folder); remove {path.parent} and relaunch to write it again")
    differences = _record_differences(expected, data.get("config"))
    if differences:
        raise StoreError(
            f"{path}: disagrees with the sweep's {SWEEP_CONFIG} (run file -> sweep: "
            f"{redact.text('; '.join(differences[:3]))}); a run file is never trusted over "
            f"the sweep's config: remove {path.parent} and relaunch to write it again")
    return spec


def check_records(sweep_dir: Path, config: Config, run_ids: list[str]) -> None:
    """Check every run file of the folder, and those of `run_ids` that exist, against the
    sweep's `config` (`check_record`); StoreError names the first that disagrees."""
    expected = expected_record_config(config)
    accepted: set[str] = set()
    for run_id in sorted(set(store.run_ids(sweep_dir)) | set(run_ids)):
        path = SweepPaths(sweep_dir).run(run_id).record
        if not (path.exists() or path.is_symlink()):
            continue
        checked_record(store.read_json(path), path, run_id, expected, accepted)


def checked_record(data: Any, path: Path, run_id: str, expected: dict[str, Any],
             accepted: set[str] | None = None) -> RunSpec:
    """`check_record`, and the record's config typed (`Config.from_dict`) unless one equal to
    it is in `accepted` (which it then joins)."""
    import json

    spec = check_record(data, path, run_id, expected)
    key = json.dumps(data["config"], sort_keys=True, default=str)
    if accepted is not None and key in accepted:
        return spec
    try:  # a setting only the run file has, or of the wrong type, that the sweep lacks
        tasks.checked(Config.from_dict(data["config"]))
    except ConfigError as err:
        raise StoreError(f"{path}: {err}; remove {path.parent} and relaunch to write it "
                         "again") from None
    if accepted is not None:
        accepted.add(key)
    return spec


def expected_record_config(config: Config) -> dict[str, Any]:
    """The config part a run file must agree with (redacted as it is on disk)."""
    return redact.config(config.to_dict())


def parse_run_record(data: dict[str, Any]) -> tuple[Config, RunSpec]:
    """(config, spec) of a run record; the config's masked secrets restored from what the
    launcher handed down (`gnsweep.redact`)."""
    config = redact.restore(dict(data["config"]), redact.exported())
    return _typed(config), parse_spec(data["run"], "run record")


_TYPED: dict[str, Config] = {}
"""The run records' configs this process has typed: the runs of one sweep share theirs, so a
worker serving many runs validates it once."""


def _typed(config: dict[str, Any]) -> Config:
    import copy
    import json

    key = json.dumps(config, sort_keys=True, default=str)
    if key not in _TYPED:
        if len(_TYPED) >= 8:
            _TYPED.pop(next(iter(_TYPED)))
        _TYPED[key] = tasks.checked(Config.from_dict(config))
    return copy.deepcopy(_TYPED[key])


def write_run(sweep_dir: Path, config: Config, spec: RunSpec) -> None:
    """Write a run's record unless it exists (a run's record never changes once written);
    an existing one is checked against the sweep (`check_record`)."""
    path = SweepPaths(sweep_dir).run(spec.run_id).record
    if path.exists() or path.is_symlink():
        recorded = check_record(store.read_json(path), path, spec.run_id,
                                expected_record_config(config))
        if recorded != spec:  # a grid point within the id's precision of one already run
            distinct_ids([recorded, spec])
    else:
        store.write_json(path, run_record(config, spec))


def read_state(run_path: Path) -> RunStatus:
    """A run's status as the sweep acts on it: a run recorded done or diverged whose metrics
    are missing or unreadable needs running again (`state` pending, `lost` says why), so
    that the answer never changes in silence."""
    status = store.read_status(run_path)
    if status.state in FINISHED:
        problem = store.metrics_problem(run_path, status)
        if problem is not None:
            return status.replace(
                state=RunState.PENDING, recorded=status.state.value,
                lost=f"recorded {status.state.value} but {METRICS} is {problem}")
    return status


def needs_running(status: RunStatus, max_retries: int) -> bool:
    """Whether a run still needs running: not finished, and retries left if it failed.

    The one place retries are counted. `retry_base` is the attempt count when the current
    launch began (`fresh_retries`): each launch gives failed runs a fresh `max_retries`.
    """
    if status.state in FINISHED:
        return False
    if status.state is RunState.FAILED:
        tries = status.attempts - status.retry_base
        if status.reason in (OUT_OF_SPACE, WILL_REPEAT):
            return tries <= 0  # a retry now fails alike (a full disk, a parse rule); a relaunch
        return tries <= max_retries
    return True


def max_attempts(max_retries: int) -> int:
    """Rounds one launch gives a run whose worker or job dies before it records the death: the
    first try, `max_retries` retries, and one more for the attempt the death itself cost."""
    return max_retries + 2


def fresh_retries(sweep_dir: Path, run_ids: list[str]) -> None:
    """Give every failed run of this launch a fresh `max_retries` (a relaunch means: try again)."""
    for run_id in run_ids:
        path = run_dir(sweep_dir, run_id)
        status = store.read_status(path)
        if status.state is RunState.FAILED:
            store.write_status(path, RunState.FAILED, error=status.error,
                               retry_base=status.attempts)


def unmeasured_share(b_simple: list[float]) -> float | None:
    """The share of a run's logged steps whose B_simple is NaN (or infinite), None without any
    step logged."""
    if not b_simple:
        return None
    missing = sum(1 for v in b_simple if v is None or not math.isfinite(v))
    return missing / len(b_simple)


def unmeasured_line(shares: dict[str, float | None]) -> str | None:
    """One line naming the runs (id -> `unmeasured_share`) whose B_simple is NaN on more than
    `UNMEASURED_SHARE` of their steps, or None when there is none."""
    missing = {r: s for r, s in shares.items() if s is not None and s > UNMEASURED_SHARE}
    if not missing:
        return None
    listed = ", ".join(f"{r} ({s:.0%})" for r, s in sorted(missing.items())[:6])
    more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
    return (f"WARNING: B_simple is NaN on more than {UNMEASURED_SHARE:.0%} of the steps of "
            f"{len(missing)} run(s): {listed}{more}; the noise scale was not measured there "
            "(status.json: noise_method and b_simple_nan_share; the run's log says why; "
            "docs/noise.md)")


def measurement_note(rows: list[dict[str, Any]]) -> str | None:
    """One line on what the finished runs measured (`sweep_status` rows, their status.json's
    `noise_measured`): measurement off (`noise.method=none`: B_simple absent by design), or
    the share of steps measured over the runs; None before any run has finished."""
    known = [r["noise"] for r in rows if isinstance(r.get("noise"), dict)]
    if not known:
        return None
    off = sum(1 for n in known if n.get("method") == Method.NONE)
    steps = sum(int(n.get("steps") or 0) for n in known if n.get("method") != Method.NONE)
    measured = sum(int(n.get("measured") or 0) for n in known if n.get("method") != Method.NONE)
    parts = []
    if off:
        parts.append(f"{off} run(s) with noise measurement off (noise.method=none, or planned "
                     "off by noise.runs=auto): no B_simple")
    if steps:
        everys = sorted({str(n.get("every")) for n in known if n.get("method") != Method.NONE})
        parts.append(f"noise scale measured on {measured / steps:.0%} of {steps} steps "
                     f"(noise.every={', '.join(everys)})")
    return "; ".join(parts) if parts else None


