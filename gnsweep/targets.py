"""A target's direction: the one place that knows which way a sweep's targets are reached.

A loss target is reached by falling to it, a rising metric's (cartpole's return) by rising to
it. The hardest target is the one reached last in training: the smallest loss, the largest
return. Pure; no torch, no pandas.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def rising(meta: Mapping[str, Any]) -> bool:
    """Whether an analysis' targets are reached by rising to them (its meta's
    `higher_is_better`, recorded by `gnsweep analyze`)."""
    return bool(meta.get("higher_is_better", False))


def reached(value: float, target: float, higher_is_better: bool) -> bool:
    """Whether a (smoothed) value has reached `target` in its direction."""
    return value >= target if higher_is_better else value <= target


def in_training_order(targets: Iterable[float], higher_is_better: bool) -> list[float]:
    """The targets in the order training reaches them: easiest first, hardest last."""
    return sorted(targets, reverse=not higher_is_better)


def hardest(targets: Iterable[float], higher_is_better: bool) -> float:
    """The target reached last: the smallest loss, the largest rising metric."""
    order = in_training_order(targets, higher_is_better)
    if not order:
        raise ValueError("no targets")
    return order[-1]


def relative_target(value: float, fraction: float, higher_is_better: bool = False) -> float:
    """The target a fraction stands for at a point of value L (a branch sweep's targets,
    docs/along.md): f L for a loss; for a metric that rises, the mirror L + (1 - f)|L| (the
    same relative step, upwards, whatever L's sign)."""
    if not 0 < fraction < 1:
        raise ValueError(f"a relative target is a fraction in (0, 1), got {fraction}")
    if higher_is_better:
        return value + (1.0 - fraction) * abs(value)
    return fraction * value
