"""Claims: a run is claimed before it starts, so that no two executors ever run it at once.

A claim is the file `runs/<id>/claim.json`. It is written under a temporary name and hard-linked
to its final name: `link` fails when the name exists, so exactly one claimer wins, and the file
is complete the moment it appears. It names its owner: host, pid, the pid's start time (a
recycled pid is not the same process), the Slurm job id, and a random token.

A claim is stale when its owner cannot be running it any more:
- on this host, the owner pid is gone, a zombie, or a different process with the same number;
- on any host, the owner has not touched the file for `stale_after` seconds: owners touch
  their claims every `HEARTBEAT_S` (`Heartbeat`) while their run makes progress (a run that
  logs no step for `sweep.stall_seconds` is no longer touched, and its watchdog ends it).
A stale claim is broken under an exclusive lock on `<sweep>/.claims.lock` after reading it again,
so that two processes that both saw it stale do not both break it (and one of them a fresh one).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.paths import RunPaths, SweepPaths

HEARTBEAT_S = 15.0
"""How often an owner touches its claims."""
STALE_AFTER_S = float(os.environ.get("GNSWEEP_STALE_AFTER", "120"))
"""A claim from another host untouched this long is stale (a lost node, a killed job)."""


def slurm_job_id() -> str | None:
    """This process's Slurm job id (`<array job>_<task>` inside an array), or None."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def _pid_start(pid: int) -> str | None:
    """The pid's start time in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    rest = stat[stat.rindex(")") + 2:].split()
    return None if rest[0] == "Z" else rest[19]


def owner() -> dict[str, Any]:
    """Who this process is, as written into its claims."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _pid_start(pid),
            "slurm_job_id": slurm_job_id(), "claimed": time.time(), "token": uuid.uuid4().hex}


def read_claim(run_path: Path) -> dict[str, Any] | None:
    """The claim on a run (with its file's age as `age_s`), or None when unclaimed."""
    path = RunPaths(run_path).claim
    try:
        data = store.parse_json(store.read_text(path), path)
        if not isinstance(data, dict):
            raise store.StoreError(f"{path}: not a JSON object")
        data["age_s"] = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    except store.StoreError:
        if not store.is_regular(path) and not path.is_symlink():
            raise  # a FIFO or device put there: refused in one line, never opened
        # Only a hand-edited file can be half-written (claims appear by link): treat as stale.
        return {"host": "?", "pid": -1, "token": None, "age_s": float("inf")}
    return dict(data)


def is_stale(claim: dict[str, Any], stale_after: float = STALE_AFTER_S) -> bool:
    """Whether the claim's owner can no longer be running the run (see the module docstring)."""
    if float(claim.get("age_s", 0.0)) > stale_after:
        # No heartbeat for that long, whoever the owner: it is gone, frozen, or its run has
        # stalled (owners touch claims only while their run makes progress). On this host too:
        # a folder copied from a machine of the same name holds claims of pids that mean
        # nothing here.
        return True
    if claim.get("host") == socket.gethostname():
        pid = int(claim.get("pid", -1))
        if pid <= 0:
            return True
        start = _pid_start(pid)
        return start is None or (claim.get("pid_start") not in (None, start))
    return float(claim.get("age_s", 0.0)) > stale_after


@dataclass(frozen=True)
class Claim:
    """A claim this process holds; `release()` it when the run's final status is written."""

    run_path: Path
    token: str

    def release(self) -> None:
        """Remove the claim if it is still ours (a stale-claim breaker may have taken it)."""
        current = read_claim(self.run_path)
        if current is not None and current.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                RunPaths(self.run_path).claim.unlink()

    def touch(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(RunPaths(self.run_path).claim)


def _sweep_lock(run_path: Path) -> contextlib.AbstractContextManager[None]:
    return store.exclusive(SweepPaths(RunPaths(run_path).sweep).lock)


def try_claim(run_path: Path, stale_after: float = STALE_AFTER_S,
              **extra: Any) -> tuple[Claim | None, dict[str, Any] | None]:
    """Claim a run. Returns (our claim, None), or (None, the live claim that holds it).

    When the run holds a stale claim, it is broken and the second element of a successful
    claim is the broken claim (so that the caller can record that its previous owner died).
    """
    run_path.parent.mkdir(parents=True, exist_ok=True)
    store.inside(RunPaths(run_path).sweep, run_path)  # never a linked run folder
    run_path.mkdir(exist_ok=True)
    info = {**owner(), **extra}
    broken = None
    for _ in range(3):
        if _link_new(run_path, info):
            return Claim(run_path, info["token"]), broken
        current = read_claim(run_path)
        if current is None:
            continue  # released between our link and our read: try again
        if not is_stale(current, stale_after):
            return None, current
        with _sweep_lock(run_path):
            again = read_claim(run_path)
            if again is not None and again.get("token") == current.get("token"):
                RunPaths(run_path).claim.unlink()
                broken = current
    return None, read_claim(run_path)


def _link_new(run_path: Path, info: dict[str, Any]) -> bool:
    claim = RunPaths(run_path).claim
    tmp = claim.with_name(f".{claim.name}.{info['token']}.tmp")
    fd = store.open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(info, sort_keys=True) + "\n")
    try:
        os.link(tmp, claim)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    return True


class Heartbeat:
    """A daemon thread that touches this process's claims, so other hosts see they are alive."""

    def __init__(self, interval: float = HEARTBEAT_S) -> None:
        self._claims: dict[Claim, Callable[[], bool] | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(interval,), daemon=True,
                                        name="gnsweep-heartbeat")
        self._thread.start()

    def add(self, claim: Claim, alive: Callable[[], bool] | None = None) -> None:
        """Keep `claim` fresh while `alive()` says its run makes progress (always without)."""
        with self._lock:
            self._claims[claim] = alive

    def discard(self, claim: Claim) -> None:
        with self._lock:
            self._claims.pop(claim, None)

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock:
                claims = list(self._claims.items())
            for claim, alive in claims:
                # A stalled run's claim goes stale: the next launch may take it over.
                if alive is None or alive():
                    claim.touch()

    def close(self) -> None:
        self._stop.set()


_heartbeat: Heartbeat | None = None


def heartbeat() -> Heartbeat:
    """This process's heartbeat thread, started on first use."""
    global _heartbeat
    if _heartbeat is None:
        _heartbeat = Heartbeat()
    return _heartbeat


def _forget_heartbeat() -> None:
    # A forked child has no heartbeat thread (threads do not survive fork): start its own.
    global _heartbeat
    _heartbeat = None


os.register_at_fork(after_in_child=_forget_heartbeat)
