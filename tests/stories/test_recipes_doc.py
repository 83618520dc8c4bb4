"""docs/recipes.md works as written for a new user: its tiny GPT-2 over a Dataset of text windows,
saved in a fresh folder and put on PYTHONPATH, sweeps with the recipe (AdamW, weight decay,
warmup + cosine, clipping, bf16, accumulation, DataLoader workers under the local pool), then
analyzes, plots and reports with the doc's own commands; the metrics hold what they say."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from locations import ROOT

DOC = (ROOT / "docs" / "recipes.md").read_text()


def _commands() -> list[list[str]]:
    block = DOC.split("then analyze, plot and report")[1].split("```")[1]
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip().startswith("gnsweep ")]


@pytest.mark.slow
def test_the_recipe_example_sweeps_analyzes_plots_and_reports(tmp_path):
    pytest.importorskip("transformers")
    import pandas as pd

    from gnsweep import paths, store

    module = re.findall(r"```python\n(.*?)```", DOC, re.S)[0]
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "tinygpt.py").write_text(module)
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
    sweep = work / "runs" / "tinygpt"
    assert len(list((sweep / "figures").glob("*.png"))) >= 3
    fits = pd.read_parquet(sweep / "fits.parquet")
    assert len(fits) == 3 and fits["b_crit"].notna().any()

    # The training windows, counted here from the doc's own split: 90% of the characters.
    import pydoc_data.topics

    characters = len("".join(pydoc_data.topics.topics.values()).encode("ascii", "replace"))
    windows = (int(0.9 * characters) - 1) // 32
    for run in store.run_ids(sweep):
        metrics = pd.read_parquet(sweep / "runs" / run / paths.METRICS)
        rate = float(run.split("_lr")[1].split("_")[0])
        batch = int(run[1:6])
        # B in tokens: 32 characters a window.
        assert (metrics["examples"] == metrics["step"] * batch * 32).all()
        # Each epoch is the training windows once: the windows drawn over their number.
        np.testing.assert_allclose(metrics["epoch"], metrics["step"] * batch / windows)
        # Warmup from 0 then a cosine decay: rises, never above the grid's rate, then falls.
        lr = metrics["lr"].to_numpy()
        top = int(np.argmax(lr))
        assert 0 < lr[0] < lr[top] <= rate
        assert np.all(np.diff(lr[top:]) <= 1e-12) and lr[-1] < rate
        assert (metrics["grad_norm"] > 0).all() and metrics["eval_loss"].notna().any()
        assert (metrics["skipped_steps"] == 0).all()  # bf16 skips no step
    # The task's unit reaches the report (titled by the task) and `gnsweep compare`.
    from gnsweep.commands.compare import load_sweep_fits

    compared = load_sweep_fits(sweep)
    assert (compared.task, compared.unit) == ("tinygpt.make_task", "tokens")
    report = (sweep / "report.html").read_text()
    assert "<title>gnsweep report: tinygpt.make_task" in report
    assert "tokens" in report
