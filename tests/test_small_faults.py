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
    (tmp_path / "exiting_task.py").write_text(EXITING_TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = CliRunner().invoke(app, ["launch", "-q", "--sweep-dir", str(tmp_path / "sweep"),
                                      "task=custom", "task._target_=exiting_task.make"])
    assert result.exit_code == 2
    line = _one_line(result)
    assert "loss(model, batch) called sys.exit(3)" in line
    assert not (tmp_path / "sweep").exists()


def test_an_absurd_batch_size_is_refused_up_front(tmp_path):
    result = CliRunner().invoke(app, ["launch", "--dry-run", "--sweep-dir", str(tmp_path),
                                      "sweep.batch_sizes=[8,1e9]"])
    assert result.exit_code == 2
    line = _one_line(result)
    assert "sweep.batch_sizes: 1000000000" in line and "at most 16777216" in line
