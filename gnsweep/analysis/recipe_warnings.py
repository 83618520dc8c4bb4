"""What a run's learning-rate schedule does to the fits: warnings, per target, where the answer
measures the schedule rather than the batch size.

- A target reached inside the warmup measures the warmup: S_min (or E_min, for a warmup
  counted in examples) below the warmup's length, or best runs that reached the target before
  their warmup ended. A warmup in steps is longer in examples at larger batches, which bends
  the front: a 30-step warmup halved a GPT-2's B_crit when S_min was 27 steps.
- A target reached after the decay's horizon was reached at the floor rate (min_lr_ratio x
  the run's rate), not at the rate the grid swept.

And what the runs trained with (`recipe_of`): gnsweep's own `train.*` for its loop, the
script's own words (`task.optimizer`, `task.grad_clip`, `task.schedule`) for task=script, whose
training gnsweep's settings do not describe. The learning-rate law of eq. 2.7 assumes plain
SGD without clipping (`lr_law`): with clipping, an adaptive optimizer or a recipe not said, it
is marked as not applying.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from gnsweep.config import SCRIPT, Config

SGD_LIKE = ("sgd", "momentum")
"""Optimizers whose step is the learning rate times the gradient (momentum only averages it):
eq. 2.7's setting."""
LAW = ("the learning-rate law eq. 2.7, eps_opt(B) = eps_max/(1 + B_noise/B), assumes plain "
       "SGD without clipping")


@dataclass(frozen=True)
class Recipe:
    """What the runs trained with, as far as it is known (None: not said)."""

    optimizer: str | None
    grad_clip: float | None
    schedule: str | None
    script: bool
    """Said by the user of a script (`task.*`), not gnsweep's own loop's `train.*`."""

    def words(self) -> str:
        """The recipe in words, each unknown part named with the setting that says it."""
        unknown = [name for name, value in (("task.optimizer", self.optimizer),
                                            ("task.grad_clip", self.grad_clip),
                                            ("task.schedule", self.schedule)) if value is None]
        parts = [self.optimizer or "optimizer not said"]
        if self.grad_clip is not None:
            parts.append(f"clip {self.grad_clip:g}" if self.grad_clip else "no clipping")
        if self.schedule:
            parts.append(f"schedule: {self.schedule}")
        said = ", ".join(parts)
        if unknown:
            said += f" (the script's; not said: {', '.join(unknown)})"
        return said


def recipe_of(config: Config) -> Recipe:
    """The runs' recipe: the script's own words for task=script, else gnsweep's `train.*`."""
    if config.task.name == SCRIPT:
        options = config.task.options
        clip = options.get("grad_clip")
        return Recipe(str(options.get("optimizer") or "") or None,
                      None if clip is None else float(clip),
                      str(options.get("schedule") or "") or None, True)
    train = config.train
    schedule = "constant" if not train.lr_scheduled else train.decay
    return Recipe(train.optimizer, float(train.grad_clip), schedule, False)


def lr_law(config: Config) -> tuple[bool, str]:
    """Whether eq. 2.7 applies to the runs' recipe, and the sentence that says so (its
    assumption always stated)."""
    recipe = recipe_of(config)
    if recipe.optimizer is None or recipe.grad_clip is None:
        missing = " and ".join(name for name, value in (("task.optimizer", recipe.optimizer),
                                                        ("task.grad_clip", recipe.grad_clip))
                               if value is None)
        why = f"the script's recipe is not said: give {missing}"
    elif recipe.optimizer not in SGD_LIKE:
        why = (f"{recipe.optimizer} scales each parameter's step (its best rates follow a "
               "saturating power law or a surge, fitted beside)")
    elif recipe.grad_clip > 0:
        why = f"gradients clipped at {recipe.grad_clip:g} bound the step"
    else:
        return True, f"{LAW}; the runs' recipe ({recipe.optimizer}, no clipping) is that"
    return False, (f"{LAW}; it does not apply here ({why}): the best learning rates measured "
                   "stand, but the eps_max and B_noise fitted to them by eq. 2.7 are no "
                   "measure of the noise scale")


def recipe_warnings(config: Config, fits: pd.DataFrame, front: pd.DataFrame) -> list[str]:
    """One warning per target and problem (`fits`: s_min, e_min per target; `front`: the best
    run per target and batch size, with its steps and examples to the target)."""
    train = config.train
    applies, law = lr_law(config)
    out: list[str] = [] if applies else [law[0].upper() + law[1:]]
    if config.task.name == SCRIPT:  # gnsweep's train.* describe nothing a script does
        return out
    for target in dict.fromkeys([*fits["target"], *front["target"]]):  # the fits' order
        fit = fits[fits["target"] == target]
        best = front[front["target"] == target]
        out += _warmup(target, train.warmup_steps, train.warmup_examples, fit, best)
        # With no horizon given, the horizon is the run's budget, which no run passes.
        if train.decay != "constant" and train.decay_examples:
            late = best[best["examples"] > train.decay_examples]
            if len(late):
                out.append(f"target {target:g}: reached after the decay's horizon "
                           f"(train.decay_examples={train.decay_examples}) at batch sizes "
                           f"{_sizes(late)}: at the floor rate (train.min_lr_ratio="
                           f"{train.min_lr_ratio:g} x the grid's), not the rate swept; "
                           "lengthen the decay")
    return out


def _warmup(target: float, steps: int, examples: int, fit: pd.DataFrame,
            best: pd.DataFrame) -> list[str]:
    if not (steps or examples):
        return []
    length = f"{steps} steps" if steps else f"{examples} examples"
    s_min = float(fit["s_min"].iloc[0]) if len(fit) else math.nan
    e_min = float(fit["e_min"].iloc[0]) if len(fit) else math.nan
    if steps and s_min < steps:
        return [f"target {target:g}: S_min {s_min:.3g} steps falls inside the warmup ({length}):"
                " the fit measures the warmup; count the warmup in examples "
                "(train.warmup_examples) or shorten it"]
    if examples and e_min < examples:
        return [f"target {target:g}: E_min {e_min:.3g} examples falls inside the warmup "
                f"({length}): the fit measures the warmup; shorten it"]
    inside = best[best["steps"] <= steps] if steps else best[best["examples"] <= examples]
    if len(inside):
        return [f"target {target:g}: reached inside the warmup ({length}) at batch sizes "
                f"{_sizes(inside)}: those points measure the warmup"]
    return []


def _sizes(rows: pd.DataFrame) -> str:
    return ", ".join(f"{b:g}" for b in sorted(rows["batch_size"].astype(float)))
