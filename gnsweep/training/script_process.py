"""A `task=script` run's process: started under its guard (`training.process_tree`), its output
read line by line on threads, and asked to stop (the flag, then SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from gnsweep import store
from gnsweep.errors import ScriptFailed
from gnsweep.paths import RunPaths
from gnsweep.training import process_tree
from gnsweep.training.log_reader import read_lines

POLL_S = 0.05
Line = tuple[str, int, str, bool]
"""A printed line: stdout or stderr, its number, its text, whether it was cut (too long)."""
QUEUED_LINES = 4096
"""Lines read but not yet handled, at most: a command that prints faster than its lines are
handled waits on its pipe, instead of the worker's memory growing with its output."""


def _pump(stream: IO[bytes], name: str, lines: queue.Queue[Line | None]) -> None:
    for number, (line, cut) in enumerate(read_lines(stream), 1):
        lines.put((name, number, line, cut))
    lines.put(None)


class Child:
    """The command's process tree: the command under its guard (`process_tree.GUARD`), in a
    process group of its own, its output pumped into `lines`."""

    def __init__(self, args: list[str], cwd: str, env: dict[str, str], grace: float) -> None:
        self.lines: queue.Queue[Line | None] = queue.Queue(QUEUED_LINES)
        if shutil.which(args[0], path=env.get("PATH")) is None and not Path(cwd, args[0]).is_file():
            raise ScriptFailed(f"cannot start {args[0]}: command not found", repeats=True)
        self.grace = grace
        try:
            self.process = subprocess.Popen(
                process_tree.guarded(args, grace), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=process_tree.die_with_parent if sys.platform.startswith("linux")
                else None)
        except OSError as err:  # not found, not executable: every attempt alike
            raise ScriptFailed(f"cannot start {args[0]}: {err.strerror or err}",
                               repeats=True) from None
        self.open = 2
        for stream, name in ((self.process.stdout, "stdout"), (self.process.stderr, "stderr")):
            threading.Thread(target=_pump, args=(stream, name, self.lines), daemon=True).start()
        self.asked: float | None = None
        self.termed: float | None = None
        self.left: float | None = None  # when the command exited, leaving its group behind

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def exited(self) -> bool:
        """Whether the command (its guard) has exited. Not reaped yet: until then its pid,
        and so its group's id, cannot be another process's."""
        if self.process.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.process.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def ended(self) -> bool:
        """Whether the run's command is over: it exited and its output is read. What it left
        in its group (a helper holding its stdout) is ended then, SIGKILL `grace` s after
        SIGTERM: the command's own exit ends the run."""
        if not self.exited():
            return False
        now = time.monotonic()
        if self.left is None:
            self.left = now
            self.signal(signal.SIGTERM)
        if now - self.left >= self.grace or self.open == 0:
            self.signal(signal.SIGKILL)  # before the guard is reaped: its group id is still ours
        if self.open > 0:
            return False
        self.process.wait()
        return True


def _ask_to_stop(child: Child, run_path: Path) -> None:
    """The flag `current_run().should_stop()` reads; a command that never made the handle
    (`current_run()` creates the rows file) gets SIGTERM at once."""
    store.write_text(RunPaths(run_path).script_stop, "stop\n")
    child.asked = time.monotonic()
    if not RunPaths(run_path).script_rows.exists():
        child.termed = child.asked
        child.signal(signal.SIGTERM)


def _escalate(child: Child, grace: float, run_path: Path) -> None:
    """SIGTERM `grace` seconds after the flag, SIGKILL `grace` seconds after SIGTERM."""
    if child.asked is None or child.exited():
        return
    now = time.monotonic()
    if child.termed is None and now - child.asked >= grace:
        child.termed = now
        child.signal(signal.SIGTERM)
    elif child.termed is not None and now - child.termed >= grace:
        child.signal(signal.SIGKILL)


def _kill(child: Child) -> None:
    child.signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not child.exited() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    child.signal(signal.SIGKILL)  # the command's children too, before its pid is released
    child.process.wait()
