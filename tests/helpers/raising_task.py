"""A test-only task (registered by the test as `raising_task:make`): the digits MLP whose data
source raises after a few steps."""

from gnsweep.tasks.digits import Digits, Options

__all__ = ["Options", "make"]


class Raising(Digits):
    calls = 0

    def sample(self, batch_size, generator):
        self.calls += 1
        if self.calls > 5:
            raise RuntimeError("boom: this task fails on purpose")
        return super().sample(batch_size, generator)


def make(options: Options, seed: int) -> Raising:
    return Raising(options, seed)
