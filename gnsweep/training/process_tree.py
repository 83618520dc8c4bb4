"""A script's whole process tree ends with its run.

The command is started under a small guard process (`GUARD`, plain Python, no imports of
gnsweep), in a session of its own, so that the guard, the command and every child the command
starts share one process group:

- the guard gets SIGTERM when the worker that started it dies, SIGKILL included
  (`PR_SET_PDEATHSIG`), and then ends the whole group: SIGTERM, and SIGKILL `grace` seconds
  later (a command that ignores SIGTERM included);
- the worker ends the group once the command itself has exited (a helper the command left
  behind, holding its stdout, never keeps the run open);
- the group's leader is recorded in the run folder (`record`: pid and start time), and the next
  attempt of the run ends a group that is still there before it starts its own (`end_earlier`):
  never two copies of one run writing beside each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1

GUARD = r"""
import os, signal, sys, time
parent, grace, args = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]

class Orphaned(Exception):
    pass

def on_term(signum, frame):
    # The worker's own stop reaches the whole group: the command handles it. Only a dead
    # worker (the parent changed) makes the guard end the group.
    if os.getppid() != parent:
        raise Orphaned

signal.signal(signal.SIGTERM, on_term)
try:
    if os.getppid() != parent:
        raise Orphaned
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            os.execvp(args[0], args)
        except OSError as err:
            os.write(2, f"cannot start {args[0]}: {err.strerror or err}\n".encode())
        os._exit(127)
    null = os.open(os.devnull, os.O_RDWR)  # the command's output is its own: no copy kept
    os.dup2(null, 1)
    os.dup2(null, 2)
    _, status = os.waitpid(pid, 0)
except Orphaned:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.05)
        except ChildProcessError:
            break
    os.killpg(0, signal.SIGKILL)
code = os.waitstatus_to_exitcode(status)
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code & 255)
"""


def guarded(args: list[str], grace: float) -> list[str]:
    """`args` started under the guard, which ends their process group `grace` seconds after
    SIGTERM once this process has died."""
    return [sys.executable, "-I", "-S", "-c", GUARD, str(os.getpid()), repr(float(grace)),
            *args]


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """In the child: SIGTERM when the thread that started it dies (kill -9 included)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot, /proc/<pid>/stat field 22), None when
    it is gone or unknown: with the pid it names one process, whatever pids were reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def record(path: Path, pid: int) -> None:
    """Write down the group leader `pid` (and its start time) of a run's command."""
    data = {"pid": pid, "start": start_time(pid)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def _members(pgid: int, since: int) -> list[int]:
    """The live processes of group `pgid` started at or after `since` (the leader's start)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        with contextlib.suppress(IndexError, ValueError):
            if fields[0] != "Z" and int(fields[2]) == pgid and int(fields[19]) >= since:
                out.append(int(entry.name))
    return out


def end_earlier(path: Path, grace: float) -> bool:
    """End the process group a run's earlier attempt recorded at `path`, if any of it still
    runs: SIGTERM, SIGKILL after `grace` seconds. True when something was ended. Only a group
    whose leader is the recorded process, or whose members started after it, is touched."""
    try:
        data = json.loads(path.read_text())
        pgid, since = int(data["pid"]), data["start"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if since is None or not sys.platform.startswith("linux"):
        return False
    leader = start_time(pgid)
    if leader is not None and leader != since:
        return False  # the pid is another process now, and so is its group
    members = _members(pgid, int(since))
    if not members:
        path.unlink(missing_ok=True)
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _members(pgid, int(since)):
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    while _members(pgid, int(since)) and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    path.unlink(missing_ok=True)
    return True
