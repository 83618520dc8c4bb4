"""Notices said once per launch of a sweep, not once per run.

Every run builds its own noise monitor, and each says what it cannot measure (a layer without
per-example norms, a model without double backward): on a sweep of 50 runs the same line would
be printed 50 times, once per run, by every worker process. A worker installs `once_per_launch`:
the first process to say a given warning creates a marker file named by the message in the
launch's folder (atomically, O_EXCL, so also across Slurm nodes sharing the folder); the others
stay silent.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from gnsweep.paths import SweepPaths


class OncePerLaunch(logging.Filter):
    """Passes a warning only the first time any process of the launch says it."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        # A message whose numbers differ from run to run names its own key (`extra={"once":}`).
        text = getattr(record, "once", None) or record.getMessage()
        key = hashlib.sha256(str(text).encode()).hexdigest()[:24]
        if self.folder.parent.is_symlink() or self.folder.is_symlink():
            return True  # never a marker through a link (it would land outside the sweep)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.folder / key, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False
        except OSError:
            return True  # cannot tell: say it
        return True


def once_per_launch(sweep_dir: Path, launch: str | None) -> None:
    """In this worker process: gnsweep's warnings go to stderr once per launch `launch` (the
    launch id every worker inherits; None: every time, as before). Called again, it replaces
    its handler. It changes gnsweep's logger for the rest of the process: a worker's entry
    point that may be called in-process undoes it with `kept_logging`."""
    if not launch:
        return
    logger = logging.getLogger("gnsweep")
    for old in [h for h in logger.handlers if getattr(h, "gnsweep_notices", False)]:
        logger.removeHandler(old)
    handler = logging.StreamHandler()  # this process's stderr, as Python's last resort prints
    handler.setLevel(logging.WARNING)
    handler.addFilter(OncePerLaunch(SweepPaths(sweep_dir).notices / launch))
    handler.gnsweep_notices = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.propagate = False


@contextlib.contextmanager
def kept_logging() -> Iterator[None]:
    """gnsweep's logger as it was before the block, after it: its handlers, filters, level and
    propagation. A worker's entry point called in-process (by a test, or a program of its own)
    hands the caller's logging back: records stop reaching the root logger's handlers otherwise
    (the caller's own, or pytest's capture)."""
    logger = logging.getLogger("gnsweep")
    handlers, filters = list(logger.handlers), list(logger.filters)
    level, propagate, disabled = logger.level, logger.propagate, logger.disabled
    try:
        yield
    finally:
        logger.handlers[:] = handlers
        logger.filters[:] = filters
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled


def forget(sweep_dir: Path, launch: str) -> None:
    """Remove the launch's markers (its workers are done)."""
    markers = SweepPaths(sweep_dir).notices
    shutil.rmtree(markers / launch, ignore_errors=True)
    with contextlib.suppress(OSError):
        markers.rmdir()  # only when no other launch's are left
