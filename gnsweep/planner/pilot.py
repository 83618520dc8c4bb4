"""The planner's decisions, pure: which pilot to run, which batch sizes and learning rates to try,
which step budget each run gets, and when a batch size is done. No files, no torch, no printing.

Every run the planner chooses is a point of the configured grid (`sweep.batch_sizes` x
`sweep.learning_rates`): the plan is the full grid minus the runs that cannot win, so its answer
can be compared run for run with the grid's. The rules:

1. Pilot: the grid's middle batch size at the grid's middle learning rate; if it diverges the next
   lower rate, if it reaches no target the next higher one. Its B_simple (the S_min-weighted mean
   up to each target, DESIGN.md) predicts B_crit at each target.
2. Batch sizes: the grid's batch sizes in [min B_pred / SPREAD, max B_pred * SPREAD]. With
   S = S_min (1 + B_crit/B) (eq. 2.11), B = B_crit/8 sits on the E = E_min asymptote
   (E/E_min = 1.125) and B = 8 B_crit on the S = S_min one (S/S_min = 1.125): both are seen.
   The grid's smaller batch sizes are run too: they cost little (E = E_min (1 + B/B_crit) is
   near E_min there), and where S(B) bends away from eq. 2.11 at small B (Adam on mnist1d) the
   fitted B_crit depends on them, so the plan fits the same range as the grid.
3. First learning rate at each batch size: eps_opt(B) = eps_max / (1 + B_noise/B) (eq. 2.7) with
   B_noise ~ B_simple, eps_max = lr_pilot (1 + B_noise/B_pilot) (the pilot's rate taken as
   optimal there), snapped to the grid's nearest rate (in log).
4. Bracketing: at each batch size and target, the best rate so far (fewest steps to the target)
   must have a known worse rate on each side (or the grid's edge). Known worse: reached the
   target in as many steps or more, diverged, or ran at least the best's steps without reaching
   it. A neighbour that stopped sooner without reaching it (its budget was set for other
   targets, or the training stopped on its own, noisier reading of the hardest target) is
   unknown, not worse: the next rate out on that side is needed too (one seed's steps-to-target
   at a hard target is not always bowl-shaped in log lr; the wall is looked for, not assumed).
   A missing rate runs next, the higher side first: a higher rate is cheaper to try (it diverges
   within a few steps or reaches the target sooner), and if it wins the lower side is never
   needed. No rate reaching a target: one rate above the highest if it did not diverge (too
   slow: go up); else one below the lowest, unless the lowest ran the sweep's max_steps (too
   slow already; below, the steps only grow).
5. Pruning by budget: a run added to bracket the best rates of some targets gets
   max_steps = ceil(CAP_FACTOR x the most steps those bests took). Past that it cannot win at
   those targets. Nor at the others, where S(lr) is bowl-shaped between the rates tried: those
   are contiguous on the grid (each added one is a neighbour of a tried one), so between this
   rate and another target's best lies a tried rate known worse there. A run that stopped at its
   budget is `unknown`, not worse, at targets it did not reach in the best's steps, so rule 4
   walks past it where that matters. The margin above 1 lets close neighbours finish and show
   the bowl around the optimum.
6. Widening: B_simple is only a prior for B_crit (it can lag the noise scale, or differ from
   B_noise). Once every chosen batch size is bracketed, S = S_min + E_min/B is fitted at each
   target (eq. 2.11, `gnsweep.analysis.fit`); while a fitted B_crit lies less than EDGE times
   inside the smallest or largest batch size, the grid's next batch sizes beyond it are added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gnsweep.analysis.bounds import FIT, REFUSED, bound_text
from gnsweep.analysis.fit import FitRefused, fit_hyperbola
from gnsweep.errors import ConfigError
from gnsweep.lr_law import eps_max_from, eps_opt
from gnsweep.targets import FALLING, Direction

SPREAD = 8.0
"""Batch sizes from B_pred / SPREAD to B_pred x SPREAD (rule 2)."""
MIN_BATCH_SIZES = 5
"""At least this many batch sizes (or the whole grid): a 2-parameter fit needs a few more."""
EDGE = 4.0
"""Rule 6: the fit's B_crit at least this far inside the batch sizes on both sides (on
S = S_min (1 + B_crit/B), S/S_min <= 1.25 at the largest and E/E_min <= 1.25 at the smallest)."""
CAP_FACTOR = 1.5
"""Step budget of a run added where a best exists: this x the best steps there (rule 5)."""


@dataclass(frozen=True)
class RunOutcome:
    """One finished run, as the planner sees it."""

    batch_size: int
    learning_rate: float
    state: str
    """done, diverged or failed."""
    max_steps: int
    """Its step budget."""
    steps: dict[float, float] = field(default_factory=dict)
    """Target -> steps to reach it; a target it did not reach is absent."""
    b_simple: dict[float, float] = field(default_factory=dict)
    """Target -> B_simple averaged (S_min weights) up to reaching it."""
    steps_run: int | None = None
    """Steps it trained (None: its whole budget)."""

    @property
    def ran(self) -> int:
        """Steps it trained."""
        return self.max_steps if self.steps_run is None else self.steps_run


@dataclass(frozen=True)
class Proposal:
    """A run the planner decides to start, and why."""

    batch_size: int
    learning_rate: float
    max_steps: int
    why: str


class PlanError(ConfigError):
    """The grid cannot support a plan (the pilot reaches no target at any learning rate)."""


def middle(values: list[float] | list[int]) -> float:
    """The middle of a sorted grid (the lower middle for an even count)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def snap(value: float, grid: list[float]) -> float:
    """The grid value nearest `value` in log (ties: the smaller)."""
    return min(sorted(grid), key=lambda g: abs(math.log(g / value)))


