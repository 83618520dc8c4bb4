"""What every executor shares: the summary of a launch, the watcher that follows runs through
their status files, and the round loop "submit a round, wait, resubmit what died" that torchrun
and Slurm run behind a small backend interface (`Backend`: start a round of jobs; `Round`:
done, finish, stop).

The local pool hands out runs one at a time itself (it knows which worker holds which run) and
uses only the summary and the retry rules of `gnsweep.runs`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gnsweep import store
from gnsweep.errors import LauncherSignal
from gnsweep.executors import claims
from gnsweep.paths import run_dir
from gnsweep.progress import SweepProgress
from gnsweep.runs import FINISHED, RunState, max_attempts, needs_running, read_state


@dataclass
class Summary:
    """How the runs handed to an executor ended."""

    done: list[str] = field(default_factory=list)
    diverged: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)
    """Runs finished by another executor while this one waited for them."""
    submitted: list[str] = field(default_factory=list)
    """Slurm job ids submitted by this launch."""

    def add(self, run_id: str, state: str) -> None:
        getattr(self, state if state in FINISHED else RunState.FAILED).append(run_id)

    def describe(self) -> str:
        """What this launch ran, and what another launch sharing the folder finished meanwhile
        ("4 done, 0 diverged, 0 failed this launch; 5 more finished by another launch")."""
        other = set(self.elsewhere)
        here = [sum(1 for r in runs if r not in other)
                for runs in (self.done, self.diverged, self.failed)]
        text = f"{here[0]} done, {here[1]} diverged, {here[2]} failed this launch"
        if other:
            text += f"; {len(other)} more finished by another launch"
        return text


class Watcher:
    """Follows the runs of one launch through their status files: progress and the summary."""

    def __init__(self, sweep_dir: Path, run_ids: list[str], max_retries: int,
                 progress: SweepProgress | None) -> None:
        self.sweep_dir, self.run_ids, self.max_retries = sweep_dir, run_ids, max_retries
        self.progress = progress
        self.final: dict[str, str] = {}

    def _status(self, run_id: str) -> store.RunStatus:
        return read_state(run_dir(self.sweep_dir, run_id))

    def update(self) -> None:
        for run_id in self.run_ids:
            if run_id in self.final:
                continue
            status = self._status(run_id)
            if not needs_running(status, self.max_retries):
                self.final[run_id] = status.state.value
                if self.progress is not None:
                    self.progress.advance(status.state.value)

    def _open(self) -> list[str]:
        self.update()
        return [r for r in self.run_ids if r not in self.final]

    def held(self) -> list[str]:
        """Open runs a live owner (here or elsewhere) holds."""
        out = []
        for run_id in self._open():
            claim = claims.read_claim(run_dir(self.sweep_dir, run_id))
            if claim is not None and not claims.is_stale(claim):
                out.append(run_id)
        return out

    def runnable(self) -> list[str]:
        """Open runs nobody holds."""
        held = set(self.held())
        return [r for r in self._open() if r not in held]

    def summary(self) -> Summary:
        from gnsweep.executors import LAUNCH_ENV, ended_by

        self.update()
        summary = Summary()
        launch = os.environ.get(LAUNCH_ENV)
        for run_id in self.run_ids:
            state = self.final.get(run_id, RunState.FAILED)
            summary.add(run_id, state)
            # Finished by the workers of another launch sharing the folder.
            if launch and state in FINISHED and ended_by(
                    run_dir(self.sweep_dir, run_id)) not in (launch, None):
                summary.elsewhere.append(run_id)
        return summary


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP stop the launcher as Ctrl-C does (its workers
    stopped, their runs back to pending, claims released), raising LauncherSignal: a launcher
    killed by a batch system or a closed terminal never leaves workers behind that keep their
    claims. Only in the main thread (where Python runs signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_signal(signum: int, frame: Any) -> None:
        raise LauncherSignal(signum)

    previous = {signum: signal.signal(signum, raise_signal)
                for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class Round(Protocol):
    """The jobs one round started."""

    def done(self) -> bool:
        """Whether every job of the round has exited."""

    def finish(self) -> None:
        """After the round: report jobs that failed (one line each), clean up."""

    def stop(self) -> None:
        """Ctrl-C: stop or cancel the round's jobs (their runs go back to pending)."""


class Backend(Protocol):
    poll_s: float
    """How often the loop looks at the status files while a round runs."""

    def start(self, run_ids: list[str]) -> Round:
        """Start jobs that take `run_ids` in turn (claims decide who trains what)."""


def run_rounds(backend: Backend, watcher: Watcher, max_retries: int) -> list[Round]:
    """Submit a round for the runs nobody holds, wait for it, and resubmit what died, until
    every run has finished or is out of retries; returns the rounds started.

    Runs another launcher holds are waited for (and run here should their owner die). A run
    whose jobs keep dying is given up after `max_attempts` rounds; its status says why.
    """
    rounds: list[Round] = []
    current: Round | None = None
    try:
        while True:
            todo, held = watcher.runnable(), watcher.held()
            if not todo and not held:
                break
            if todo and len(rounds) < max_attempts(max_retries):
                current = backend.start(todo)
                rounds.append(current)
            elif not held:
                break  # runs left, but their jobs keep dying: give up
            else:
                current = None
            # Wait for our jobs, and for runs other launches hold, until one frees up.
            while True:
                watcher.update()
                if (current is None or current.done()) and (not watcher.held()
                                                            or watcher.runnable()):
                    break
                time.sleep(backend.poll_s)
            if current is not None:
                current.finish()
    except KeyboardInterrupt:
        if current is not None:
            current.stop()
        raise
    return rounds
