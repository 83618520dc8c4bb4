"""Test-only tasks for the watchdog and the launcher's signals: the digits MLP whose data source
blocks for good (a dead data server) once a worker of a launch draws its fourth batch. The
pre-launch check (no launch id in the environment yet) is left alone.

`make` is registered by a test (`blocking_task:make`); `make_custom` is the same task named the
way a user names theirs (`task=custom task._target_=blocking_task.make_custom`);
`make_unreachable` is a task whose data server cannot be reached, and says where."""

import os
import time

from gnsweep.tasks.digits import Digits, Options

__all__ = ["Options", "make", "make_custom", "make_unreachable"]


class Blocking(Digits):
    calls = 0

    def sample(self, batch_size, generator):
        self.calls += 1
        if self.calls > 3 and os.environ.get("GNSWEEP_LAUNCH"):
            time.sleep(3600)  # blocks: no exception, no progress
        return super().sample(batch_size, generator)


def make(options: Options, seed: int) -> Blocking:
    return Blocking(options, seed)


def make_custom(seed: int = 0) -> Blocking:
    return Blocking(Options(hidden=8), seed)


def make_unreachable(seed: int = 0, data_url: str = "") -> Blocking:
    raise ConnectionError(f"cannot reach the data server {data_url}")
