"""A sweep two story modules start from, launched once per test session: each test works on a
copy of its own (`shutil.copytree`), so the tests read it as launched in any order."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gnsweep.cli import app

LINREG = ["task=linreg", "sweep=linreg", "task.dim=32", "task.condition=100.0",
          "task.noise=0.5", "task.teacher_power=1.0", "task.eval_size=0"]
"""The linreg_truth experiment's task: B_crit about 23 at loss 0.5 (exact dynamics)."""


@pytest.fixture(scope="session")
def linreg_bound_sweep(tmp_path_factory) -> Path:
    """B_crit above a grid of 2, 4, 8 (about 23 by linreg's exact dynamics): a bound, whose
    next grid `gnsweep plan` runs (test_plan_next_grid, test_plan_resume: both in the xdist
    group `linreg_bound`, so that one worker launches it once)."""
    sweep = tmp_path_factory.mktemp("linreg-bound") / "lin"
    result = CliRunner().invoke(app, ["launch", "-q", *LINREG, "sweep.batch_sizes=[2,4,8]",
                                      "sweep.learning_rates=[0.2,0.4,0.8]",
                                      "sweep.targets=[0.5]", "sweep.max_steps=800",
                                      "--workers", "2", "--sweep-dir", str(sweep)])
    assert result.exit_code == 0, result.output
    return sweep
