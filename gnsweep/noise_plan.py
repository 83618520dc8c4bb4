"""Which runs of a sweep measure the noise scale, and on which steps (`noise.runs`).

The sweep's answer is B_simple at each target for the best-tuned run of each batch size (the
median over batch sizes, `analysis.pipeline.fit_target`), not every run's own. Measuring every
run on the steps its own precision needs made a CPU sweep cost 1.5-1.8x one that measures
nothing, and almost all of it was spent on runs whose noise scale no answer reads: the slow,
badly tuned learning rates, which are also the longest runs. So, under `noise.runs=auto`:

- `dense`: in each group of runs that share a batch size (and a branch point), the
  `DENSE_PER_BATCH` learning rates nearest the best known (in log distance; ties go to the
  larger, faster rate) are measured by one run each (one seed), on the steps `noise.every`
  says;
- `needed`: a run whose own schedule reads its noise scale (adaptive, along) measures as
  `noise.every` says;
- `off`: every other run measures nothing (`noise.method=none` for that run).

The best learning rate known is that of the finished runs (of those at that batch size that
stopped at the hardest target, the fewest steps; else the lowest final loss), or, where
nothing has finished (a first launch), a guess that rises with the batch size as eq. 2.7's
best rate does (`guessed_rate`). A measuring run is pooled with the batch sizes whose median
the sweep reads (`noise.pooled`): under `noise.every=auto` it measures the fewer steps that
keep the median's error near that of one run measured on every step. A
run's assignment is decided once, when it is first handed to an executor, and never changes
after (it may have trained): a relaunch, a resume or a requeue keeps it, and the planner's
later rounds measure their new runs nearest the best rate, and a relaunch that adds a seed
measures the nearest rates a first guess left unmeasured (`plan_runs`).

The analysis reads, at each target and batch size, the best run's B_simple where it was
measured, else that of the measured run nearest its learning rate at the same batch size
(`analysis.front`), and states the median's standard error over batch sizes as before.

Pure: no I/O, no torch; the sweep folder's file is `paths.NOISE_PLAN`, read and written by
`gnsweep.folder`.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from gnsweep.config import NOISE_RUNS, Config
from gnsweep.noise import EVERY_AUTO, Method

RUNS_CHOICES = NOISE_RUNS
DENSE_PER_BATCH = 2
"""Learning rates per batch size (and branch point) measured under `noise.runs=auto`: the
best known (or guessed: `guessed_rate`) and its nearest neighbour."""
GUESS_RANGE = (0.25, 0.75)
"""`guessed_rate`: where in the grid's rate range (log space) the guess lies at the smallest
and at the largest batch size."""


ALL, DENSE, NEEDED, OFF = "all", "dense", "needed", "off"
ROLES = (ALL, DENSE, NEEDED, OFF)


class RunSpec(Protocol):
    """What the plan reads of a run (`runs.RunSpec`, which it cannot import: a floor above)."""

    @property
    def run_id(self) -> str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def learning_rate(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def exchange_rate(self) -> float: ...
    @property
    def along(self) -> bool: ...
    @property
    def at_examples(self) -> int: ...


@dataclass(frozen=True)
class Assignment:
    """One run's part in the plan."""

    role: str
    """all (noise.runs=all), dense, needed or off."""
    why: str
    """Why, in a few words (shown by `gnsweep status`, `analyze` and the report)."""
    pooled: int | None = None
    """The batch sizes whose median B_simple this run's is one of (`noise.pooled`: under
    noise.every=auto it measures the steps that keep the median's error near that of one run
    measured on every step); None: the run alone."""

    @property
    def measures(self) -> bool:
        return self.role != OFF

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.pooled is None:  # a record as before runs were pooled
            del out["pooled"]
        return out

    @classmethod
    def of(cls, data: Any) -> Assignment | None:
        """An assignment from its record, None where it is not one."""
        if not (isinstance(data, dict) and data.get("role") in ROLES
                and isinstance(data.get("why"), str)):
            return None
        pooled = data.get("pooled")
        if pooled is not None and not (isinstance(pooled, int) and pooled >= 2):
            return None
        return cls(data["role"], data["why"], pooled)


