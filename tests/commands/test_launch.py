"""`gnsweep launch --dry-run` of a script sweep: the budget, the run count and each shown run's
command with its placeholders filled, nothing run or written."""

from __future__ import annotations

import shlex
import sys

from locations import HELPERS
from typer.testing import CliRunner

from gnsweep.cli import app
from gnsweep.commands.launch import COMMANDS_SHOWN

runner = CliRunner()


def test_a_script_dry_run_shows_the_budget_and_each_shown_runs_command(tmp_path):
    command = (f"{sys.executable} {HELPERS / 'script_wordlm.py'} --batch_size {{batch_size}} "
               "--lr {learning_rate} --seed {seed} --save {run_dir}/m.npy")
    sweep_dir = tmp_path / "wlm"
    result = runner.invoke(app, ["launch", "--dry-run", "--sweep-dir", str(sweep_dir),
                                 "task=script", f"task.command={command}",
                                 r"task.log_pattern=(?P<step>\d+) (?P<loss>\S+)",
                                 "sweep.batch_sizes=[1,2,4,8]", "sweep.learning_rates=[3,10,30]",
                                 "sweep.max_steps=700"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "12 runs" in out and "sweep.max_steps=700 steps" in out
    shown = [line.split("$ ", 1)[1] for line in out.splitlines() if line.startswith("    $ ")]
    assert len(shown) == min(12, COMMANDS_SHOWN)
    first = shlex.split(shown[0])
    run_dir = (sweep_dir / "runs" / "b00001_lr3_s0").resolve()
    assert first == [sys.executable, str(HELPERS / "script_wordlm.py"), "--batch_size", "1",
                     "--lr", "3.0", "--seed", "0", "--save", f"{run_dir}/m.npy"]
    assert f"... and {12 - COMMANDS_SHOWN} more runs" in out
    assert not sweep_dir.exists()
