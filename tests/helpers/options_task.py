"""A test-only custom task with a float option the task ignores (`task=custom
task._target_=options_task.make +task.scale=nan`): the folder's config then holds a NaN."""

from protocol_tasks import Regression


def make(seed: int, scale: float = 1.0) -> Regression:
    return Regression(seed, 4, 1)