def guessed_rate(rates: Iterable[float], batch_size: int, batch_sizes: Iterable[int]) -> float:
    """The best learning rate at `batch_size` guessed before any run has finished. Eq. 2.7:
    the best rate eps_max / (1 + B_noise / B) rises with the batch size, and a grid's rates
    span the best rates of its batch sizes, so the guess lies `GUESS_RANGE[0]` of the way up
    the rates' range (log space) at the smallest batch size, `GUESS_RANGE[1]` at the largest,
    and in between by log batch size; the middle with one batch size. On the default digits
    sweep the first launch's B_simple then read 1.00 / 1.04 / 1.34 of the full measurement's
    at its three targets, where the grid's middle read 1.05 / 1.31 / 1.79
    (docs/performance.md)."""
    positive = [r for r in rates if r > 0 and math.isfinite(r)]
    sizes = sorted({b for b in batch_sizes if b > 0})
    if not positive:
        return math.nan
    if len(sizes) < 2 or batch_size <= 0:
        return middle_rate(positive)
    where = math.log(batch_size / sizes[0]) / math.log(sizes[-1] / sizes[0])
    low, high = GUESS_RANGE
    share = low + (high - low) * min(max(where, 0.0), 1.0)
    return math.exp(math.log(min(positive)) + share * math.log(max(positive) / min(positive)))


def middle_rate(rates: Iterable[float]) -> float:
    """The grid's middle learning rate in log space (the geometric midpoint of its range)."""
    positive = [r for r in rates if r > 0 and math.isfinite(r)]
    if not positive:
        return math.nan
    return math.sqrt(min(positive) * max(positive))


def _group(spec: RunSpec) -> tuple[int, int]:
    return spec.at_examples, spec.batch_size


def plan_runs(specs: Iterable[RunSpec], runs: str, planned: Mapping[str, Assignment],
              best_lr: Mapping[tuple[int, int], float] | None = None,
              dense_per_batch: int = DENSE_PER_BATCH,
              every: int | str = "auto") -> dict[str, Assignment]:
    """The assignment of every run of `specs` not yet in `planned` (those keep theirs: a run
    planned once may have trained with it).

    `specs`: every run of the sweep (the ones already planned included). `runs`:
    `noise.runs`. `best_lr`: the best learning rate known per (at_examples, batch_size) group
    (`best_rates`); a group without one takes the rate guessed (`guessed_rate`). Per
    group, the `dense_per_batch` rates nearest the best in log distance (ties: the larger
    rate) are measured, each by one run: the lowest seed not yet planned, unless a run at
    that rate measures already. So a later round's runs nearer the best measure, and a
    relaunch that adds a seed measures the nearest rates that an earlier guess left
    unmeasured. Under `every` (`noise.every`) auto, a dense run is pooled with the other
    batch sizes at its branch point (`Assignment.pooled`: the sweep reads their median)."""
    if runs not in RUNS_CHOICES:
        raise ValueError(f"noise.runs={runs!r}: choose one of {', '.join(RUNS_CHOICES)}")
    specs = list(specs)
    out: dict[str, Assignment] = {}
    if runs == ALL:
        return {s.run_id: Assignment(ALL, "noise.runs=all") for s in specs
                if s.run_id not in planned}
    groups: dict[tuple[int, int], list[RunSpec]] = defaultdict(list)
    for spec in specs:
        if spec.exchange_rate > 0 or spec.along:
            if spec.run_id not in planned:
                out[spec.run_id] = Assignment(NEEDED, "its batch size follows its own noise "
                                                      "scale")
            continue
        groups[_group(spec)].append(spec)
    known = best_lr or {}
    sizes: dict[int, set[int]] = defaultdict(set)
    for at_examples, batch_size in groups:
        sizes[at_examples].add(batch_size)
    for key, members in groups.items():
        pooled = len(sizes[key[0]]) if len(sizes[key[0]]) > 1 and every == EVERY_AUTO else None
        best = known.get(key, math.nan)
        told = ("the best learning rate so far" if math.isfinite(best)
                else "the rate eq. 2.7 guesses")
        if not math.isfinite(best):
            best = guessed_rate((s.learning_rate for s in members), key[1], sizes[key[0]])
        order = sorted(members, key=lambda s: (_distance(s.learning_rate, best),
                                               -s.learning_rate, s.seed))
        nearest = list(dict.fromkeys(s.learning_rate for s in order))[:dense_per_batch]
        measured = {s.learning_rate for s in members
                    if (a := planned.get(s.run_id)) is not None and a.measures}
        for spec in order:
            if spec.run_id in planned:
                continue
            lr = spec.learning_rate
            if lr in nearest and lr not in measured:
                measured.add(lr)
                out[spec.run_id] = Assignment(
                    DENSE, f"nearest {told} ({best:.3g}) at batch {spec.batch_size}", pooled)
            elif lr in nearest:
                out[spec.run_id] = Assignment(OFF, f"another run measures rate {lr:g} at "
                                                   f"batch {spec.batch_size}")
            else:
                out[spec.run_id] = Assignment(
                    OFF, f"the {dense_per_batch} rates nearer {told} ({best:.3g}) measure at "
                         f"batch {spec.batch_size}")
    return out


