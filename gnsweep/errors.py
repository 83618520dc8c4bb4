"""The errors a user can cause and the checks of single values; a leaf (imports nothing of ours).

ConfigError is a mistake in the configuration or on the command line; StoreError names a file
of a sweep folder that is missing or unreadable. The CLI prints either as one line, exit code 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", int, float)


class ConfigError(ValueError):
    """A user mistake in the configuration; the CLI prints it as one line, exit code 2."""


class StoreError(RuntimeError):
    """A file of the sweep is missing or unreadable; the message names it."""


def number(where: str, value: Any) -> float:
    """`value` as a finite float; `where` names the setting in the error."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not a number") from None
    if not math.isfinite(out):
        raise ConfigError(f"{where}: {value!r} must be finite")
    return out


def integer(where: str, value: Any) -> int:
    """`value` as an int (2.0 is 2; 2.5 and True are refused)."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {value!r} is not an integer")
    as_number = number(where, value)
    if as_number != int(as_number):
        raise ConfigError(f"{where}: {value!r} is not an integer")
    return int(as_number)


def at_least(where: str, value: T, minimum: T) -> T:
    if value < minimum:
        raise ConfigError(f"{where}: {value} is not allowed; must be >= {minimum}")
    return value


def positive_list(where: str, values: Any, convert: Callable[[str, Any], T]) -> list[T]:
    """A non-empty list of distinct positive values (a single value is a list of one)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        values = [values]
    out = [convert(where, v) for v in values]
    if not out:
        raise ConfigError(f"{where}: the list is empty; give at least one value, "
                          f"e.g. {where}=[...]")
    for v in out:
        if v <= 0:
            raise ConfigError(f"{where}: {v} is not allowed; values must be > 0")
    if len(set(out)) != len(out):
        raise ConfigError(f"{where}: {out} has repeated values")
    return out


def choice(where: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(allowed)}")
    return str(value)


class StopRequested(Exception):
    """The launcher asked the run in flight to stop (Ctrl-C, SIGTERM, the launcher gone): the
    run goes back to pending. Its own exception, so that `except KeyboardInterrupt` in user
    code or a library never swallows it and a real Ctrl-C stays distinguishable."""
