"""The stall watchdog: a run that logs no step for `sweep.stall_seconds` is stopped.

A task whose loss blocks (a dead data server, a deadlock in C code) cannot be interrupted from
Python: no exception reaches a thread stuck in a system call or a lock. So the watchdog, a
daemon thread of the worker, records the run's end itself (failed, reason "stalled", claim
released) and then ends the worker process (`os._exit`): its executor sees a worker that
died, starts another, and the run is retried like any failure.

The thread also tells the claim's heartbeat whether the run still makes progress (`alive`): a
claim whose run has stalled is no longer kept fresh, so that other hosts see it as stale.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

STALLED = "stalled"
"""The reason a stalled run's status records."""
STALLED_EXIT = 75
"""Exit code of a worker ended by the watchdog (EX_TEMPFAIL: try again)."""


class Watchdog:
    """Watches one run: `beat()` at every logged step; `on_stall(idle_s)` is called once, from
    the watchdog's thread, after `stall_s` seconds without a beat, then the process exits with
    STALLED_EXIT. `stall_s` <= 0: no watchdog (only `alive`)."""

    def __init__(self, stall_s: float, on_stall: Callable[[float], None],
                 exit_process: bool = True) -> None:
        self.stall_s = stall_s
        self.on_stall = on_stall
        self.exit_process = exit_process
        self.last = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if stall_s > 0:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="gnsweep-watchdog")
            self._thread.start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def idle_s(self) -> float:
        return time.monotonic() - self.last

    def alive(self) -> bool:
        """Whether the run made progress within the stall bound (always, without a bound)."""
        return self.stall_s <= 0 or self.idle_s() < self.stall_s

    def stop(self) -> None:
        """The run ended on its own: never fire after this returns."""
        with self._lock:
            self._done.set()

    def _watch(self) -> None:
        poll = min(1.0, max(0.05, self.stall_s / 10))
        while not self._done.wait(poll):
            idle = self.idle_s()
            if idle < self.stall_s:
                continue
            with self._lock:
                if self._done.is_set():
                    return
                self._done.set()
                try:
                    self.on_stall(idle)
                finally:
                    if self.exit_process:
                        os._exit(STALLED_EXIT)
            return