def neighbours(value: float, grid: list[float]) -> tuple[float | None, float | None]:
    """The grid values just below and just above `value` (None at an edge)."""
    ordered = sorted(grid)
    i = ordered.index(value)
    return (ordered[i - 1] if i > 0 else None,
            ordered[i + 1] if i + 1 < len(ordered) else None)


def next_pilot(pilots: list[RunOutcome], learning_rates: list[float]) -> float | None:
    """The next pilot learning rate, or None once a pilot reached a target. Raises PlanError
    when the rates run out."""
    if any(p.steps for p in pilots):
        return None
    tried = {p.learning_rate for p in pilots}
    last = pilots[-1]
    low, high = neighbours(last.learning_rate, learning_rates)
    step = low if last.state == "diverged" else high
    if step is None or step in tried:
        raise PlanError(
            f"the pilot at batch size {last.batch_size} reached no target at learning rates "
            f"{', '.join(f'{r:g}' for r in sorted(tried))}: choose reachable sweep.targets, a "
            "larger sweep.max_steps or other sweep.learning_rates")
    return step


def pilot_noise(pilots: list[RunOutcome], targets: list[float]) -> dict[float, float]:
    """B_simple per target from the pilot that reached the most targets (fewest steps to the
    easiest on ties); a target it did not reach takes the value at the hardest one it reached
    (the noise scale grows during training: a lower bound). NaN where none was measured.
    `targets` in training order (easiest first), as in every rule here."""
    usable = [p for p in pilots if p.steps]
    best = min(usable, key=lambda p: (-len(p.steps), p.steps.get(targets[0], math.inf)))
    out: dict[float, float] = {}
    last = math.nan
    for target in targets:
        last = best.b_simple.get(target, last)
        out[target] = last
    return out


def choose_batch_sizes(grid: list[int], b_pred: list[float], spread: float = SPREAD,
                       at_least: int = MIN_BATCH_SIZES) -> list[int]:
    """Grid batch sizes up to max b_pred x spread, those below min b_pred / spread included
    (rule 2); at least `at_least` of them (the grid's next larger ones are added)."""
    finite = [b for b in b_pred if math.isfinite(b) and b > 0]
    ordered = sorted(grid)
    if not finite:
        return ordered
    hi = max(finite) * spread
    chosen = [b for b in ordered if b <= hi]
    above = [b for b in ordered if b > hi]
    while len(chosen) < min(at_least, len(ordered)):
        chosen.append(above.pop(0))
    return chosen


def first_learning_rates(batch_sizes: list[int], learning_rates: list[float], eps_max: float,
                         b_noise: float) -> dict[int, float]:
    """The grid rate nearest eps_opt(B) (eq. 2.7) at each batch size (rule 3)."""
    return {b: snap(eps_opt(b, eps_max, b_noise), learning_rates) for b in batch_sizes}


def best_run(runs: list[RunOutcome], target: float) -> RunOutcome | None:
    """The run reaching `target` in the fewest steps; on ties the larger rate (with a bowl-shaped
    S(lr) the optimum lies between tied rates, so the lower one's lower neighbour cannot win)."""
    reached = [r for r in runs if target in r.steps and r.state == "done"]
    return min(reached, key=lambda r: (r.steps[target], -r.learning_rate), default=None)


@dataclass(frozen=True)
class Want:
    """A rate one batch size still needs (rule 4)."""

    up: bool
    """Above a best rate, or going up."""
    why: str
    budget_steps: float = math.nan
    """The most steps the best rates it brackets took (NaN: not bracketing a best; rule 5)."""


def known_worse(run: RunOutcome, target: float, best_steps: float) -> bool:
    """Whether `run` is known to be no better than a best of `best_steps` at `target` (rule 4):
    it reached it no sooner, diverged, or trained that long without reaching it."""
    if run.state == "diverged":
        return True
    if target in run.steps:
        return run.steps[target] >= best_steps
    return run.ran >= best_steps


