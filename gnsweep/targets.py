"""A target's direction: the one place that knows which way a sweep's targets are reached.

A loss target is reached by falling to it, a rising metric's (cartpole's return) by rising to
it. The hardest target is the one reached last in training: the smallest loss, the largest
return. `Direction` carries that fact; every other module asks it (`reached`, `better`, `best`,
`hardest`, `as_loss`) instead of flipping a sign itself. The flag a task declares and the column
an analysis records are both named `KEY`; `Direction.of` maps the flag to the type, once.
Pure; no torch, no pandas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

AUTO = "auto"
"""Targets chosen from the runs by the analysis (`sweep.targets=auto`, `--targets auto`)."""
LOSS_EMA_SAMPLES = 128.0
"""The default time constant of a run's smoothed loss, whose crossing of a target is read, in
samples (the batch's first dimension): `sweep.loss_ema_examples` and `analyze --table`'s curves
default to it; a task counting `p` examples a sample (tokens a sequence) gets `p` times as many
examples, so that it means the same training whatever the unit."""

KEY = "higher_is_better"
"""The name of the direction flag wherever it is written: a task's registry entry and task
object, an analysis' meta, the comparison table's column (docs/compare.md)."""


@dataclass(frozen=True)
class Direction:
    """Which way a sweep's targets are reached: `rises` True for a metric that rises to them
    (a return), False for a loss that falls to them."""

    rises: bool = False

    @classmethod
    def of(cls, value: Direction | bool | None) -> Direction:
        """The direction for a declared flag (True: rises), or `value` itself if it is one."""
        if isinstance(value, Direction):
            return value
        return RISING if bool(value) else FALLING

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Direction:
        """An analysis' direction from its meta (recorded by `gnsweep analyze` under `KEY`)."""
        return cls.of(meta.get(KEY, False))

    def to_meta(self) -> dict[str, bool]:
        """The meta entry that `from_meta` reads back."""
        return {KEY: self.rises}

    @property
    def sign(self) -> float:
        """+1 for a loss, -1 for a rising metric: `sign * value` is always lower-is-better."""
        return -1.0 if self.rises else 1.0

    def as_loss(self, values: Any) -> Any:
        """Values turned lower-is-better (a rising metric negated); a loss unchanged."""
        return -values if self.rises else values

    def reached(self, value: float, target: float) -> bool:
        """Whether a (smoothed) value has reached `target` in this direction."""
        return value >= target if self.rises else value <= target

    def better(self, a: float, b: float) -> bool:
        """Whether value `a` is strictly better than `b` (lower loss, higher return)."""
        return a > b if self.rises else a < b

    def best(self, values: Iterable[float]) -> float:
        """The best of `values`, NaN ignored (NaN if none is a number)."""
        array = np.asarray(list(values), dtype=float)
        array = array[~np.isnan(array)]
        if not len(array):
            return float("nan")
        return float(array.max() if self.rises else array.min())

    def best_label(self, metric: str = "loss") -> str:
        """How to name the best value in a sentence: "lowest loss", "highest value"."""
        return "highest value" if self.rises else f"lowest {metric}"

    @property
    def ascending(self) -> bool:
        """Whether training reaches the targets in ascending order of value (a rising metric)."""
        return self.rises

    def in_training_order(self, targets: Iterable[Any], key: Callable[[Any], float] | None = None
                          ) -> list[Any]:
        """The targets in the order training reaches them: easiest first, hardest last (`key`:
        a target's value, for rows that carry one)."""
        return sorted(targets, key=key, reverse=not self.rises)

    def hardest(self, targets: Iterable[float]) -> float:
        """The target reached last: the smallest loss, the largest rising metric."""
        order = self.in_training_order(targets)
        if not order:
            raise ValueError("no targets")
        return order[-1]

    def relative_target(self, value: float, fraction: float) -> float:
        """The target a fraction stands for at a point of value L (a branch sweep's targets,
        docs/along.md): f L for a loss; for a metric that rises, the mirror L + (1 - f)|L|
        (the same relative step, upwards, whatever L's sign)."""
        if not 0 < fraction < 1:
            raise ValueError(f"a relative target is a fraction in (0, 1), got {fraction}")
        if self.rises:
            return value + (1.0 - fraction) * abs(value)
        return fraction * value


FALLING = Direction(False)
"""A loss: targets are reached by falling to them."""
RISING = Direction(True)
"""A metric such as a return: targets are reached by rising to them."""


# Function forms, for callers holding a flag or a Direction.
def rising(meta: Mapping[str, Any]) -> bool:
    """Whether an analysis' targets are reached by rising to them (its meta's `KEY`)."""
    return Direction.from_meta(meta).rises


def reached(value: float, target: float, direction: Direction | bool = FALLING) -> bool:
    """Whether a (smoothed) value has reached `target` in its direction."""
    return Direction.of(direction).reached(value, target)


def in_training_order(targets: Iterable[float], direction: Direction | bool = FALLING
                      ) -> list[float]:
    """The targets in the order training reaches them: easiest first, hardest last."""
    return Direction.of(direction).in_training_order(targets)


def hardest(targets: Iterable[float], direction: Direction | bool = FALLING) -> float:
    """The target reached last: the smallest loss, the largest rising metric."""
    return Direction.of(direction).hardest(targets)


def relative_target(value: float, fraction: float, direction: Direction | bool = FALLING
                    ) -> float:
    """`Direction.relative_target` for a flag or a direction."""
    return Direction.of(direction).relative_target(value, fraction)
