"""A launch's state in the launcher's process."""

from __future__ import annotations

import os

from gnsweep.executors import LAUNCH_ENV


def test_a_launch_leaves_no_launch_id_in_its_process(tiny_sweep):
    """Launched in this process (`tiny_sweep`), it leaves no launch id behind: what this
    process starts later is no part of a launch that has ended."""
    assert (tiny_sweep / "config.yaml").is_file()
    assert LAUNCH_ENV not in os.environ