def bracket(runs: list[RunOutcome], learning_rates: list[float], targets: list[float],
            max_steps: int) -> dict[float, Want]:
    """Rates still to run at one batch size so that every target's best rate is bracketed by
    known worse rates (rule 4): rate -> what it is wanted for. `max_steps`: the sweep's."""
    tried = {r.learning_rate: r for r in runs}
    bests = {t: best for t in targets if (best := best_run(runs, t)) is not None}
    ordered = sorted(learning_rates)
    wanted: dict[float, Want] = {}
    for target in targets:
        best = bests.get(target)
        if best is not None:
            steps = best.steps[target]
            i = ordered.index(best.learning_rate)
            for side, step in (("below", -1), ("above", 1)):
                j, unknown = i + step, []
                # Walk out past neighbours that stopped too soon to tell (rule 4).
                while 0 <= j < len(ordered) and ordered[j] in tried:
                    if known_worse(tried[ordered[j]], target, steps):
                        break
                    unknown.append(ordered[j])
                    j += step
                else:
                    if 0 <= j < len(ordered):
                        other = ordered[j]
                        why = f"{best.learning_rate:g} ({steps:g} steps to {target:g}"
                        if unknown:
                            why += (f"; {', '.join(f'{u:g}' for u in unknown)} stopped before "
                                    "telling")
                        why += ")"
                        if other in wanted:  # wanted at several targets: every reason
                            why = f"{wanted[other].why}, {why}"
                            steps = max(steps, wanted[other].budget_steps)
                        else:
                            why = f"brackets from {side} the best rate {why}"
                        wanted[other] = Want(side == "above", why, steps)
            continue
        # Nothing reached this target: too slow (go up) unless the top already diverged.
        top, bottom = max(tried), min(tried)
        low, high = neighbours(bottom, learning_rates)[0], neighbours(top, learning_rates)[1]
        if tried[top].state != "diverged":
            if high is not None:
                wanted[high] = Want(True, f"no rate up to {top:g} reached {target:g}; going up")
        elif low is not None and (tried[bottom].state == "diverged"
                                  or tried[bottom].ran < max_steps):
            why = (f"every rate down to {bottom:g} diverged" if tried[bottom].state == "diverged"
                   else f"no rate reached {target:g}, {top:g} diverged, {bottom:g} stopped "
                        f"after {tried[bottom].ran} steps")
            wanted[low] = Want(False, f"{why}; going down")
    return wanted


def widen(by_batch: dict[int, list[RunOutcome]], batch_sizes: list[int], grid: list[int],
          targets: list[float], edge: float = EDGE) -> dict[int, str]:
    """Grid batch sizes to add so that every target's fitted B_crit lies `edge` times inside the
    batch sizes (rule 6): batch size -> why. Fits on fewer than 3 batch sizes are skipped."""
    added: dict[int, str] = {}
    for target in targets:
        points = [(b, best.steps[target]) for b in batch_sizes
                  if (best := best_run(by_batch.get(b, []), target)) is not None]
        if len(points) < 3:
            continue
        try:
            fit = fit_hyperbola(np.array([b for b, _ in points], float),
                                np.array([s for _, s in points], float))
        except FitRefused:
            continue
        b_crit = fit.b_crit
        # A refused fit says nothing about where B_crit is; a bound says which way to go (its
        # runaway value is never printed: `analysis.bounds`).
        if not math.isfinite(b_crit) or fit.status == REFUSED:
            continue
        low, high = min(batch_sizes), max(batch_sizes)
        value = f"{b_crit:.4g}" if fit.status == FIT else bound_text(fit.status,
                                                                     fit.b_crit_bound)
        why = f"the fit's B_crit {value} at target {target:g} needs batch sizes from " \
              f"B_crit/{edge:g} to {edge:g} B_crit"
        if high < edge * b_crit:
            for b in sorted(g for g in grid if g > high):
                added.setdefault(b, why)
                if b >= edge * b_crit:
                    break
        if low > b_crit / edge:
            for b in sorted((g for g in grid if g < low), reverse=True):
                added.setdefault(b, why)
                if b <= b_crit / edge:
                    break
    return added


