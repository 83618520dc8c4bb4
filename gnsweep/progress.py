"""A progress bar for a sweep: runs done/total, failures, divergences, and the time left."""

from __future__ import annotations

import sys
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class SweepProgress:
    def __init__(self, total: int, already_done: int = 0, enabled: bool = True) -> None:
        self.counts = {"done": 0, "diverged": 0, "failed": 0}
        self._progress = Progress(
            TextColumn("[bold]runs"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), TextColumn("left"),
            TimeRemainingColumn(), console=Console(file=sys.stderr), disable=not enabled,
            transient=False,
        )
        self._task = self._progress.add_task("sweep", total=total, completed=already_done,
                                             detail=self._detail())

    def _detail(self) -> str:
        return f"diverged {self.counts['diverged']}  failed {self.counts['failed']}"

    def advance(self, state: str) -> None:
        self.counts[state if state in self.counts else "failed"] += 1
        self._progress.update(self._task, advance=1, detail=self._detail())

    def __enter__(self) -> SweepProgress:
        self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()