def _distance(lr: float, best: float) -> float:
    """Log distance, to 3 decimals: rates written rounded (0.283, 0.566, 1.13) tie where
    their exact values would, and the tie goes to the larger rate."""
    return round(abs(math.log(lr / best)), 3) if lr > 0 and best > 0 else math.inf


@dataclass(frozen=True)
class Outcome:
    """A finished run as the plan reads it (from its status.json)."""

    batch_size: int
    learning_rate: float
    at_examples: int
    steps: float
    final_loss: float
    reached: bool
    """It stopped at the sweep's hardest target."""


def best_rates(outcomes: Iterable[Outcome], falling: bool = True) -> dict[tuple[int, int], float]:
    """The best learning rate per (at_examples, batch_size) among finished runs: of those that
    reached the hardest target, the one with the fewest steps; where none did, the lowest
    final loss (the highest where the metric rises)."""
    groups: dict[tuple[int, int], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        if o.learning_rate > 0 and (o.reached or math.isfinite(o.final_loss)):
            groups[(o.at_examples, o.batch_size)].append(o)
    out = {}
    sign = 1.0 if falling else -1.0
    for key, members in groups.items():
        reached = [o for o in members if o.reached and math.isfinite(o.steps)]
        if reached:
            out[key] = min(reached, key=lambda o: (o.steps, -o.learning_rate)).learning_rate
        else:
            out[key] = min(members, key=lambda o: (sign * o.final_loss,
                                                   -o.learning_rate)).learning_rate
    return out


def measured_as_planned(config: Config, assignment: Assignment | None) -> Config:
    """The config a run trains with under its assignment: `config` itself, or a copy whose
    `noise.pooled` is the plan's (the batch sizes whose median it is one of), or, for a run planned
    off, a copy with noise.method=none and no B_noise or probes either (a script's run alike:
    whatever measures inside the script reads its run's noise section)."""
    if assignment is None or (assignment.measures and assignment.pooled is None):
        return config
    out = copy.copy(config)
    if assignment.pooled is not None:
        out.noise = copy.copy(config.noise)
        out.noise.pooled = assignment.pooled
        return out
    # Set, not `replace`d: the cross-section check refuses a method for a script sweep that
    # the plan, not the user, chose.
    out.noise = replace(config.noise, method=str(Method.NONE), hessian_every=0,
                        probe_per_octave=0.0)
    return out


def summary(plan: Mapping[str, Assignment]) -> str:
    """One line: how many runs measure, and why the others do not."""
    if not plan:
        return "noise plan: none recorded"
    counts: dict[str, int] = defaultdict(int)
    for a in plan.values():
        counts[a.role] += 1
    measured = len(plan) - counts[OFF]
    if counts[ALL] == len(plan):
        return f"noise plan: every run measures (noise.runs=all, {len(plan)} runs)"
    parts = [f"{counts[r]} {r}" for r in (DENSE, NEEDED, ALL) if counts[r]]
    pooled = sorted({a.pooled for a in plan.values() if a.measures and a.pooled})
    on = (f", each on the steps its share of the median over {' or '.join(map(str, pooled))} "
          "batch sizes needs" if pooled else "")
    return (f"noise plan (noise.runs=auto): {measured} of {len(plan)} runs measure "
            f"({', '.join(parts)}: nearest the best learning rate of each batch size{on}); "
            f"{counts[OFF]} off")
