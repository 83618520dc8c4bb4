"""Test-only tasks for the watchdog and the launcher's signals: the digits MLP whose data source
blocks for good (a dead data server) once a worker of a launch draws its fourth batch. The
pre-launch check (no launch id in the environment yet) is left alone.

`make` is registered by a test (`blocking_task:make`); `make_custom` is the same task named the
way a user names theirs (`task=custom task._target_=blocking_task.make_custom`);
`make_unreachable` is a task whose data server cannot be reached, and says where;
`make_first_loss_blocks` is one whose loss blocks on its first call in the launcher's
pre-launch check (no launch id yet) until `RELEASE` is set; `make_build_blocks` one whose
building blocks in a launch's worker (a minute: for good, as far as a test sees)."""

import os
import threading
import time

from gnsweep.tasks.digits import Digits, Options

__all__ = ["RELEASE", "Options", "make", "make_build_blocks", "make_custom",
           "make_first_loss_blocks", "make_unreachable"]

RELEASE = threading.Event()
"""Set by a test to let a blocked pre-launch check go on (its thread is then not left behind)."""


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


class FirstLossBlocks(Digits):
    def loss(self, model, batch):
        if not os.environ.get("GNSWEEP_LAUNCH"):
            RELEASE.wait(60)  # blocks: no exception, no progress
        return super().loss(model, batch)


def make_first_loss_blocks(seed: int = 0) -> FirstLossBlocks:
    return FirstLossBlocks(Options(hidden=8), seed)


def make_build_blocks(seed: int = 0) -> Digits:
    if os.environ.get("GNSWEEP_LAUNCH"):
        time.sleep(60)
    return Digits(Options(hidden=8), seed)
