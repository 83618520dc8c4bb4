"""docs/tasks.md works as written for a new user: its example task, saved in a fresh folder and
put on PYTHONPATH, sweeps, analyzes, plots and reports with the doc's own commands."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from locations import ROOT

DOC = (ROOT / "docs" / "tasks.md").read_text()


def _commands() -> list[list[str]]:
    block = DOC.split("Sweep it, then analyze")[1].split("```")[1]
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip().startswith("gnsweep ")]


@pytest.mark.slow
def test_the_example_task_sweeps_analyzes_plots_and_reports(tmp_path):
    module = re.findall(r"```python\n(.*?)```", DOC, re.S)[0]
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "mytask.py").write_text(module)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(lib)]),
           "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    commands = _commands()
    assert [c[1] for c in commands] == ["launch", "analyze", "plot", "report"]
    for command in commands:
        result = subprocess.run([sys.executable, "-m", *command], cwd=work, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (command, result.stdout, result.stderr)
    sweep = work / "runs" / "mytask"
    assert (sweep / "fits.parquet").is_file()
    assert list((sweep / "figures").glob("*.png"))
    assert (sweep / "report.html").is_file()
    import pandas as pd

    fits = pd.read_parquet(sweep / "fits.parquet")
    # Every target of the doc's grid gets a B_crit from the three batch sizes.
    assert len(fits) == 3 and fits["b_crit"].notna().all()
    metrics = pd.read_parquet(sweep / "runs" / "b00032_lr0.2_s0" / "metrics.parquet")
    assert metrics["eval_loss"].notna().any()  # the task's eval_loss, every 10 steps
