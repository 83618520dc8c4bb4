"""Small faults found by probing the launcher: each ends with one line and exit code 2."""

from typer.testing import CliRunner

from gnsweep.cli import app

EXITING_TASK = '''
import sys
from gnsweep.tasks.digits import Digits, Options

class Exiting(Digits):
    def loss(self, model, batch):
        sys.exit(3)

def make(seed=0):
    return Exiting(Options(hidden=8), seed)
'''


def _one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_sys_exit_inside_a_tasks_loss_is_named_by_the_pre_launch_check(tmp_path, monkeypatch):
    import sys

    (tmp_path / "exiting_task.py").write_text(EXITING_TASK)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as without PYTHONDONTWRITEBYTECODE
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = CliRunner().invoke(app, ["launch", "-q", "--sweep-dir", str(tmp_path / "sweep"),
                                      "sweep=tiny", "task=custom",
                                      "task._target_=exiting_task.make"])
    assert result.exit_code == 2
    line = _one_line(result)
    assert "loss(model, batch) called sys.exit(3)" in line
    assert not (tmp_path / "sweep").exists()
    # Importing the user's module wrote nothing beside it (no __pycache__).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exiting_task.py"]


def test_an_absurd_batch_size_is_refused_up_front(tmp_path):
    result = CliRunner().invoke(app, ["launch", "--dry-run", "--sweep-dir", str(tmp_path),
                                      "sweep.batch_sizes=[8,1e9]"])
    assert result.exit_code == 2
    line = _one_line(result)
    assert "sweep.batch_sizes: 1000000000" in line and "at most 16777216" in line


def test_after_a_nan_loss_the_lowest_loss_is_one_that_was_logged():
    """A run that blows up in its first steps: the centred local-linear window at its start
    extrapolates the steep rise below zero. The lowest loss quoted is never below every
    logged one (a squared error is never negative)."""
    import numpy as np
    import pandas as pd

    from gnsweep.analysis.steps import steps_to_target

    runs = pd.DataFrame({"run_id": ["b8"], "batch_size": [8], "learning_rate": [9.0],
                         "seed": [0], "state": ["diverged"]})
    loss = [1.0, 0.99, 40.0, np.nan]
    metrics = pd.DataFrame({"run_id": "b8", "step": [1, 2, 3, 4], "examples": [8, 16, 24, 32],
                            "loss": loss, "loss_smooth": loss, "eval_loss": np.nan,
                            "b_simple": np.nan, "b_noise": np.nan})
    steps = steps_to_target(metrics, runs, [0.5])
    assert steps["min_loss"].iloc[0] == 0.99


def test_a_nan_loss_is_not_blamed_on_a_batch_of_one(caplog):
    import logging

    import torch

    from gnsweep.measure import NoiseScaleMonitor, NormPair

    monitor = NoiseScaleMonitor(torch.nn.Linear(2, 1))
    with caplog.at_level(logging.WARNING):
        monitor._fold([NormPair(float("nan"), float("nan"), 4.0, 8.0)], None)
    assert "NaN or inf loss" in caplog.text and "batch of one" not in caplog.text


def test_a_target_met_before_the_first_update_is_named_by_the_fit():
    import pytest

    from gnsweep.analysis.fit import FitRefused, fit_hyperbola

    with pytest.raises(FitRefused, match=r"only 0 batch size\(s\) reached the target after "
                       r"training \(3 more met it before the first update, at 0 steps"):
        fit_hyperbola([8, 32, 128], [0.0, 0.0, 0.0])
