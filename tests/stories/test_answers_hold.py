"""Answers that hold still and say when they move (real processes, the fast linreg task):
`recommend`, `report` and `plot` never reuse an analysis older than the runs on record; each
`analyze` and `recommend` records its answer with the runs it used, and a rerun whose answer
changed says what changed and why; automatic targets stay put when runs are added."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.answer_record import remember, runs_on_record, stale
from gnsweep.cli import app

LINREG = ["task=linreg", "sweep=linreg", "sweep.targets=auto", "sweep.max_steps=300",
          "--workers", "2"]
# One worker takes the module whole: its sweep is launched once, not by each worker.
pytestmark = pytest.mark.xdist_group("answers_hold")


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def auto_sweep(tmp_path_factory) -> Path:
    """Batch sizes 4, 8, 16 at three rates, targets chosen from the runs, analysed once."""
    sweep = tmp_path_factory.mktemp("answers") / "lin"
    result = invoke("launch", "-q", *LINREG, "sweep.batch_sizes=[4,8,16]",
                    "sweep.learning_rates=[0.1,0.2,0.4]", "--sweep-dir", sweep)
    assert result.exit_code == 0, result.output
    first = invoke("analyze", sweep)
    assert first.exit_code == 0, first.output
    return sweep


def targets_of(sweep: Path) -> list[float]:
    return [row["target"] for row in json.loads((sweep / "fits.json").read_text())["fits"]]


@pytest.mark.slow
def test_added_runs_are_analysed_said_and_leave_automatic_targets_alone(auto_sweep, tmp_path):
    sweep = tmp_path / "lin"
    shutil.copytree(auto_sweep, sweep)
    before = targets_of(sweep)
    meta = json.loads((sweep / "fits.json").read_text())["meta"]
    assert meta["targets_auto"].startswith("automatic: ")
    assert stale(sweep, meta) == ""  # the analysis covers every run on record
    recorded = json.loads((sweep / paths.ANSWERS).read_text())["analyze"]
    assert set(recorded["runs"]) == set(store.run_ids(sweep))

    added = invoke("launch", "-q", *LINREG, "sweep.batch_sizes=[32]",
                   "sweep.learning_rates=[0.4,0.8]", "--sweep-dir", sweep)
    assert added.exit_code == 0, added.output
    meta = json.loads((sweep / "fits.json").read_text())["meta"]
    assert "2 runs new" in stale(sweep, meta)

    # recommend analyses again, says so in one line, and the answer rests on every run.
    result = invoke("recommend", sweep)
    assert result.exit_code == 0, result.output
    assert "analysed again: the analysis on record was older than the runs (2 runs new" \
        in result.output
    meta = json.loads((sweep / "fits.json").read_text())["meta"]
    assert meta["runs_used"] == runs_on_record(sweep)
    # The automatic targets stay those of the first analysis, and that is said.
    assert targets_of(sweep) == before
    assert "held" in meta["targets_held"]
    # analyze again: its answer moved with the new runs (batch size 32 now the grid's edge),
    # and it says from what, to what, and why.
    again = invoke("analyze", sweep)
    assert again.exit_code == 0, again.output
    assert "the answer changed since the previous `gnsweep analyze`" in again.output
    assert "why: 2 runs new (b00032_lr0.4_s0, b00032_lr0.8_s0)" in again.output
    recorded = json.loads((sweep / paths.ANSWERS).read_text())
    assert set(recorded["recommend"]["runs"]) == set(store.run_ids(sweep))
    # A second analyze of the same runs: the same answer, nothing said.
    same = invoke("analyze", sweep)
    assert "the answer changed" not in same.output


@pytest.mark.slow
def test_plot_and_report_analyse_again_when_runs_were_added(auto_sweep, tmp_path):
    sweep = tmp_path / "lin"
    shutil.copytree(auto_sweep, sweep)
    # An analysis that covers all runs but two (as if they had finished after it).
    from gnsweep.sweep_analysis import load_tables

    meta = json.loads((sweep / "fits.json").read_text())["meta"]
    meta["runs_used"] = dict(list(meta["runs_used"].items())[:-2])  # two runs not covered
    data = json.loads((sweep / "fits.json").read_text())
    data["meta"] = meta
    (sweep / "fits.json").write_text(json.dumps(data))
    results = load_tables(sweep)
    assert results.meta["runs_used"] == runs_on_record(sweep)


def test_a_changed_answer_says_a_fit_now_refused_and_a_target_moved(tmp_path):
    fits = pd.DataFrame({"target": [0.5], "bcrit_status": ["fit"], "bcrit_reason": [""]})
    answer = {"status": "fit", "target": 0.5, "batch_size_samples": 4, "learning_rate": 22.9,
              "bcrit_status": "fit"}
    meta = {"runs_used": {"a": "done:10"}}
    assert remember(tmp_path, "recommend", answer, meta, fits) == []
    assert remember(tmp_path, "recommend", answer, meta, fits) == []  # the same: nothing
    refused = pd.DataFrame({"target": [0.5], "bcrit_status": ["refused"],
                            "bcrit_reason": ["B_crit is poorly determined"]})
    lines = remember(tmp_path, "recommend", {**answer, "status": "refused"}, meta, refused)
    assert len(lines) == 1
    assert "was fit at 0.5: batch 4 samples, lr 22.9, now refused at 0.5" in lines[0]
    assert "at 0.5 the fit was fit and is now refused (B_crit is poorly determined)" \
        in lines[0]
    moved = pd.DataFrame({"target": [0.4], "bcrit_status": ["fit"], "bcrit_reason": [""]})
    lines = remember(tmp_path, "recommend", {**answer, "target": 0.4},
                     {"runs_used": {"a": "done:10", "b": "done:12"},
                      "targets_auto": "automatic: ..."}, moved)
    assert "1 run new (b)" in lines[0]
    assert "the targets moved from 0.5 to 0.4 (chosen automatically)" in lines[0]