def next_round(outcomes: dict[int, list[RunOutcome]], batch_sizes: list[int],
               first: dict[int, float], learning_rates: list[float], targets: list[float],
               max_steps: int, cap_factor: float = CAP_FACTOR,
               added: dict[int, str] | None = None) -> list[Proposal]:
    """The runs to start next: a first rate where a batch size has none, then the missing
    neighbours of every target's best rate. Empty when every batch size is bracketed."""
    out = []
    for b in sorted(batch_sizes):
        runs = outcomes.get(b, [])
        if not runs:
            lr = first[b]
            why = f"eps_opt({b}) from eq. 2.7 -> {lr:g}"
            if added and b in added:
                why = f"batch size added: {added[b]}; {why}"
            out.append(Proposal(b, lr, max_steps, why))
            continue
        wanted = bracket(runs, learning_rates, targets, max_steps)
        # Rule 4: the higher side first; the lower side once no higher rate is wanted.
        if any(w.up for w in wanted.values()):
            wanted = {lr: w for lr, w in wanted.items() if w.up}
        for lr, want in sorted(wanted.items()):
            cap, note = max_steps, ""
            if math.isfinite(want.budget_steps):  # rule 5
                cap = min(max_steps, max(1, math.ceil(cap_factor * want.budget_steps)))
                note = (f"; budget {cap} steps = {cap_factor:g} x {want.budget_steps:g}, the "
                        "most steps a bracketed best took" if cap < max_steps else "")
            out.append(Proposal(b, lr, cap, want.why + note))
    return out


@dataclass
class Decision:
    """What the planner decides from the runs finished so far (`decide`)."""

    phase: str
    """pilot (a pilot runs next), grid (the planned runs), or done."""
    proposals: list[Proposal]
    pilot: tuple[int, float] | None = None
    """The pilot (batch size, learning rate) whose B_simple the plan uses."""
    b_noise: dict[float, float] = field(default_factory=dict)
    """Target -> the pilot's B_simple, the prediction of B_crit."""
    batch_sizes: list[int] = field(default_factory=list)
    eps_max: float = math.nan
    b_noise_lr: float = math.nan
    """The B_noise of eq. 2.7 for the learning rates (the pilot's, at the hardest target)."""
    first: dict[int, float] = field(default_factory=dict)
    """Batch size -> its first learning rate (eq. 2.7 snapped to the grid)."""


def decide(outcomes: list[RunOutcome], batch_grid: list[int], lr_grid: list[float],
           targets: list[float], max_steps: int, cap_factor: float = CAP_FACTOR,
           direction: Direction = FALLING) -> Decision:
    """The next runs from the finished ones: a function of the outcomes alone, so a resumed plan
    re-derives the same decisions. Rules 1-6 of this module's docstring. `direction`:
    which way the targets are reached (`RISING` for a return, `FALLING` for a loss)."""
    targets = direction.in_training_order(targets)
    by_batch: dict[int, list[RunOutcome]] = {}
    on_grid = [r for r in outcomes if r.batch_size in batch_grid and r.learning_rate in lr_grid]
    for run in sorted(on_grid, key=lambda r: (r.batch_size, r.learning_rate)):
        by_batch.setdefault(run.batch_size, []).append(run)
    # Rule 1: the pilot chain at the middle batch size, from the middle rate.
    b_pilot, lr = int(middle(batch_grid)), float(middle(lr_grid))
    at_pilot = {r.learning_rate: r for r in by_batch.get(b_pilot, [])}
    chain: list[RunOutcome] = []
    while True:
        if lr not in at_pilot:
            why = "pilot: the grid's middle" if not chain else (
                f"pilot: {chain[-1].learning_rate:g} "
                f"{'diverged' if chain[-1].state == 'diverged' else 'reached no target'}")
            return Decision("pilot", [Proposal(b_pilot, lr, max_steps, why)])
        chain.append(at_pilot[lr])
        following = next_pilot(chain, lr_grid)
        if following is None:
            break
        lr = following
    b_noise = pilot_noise(chain, targets)
    pilot = (b_pilot, chain[-1].learning_rate)
    # Rules 2 and 3; batch sizes with runs stay (those rule 6 added, or from an earlier launch).
    batch_sizes = sorted(set(choose_batch_sizes(batch_grid, list(b_noise.values())))
                         | set(by_batch))
    b_noise_lr = b_noise[targets[-1]]  # the hardest target's
    if not b_noise_lr > 0:  # unmeasured (NaN) or a noisy negative estimate: eps_opt = eps_max
        b_noise_lr = 0.0
    eps_max = eps_max_from(pilot[1], b_pilot, b_noise_lr)
    first = first_learning_rates(batch_sizes, lr_grid, eps_max, b_noise_lr)
    # Rules 4 and 5, then 6 once every batch size is bracketed.
    proposals = next_round(by_batch, batch_sizes, first, lr_grid, targets, max_steps, cap_factor)
    if not proposals:
        added = widen(by_batch, batch_sizes, batch_grid, targets)
        if added:
            batch_sizes = sorted(set(batch_sizes) | set(added))
            first = first_learning_rates(batch_sizes, lr_grid, eps_max, b_noise_lr)
            proposals = next_round(by_batch, batch_sizes, first, lr_grid, targets, max_steps,
                                   cap_factor, added)
    return Decision("grid" if proposals else "done", proposals, pilot, b_noise, batch_sizes,
                    eps_max, b_noise_lr, first)
