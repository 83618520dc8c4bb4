"""A bound on how long a task's code may run without a word where no worker watches it: the
launcher's own calls into a task (its pre-launch check, a branch point's loss, building the
task once before workers fork). A task blocked in a system call or a lock cannot be
interrupted from Python, so the call runs in a daemon thread and the launcher stops waiting
for it after `sweep.stall_seconds`: one line, exit 2, instead of a launcher that hangs and
prints nothing. Inside a worker the stall watchdog (`gnsweep.executors.watchdog`) does the
same job for a run.

A leaf: imports only gnsweep.errors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from gnsweep.errors import ConfigError

T = TypeVar("T")


class Stalled(ConfigError):
    """A task's code made no progress for `sweep.stall_seconds` (exit 2)."""


def bounded(seconds: float, what: str, function: Callable[[], T]) -> T:
    """`function()`, or Stalled when it has not returned after `seconds` (0: no bound, called
    here). Its exceptions propagate as they are."""
    if not seconds > 0:
        return function()
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = function()
        except BaseException as err:  # handed to the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=call, daemon=True, name="gnsweep-bounded")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise Stalled(f"{what}: no answer after {seconds:g} s (sweep.stall_seconds={seconds:g}); "
                      "the task blocks (a data server that does not answer, a deadlock): fix "
                      "it, or raise sweep.stall_seconds if it needs longer")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
