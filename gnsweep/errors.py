"""The errors a user can cause and the checks of single values; a leaf (imports nothing of ours).

ConfigError is a mistake in the configuration or on the command line; StoreError names a file
of a sweep folder that is missing or unreadable. The CLI prints either as one line, exit code 2.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", int, float)


class ConfigError(ValueError):
    """A user mistake in the configuration; the CLI prints it as one line, exit code 2."""


class StoreError(RuntimeError):
    """A file of the sweep is missing or unreadable; the message names it."""


def shown(value: Any) -> str:
    """A value as an error message shows it: `nan`, `2.5`, `'abc'` (numpy scalars unwrapped,
    never `np.float64(nan)`)."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        with contextlib.suppress(TypeError, ValueError):
            value = value.item()
    return repr(value) if isinstance(value, (str, bytes)) else str(value)


def number(where: str, value: Any) -> float:
    """`value` as a finite float; `where` names the setting in the error."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {shown(value)} is not a number") from None
    if not math.isfinite(out):
        raise ConfigError(f"{where}: {shown(value)} must be finite")
    return out


def integer(where: str, value: Any) -> int:
    """`value` as an int (2.0 is 2; 2.5 and True are refused)."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {shown(value)} is not an integer")
    as_number = number(where, value)
    if as_number != int(as_number):
        raise ConfigError(f"{where}: {shown(value)} is not an integer")
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


_OS_HINTS = {
    errno.EACCES: "choose a folder you may write to, or fix its permissions",
    errno.EPERM: "choose a folder you may write to, or fix its permissions",
    errno.EROFS: "choose a folder on a writable file system",
    errno.ENOSPC: "free some space there, or choose a folder on another disk",
    errno.EDQUOT: "free some space there, or choose a folder on another disk",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
    errno.EEXIST: "a file is in the way; choose another path",
}


def os_error_message(err: OSError) -> str:
    """An operating-system error as one line for the user: the path, the reason, the fix
    (`/data/runs: Permission denied; choose a folder you may write to, ...`)."""
    first = str(err).strip().splitlines()
    # The system's words for the errno: libraries (pyarrow) wrap them in their own.
    reason = os.strerror(err.errno) if err.errno else (
        err.strerror or (first[0] if first else type(err).__name__))
    path = err.filename if err.filename is not None else err.filename2
    hint = _OS_HINTS.get(err.errno or -1)
    where = f"{os.fsdecode(path)}: " if path is not None else ""
    return f"{where}{reason}" + (f"; {hint}" if hint else "")


class ScriptFailed(RuntimeError):
    """A `task=script` run failed: its command exited non-zero, logged no row, or logged one
    that cannot be read (the message names the file and line). `stderr`: the command's last
    lines of stderr, kept in the run's status.json. `repeats`: every attempt would fail alike
    (a parse rule broken, the program not found, a bad-input exit), so none is retried."""

    def __init__(self, message: str, stderr: list[str] | None = None,
                 repeats: bool = False) -> None:
        super().__init__(message)
        self.stderr = list(stderr or [])
        self.repeats = repeats


class StopRequested(Exception):
    """The launcher asked the run in flight to stop (Ctrl-C, SIGTERM, the launcher gone): the
    run goes back to pending. Its own exception, so that `except KeyboardInterrupt` in user
    code or a library never swallows it and a real Ctrl-C stays distinguishable."""


class LauncherSignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the launcher: it stops its workers as on Ctrl-C (their runs go
    back to pending, their claims are released) and exits with 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
