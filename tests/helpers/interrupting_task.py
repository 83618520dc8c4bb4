"""A test-only task (registered by the test as `interrupting_task:make`): the digits MLP whose
data source raises KeyboardInterrupt after a few steps, with no signal anywhere (a library that
turns its own timeout into one, say)."""

from gnsweep.tasks.digits import Digits, Options

__all__ = ["Options", "make"]


class Interrupting(Digits):
    calls = 0

    def sample(self, batch_size, generator):
        self.calls += 1
        if self.calls > 5:
            raise KeyboardInterrupt("raised by the task itself")
        return super().sample(batch_size, generator)


def make(options: Options, seed: int) -> Interrupting:
    return Interrupting(options, seed)
