"""Each sweep knows its scale: the parameters counted at launch (scale.json), or given as
sweep.scale.params; a fixed-budget sweep folder read by `gnsweep laws` (every run trained to
sweep.max_examples, its final eval loss compared), and the folders it refuses in one line."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from torch import nn
from typer.testing import CliRunner

from gnsweep.analysis.laws.sweeps import final_losses
from gnsweep.analysis.pipeline import AnalysisError
from gnsweep.cli import app
from gnsweep.config import ConfigError, SweepConfig
from gnsweep.tasks.launch_check import count_parameters


def test_count_parameters_leaves_out_embeddings_and_counts_tied_weights_once():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.hidden = nn.Linear(8, 8)
            self.out = nn.Linear(8, 50, bias=False)
            self.out.weight = self.embed.weight  # tied: one tensor

    total, non_embedding = count_parameters(Tiny())
    assert total == 50 * 8 + 8 * 8 + 8
    assert non_embedding == 8 * 8 + 8


def test_scale_params_is_checked():
    assert SweepConfig(scale={"params": 7e9}).scale.params == 7e9
    with pytest.raises(ConfigError, match=r"sweep\.scale\.params"):
        SweepConfig(scale={"params": -1})
    with pytest.raises(ConfigError, match=r"sweep\.scale\.width: unknown option"):
        SweepConfig(scale={"width": 3})


def test_a_run_stopped_by_its_target_is_refused():
    runs = pd.DataFrame({"run_id": ["a"], "batch_size": [8], "learning_rate": [0.1],
                         "state": ["done"]})
    metrics = pd.DataFrame({"run_id": ["a", "a"], "step": [1, 2], "examples": [8.0, 16.0],
                            "loss_smooth": [1.0, 0.5], "eval_loss": [float("nan")] * 2})
    with pytest.raises(AnalysisError, match=r"run a stopped at 16 examples, before "
                       r"sweep\.max_examples=1,024"):
        final_losses("s", runs, metrics, 1024)
    with pytest.raises(AnalysisError, match="not a fixed-budget sweep"):
        final_losses("s", runs, metrics, 0)


def test_launch_records_the_scale_and_a_sweep_without_a_budget_is_refused(tiny_sweep, tmp_path):
    scale = json.loads((tiny_sweep / "scale.json").read_text())
    assert scale["params"] == scale["params_non_embedding"] == scale["params_total"] > 0
    result = CliRunner().invoke(app, ["laws", str(tiny_sweep), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("gnsweep: error:") and "not a fixed-budget sweep" in line
    (tiny_sweep / "scale.json").unlink()  # a sweep launched before sizes were recorded
    result = CliRunner().invoke(app, ["laws", str(tiny_sweep), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "no scale.json" in result.output and "sweep.scale.params=" in result.output
    (tiny_sweep / "scale.json").write_text('{"params": 0}')  # a task gnsweep cannot count
    result = CliRunner().invoke(app, ["laws", str(tiny_sweep), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "sweep.scale.params=" in result.output


def test_a_fixed_budget_is_a_setting():
    """sweep.budget: max_examples follows it, max_steps holds the smallest batch's steps, and
    the runs stop at no target (the targets stay for the analysis)."""
    sweep = SweepConfig(batch_sizes=[4, 16], targets=[0.5], max_steps=10, budget=256)
    assert sweep.max_examples == 256 and sweep.max_steps == 64
    assert sweep.targets == [0.5] and not sweep.stops_at_target
    assert SweepConfig(targets=[0.5]).stops_at_target
    with pytest.raises(ConfigError, match=r"sweep\.budget=256 and sweep\.max_examples=128"):
        SweepConfig(budget=256, max_examples=128)
    with pytest.raises(ConfigError, match=r"sweep\.budget: -1"):
        SweepConfig(budget=-1)


@pytest.mark.slow
def test_fixed_budget_sweep_folder(tmp_path):
    """A real 4-run linreg sweep at a fixed budget (sweep.budget, with targets the runs reach
    on the way: none stops there): N = 16 weights + 1 bias from scale.json, D = the budget,
    one cell (no law across one cell, said in one line each)."""
    sweep = tmp_path / "d256"
    launched = CliRunner().invoke(app, [
        "launch", "task=linreg", "sweep=laws", "sweep.batch_sizes=[4,16]",
        "sweep.learning_rates=[0.2,0.8]", "sweep.targets=[0.5]", "sweep.budget=256",
        "--sweep-dir", str(sweep), "--workers", "2", "--quiet"])
    assert launched.exit_code == 0, launched.output
    result = CliRunner().invoke(app, ["laws", str(sweep), "--out", str(tmp_path / "out"),
                                      "--bootstrap", "20"])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "out" / "laws.json").read_text())
    (cell,) = data["cells"]
    assert (cell["N"], cell["D"]) == (17, 256)
    assert cell["edge"] is True  # a 2 x 2 grid brackets nothing
    assert {r["quantity"] for r in data["refused"]} == {"batch_size", "learning_rate", "b_crit"}
    assert data["laws"] == []
    # The sweep's own report shows the laws of the family it is a cell of.
    reported = CliRunner().invoke(app, ["report", str(sweep)])
    assert reported.exit_code == 0, reported.output
    page = (sweep / "report.html").read_text()
    assert "Laws across scale" in page and str((tmp_path / "out").resolve()) in page
    assert "B_opt: no law" in page
