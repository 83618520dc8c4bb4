"""A sweep in flight: a training run's rows are on disk as it goes; `gnsweep status` shows where
it stands and `gnsweep analyze` uses the targets it has passed, saying it is still running."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.executors import execute_run, open_folder
from gnsweep.sweep import prepare
from gnsweep.sweep_analysis import analyze_sweep
from gnsweep.training import StopRequested, train


def test_status_and_analyze_see_a_running_run(tmp_path):
    torch.set_num_threads(1)
    config = compose(["task=linreg", "sweep=linreg", "sweep.batch_sizes=[16]",
                      "sweep.learning_rates=[0.05]", "sweep.seeds=[0,1]", "sweep.targets=[1e-9]",
                      "sweep.max_steps=60", "train.checkpoint_every=10"])
    finished, running = (spec.run_id for spec in prepare(tmp_path, config))
    assert execute_run(open_folder(tmp_path), finished).state == "done"
    path = paths.run_dir(tmp_path, running)
    spec = next(s for s in prepare(tmp_path, config) if s.run_id == running)
    with pytest.raises(StopRequested):  # stopped at step 20, as if still training there
        train(config, spec, path, should_stop=lambda: _last_step(path) >= 20)
    store.write_status(path, "running", attempts=1)
    rows = store.read_metrics(path)
    assert rows is not None and rows.column("step").to_pylist()[-1] == 20

    shown = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    smooth = rows.column("loss_smooth").to_pylist()[-1]
    assert f"step 20, 320 examples, loss {smooth:.4g}" in shown.output

    # A target both runs passed early is used from both; one the finished run reached late waits
    # for the running run (not counted as missed).
    losses = store.read_table(paths.run_dir(tmp_path, finished) / paths.METRICS).to_pandas()
    # Both seeded runs' smoothed losses pass 2.5 by their eighth step, after the smoothing
    # window first holds 64 samples (a reach before that is not counted: outcome early).
    easy = 2.5
    hard = float(np.max(losses["loss_smooth"][losses["step"] >= 45]))
    assert hard < float(rows.column("loss_smooth").to_pylist()[-1])
    analysis = analyze_sweep(tmp_path, targets=[easy, hard], write=False)
    steps = analysis.steps.set_index(["run_id", "target"])
    assert steps.loc[(running, easy), "reached"] and steps.loc[(finished, easy), "reached"]
    assert steps.loc[(finished, hard), "reached"]
    assert steps.loc[(running, hard), "outcome"] == "running"
    assert any("1 run still running" in w for w in analysis.warnings)


def _last_step(path) -> int:
    row = store.last_metrics_row(path)
    return int(row["step"]) if row else 0
