"""A test-only task (registered by the test as `dying_task:make`): the digits MLP whose first
batch, in the first process to draw one, kills that process (os._exit), as a crashed worker."""

import os

from gnsweep.tasks.digits import Digits, Options

__all__ = ["MARKER", "Options", "make"]

MARKER = "GNSWEEP_TEST_DIE_ONCE"
"""Environment variable naming the file whose absence makes the next draw die (and creates it)."""


class Dying(Digits):
    def sample(self, batch_size, generator):
        marker = os.environ.get(MARKER)
        if marker and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)
        return super().sample(batch_size, generator)


def make(options: Options, seed: int) -> Dying:
    return Dying(options, seed)
