"""`gnsweep plan` through the CLI with real worker processes: the public contract (default task,
no overrides), a small plan, its resume, and bad input."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.paths import PLAN

runner = CliRunner()
TINY = ["sweep=tiny", "--workers", "2"]


def plan(*args: str):
    return runner.invoke(app, ["plan", *args])


@pytest.mark.slow
def test_contract_plan_writes_runs_with_examples_and_analyze_writes_fits(tmp_path):
    # The tiny grid with rates a decade either side of its own: the tiny grid alone is run
    # whole (each best rate needs both neighbours), this one the plan prunes.
    wide = ["sweep=tiny", "sweep.learning_rates=[0.03,0.1,0.3,1.0,3.0,10.0]"]
    out = tmp_path / "D"
    result = plan(*wide, "--workers", "2", "--sweep-dir", str(out), "-q")
    assert result.exit_code == 0, result.output
    files = sorted(out.glob("runs/*/metrics.parquet"))
    assert files
    for path in files:
        assert "examples" in pq.read_schema(path).names
    result = runner.invoke(app, ["analyze", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "fits.parquet").is_file()
    # Fewer runs than the grid: the plan pruned some.
    grid = compose(wide).sweep
    assert len(files) < len(grid.batch_sizes) * len(grid.learning_rates)


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "tiny"
    result = plan(*TINY, "--sweep-dir", str(out), "-q")
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.mark.slow
def test_plan_prints_what_it_decided_and_why(tiny_plan):
    _, output = tiny_plan
    assert "pilot b=32 lr=0.3" in output  # the tiny grid's middle batch size and lower-middle rate
    assert "B_simple" in output and "eq. 2.7" in output
    assert "batch sizes [8, 32, 128]" in output
    assert "pruned" in output


@pytest.mark.process
def test_every_run_of_the_plan_is_a_grid_run_under_runs_and_analyzes(tiny_plan, tmp_path):
    out, _ = tiny_plan
    record = store.read_json(out / PLAN)
    planned = {run["run_id"] for entry in record["rounds"] for run in entry["runs"]}
    assert set(store.run_ids(out)) == planned
    grid = compose(["sweep=tiny"]).sweep
    for run in (r for entry in record["rounds"] for r in entry["runs"]):
        assert run["batch_size"] in grid.batch_sizes
        assert run["learning_rate"] in grid.learning_rates
        assert run["max_steps"] <= grid.max_steps
        assert store.read_status(paths.run_dir(out, run["run_id"]))["state"] in ("done",
                                                                                  "diverged")
    result = runner.invoke(app, ["analyze", str(out), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output


@pytest.mark.process
def test_a_rerun_resumes_and_re_derives_the_same_decisions(tiny_plan, tmp_path):
    out, _ = tiny_plan
    record = store.read_json(out / PLAN)
    attempts = {r: store.read_status(paths.run_dir(out, r))["attempts"]
                for r in store.run_ids(out)}
    # A finished plan re-run starts nothing.
    result = plan(*TINY, "--sweep-dir", str(out), "-q")
    assert result.exit_code == 0, result.output
    assert {r: store.read_status(paths.run_dir(out, r))["attempts"]
            for r in store.run_ids(out)} == attempts
    # Cut the plan after its first round, as if it had been stopped there: the re-run decides
    # the same rounds again from the same finished runs.
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    later = {r["run_id"] for entry in record["rounds"][1:] for r in entry["runs"]}
    for run_id in later:
        shutil.rmtree(paths.run_dir(cut, run_id))
    store.write_json(cut / PLAN, {"rounds": record["rounds"][:1]})
    result = plan(*TINY, "--sweep-dir", str(cut), "-q")
    assert result.exit_code == 0, result.output
    assert store.read_json(cut / PLAN)["rounds"] == record["rounds"]


@pytest.mark.slow
def test_a_pilot_that_reaches_no_target_is_one_line_and_exit_2(tmp_path):
    result = plan(*TINY, "sweep.max_steps=1", "--sweep-dir", str(tmp_path / "p"), "-q")
    assert result.exit_code == 2
    assert "reached no target" in result.output and "Traceback" not in result.output


@pytest.mark.process
def test_a_folder_with_other_settings_is_refused(tiny_plan):
    out, _ = tiny_plan
    result = plan(*TINY, "train.momentum=0.5", "--sweep-dir", str(out), "-q")
    assert result.exit_code == 2
    assert "other settings" in result.output


@pytest.mark.slow
def test_a_plan_on_a_task_in_tokens_reads_its_runs_by_their_grid_point(tmp_path):
    """The runs table counts a language model's batch in tokens, the grid in sequences a step:
    read by the former, the pilot never matched the grid and the plan proposed it again,
    round after round (11,000 rounds in 15 minutes on a nanoGPT-style LM)."""
    out = tmp_path / "lm"
    result = plan("task=custom", "task._target_=lm_task.make", "sweep.batch_sizes=[2,4,8]",
                  "sweep.learning_rates=[0.01,0.03]", "sweep.targets=[2.6]",
                  "sweep.max_steps=60", "noise.method=none", "--workers", "2",
                  "--sweep-dir", str(out), "-q")
    assert result.exit_code == 0, result.output
    rounds = store.read_json(out / PLAN)["rounds"]
    run_ids = [run["run_id"] for entry in rounds for run in entry["runs"]]
    assert len(run_ids) == len(set(run_ids)) <= 6  # no run proposed twice, within the grid
    assert rounds[0]["phase"] == "pilot" and rounds[0]["runs"][0]["batch_size"] == 4


@pytest.mark.process
def test_a_plan_that_would_propose_finished_runs_again_stops_with_a_reason(tmp_path,
                                                                          monkeypatch):
    from gnsweep.commands import plan as plan_command

    first = plan(*TINY, "--sweep-dir", str(tmp_path / "p"), "-q")
    assert first.exit_code == 0, first.output
    # Its rounds forgotten (a folder without plan.json is a launch's, refused): decided again
    # from the finished runs ...
    store.write_json(tmp_path / "p" / PLAN, {"rounds": []})
    monkeypatch.setattr(plan_command, "read_outcomes",  # ... which are not read
                        lambda sweep_dir, config: [])
    again = plan(*TINY, "--sweep-dir", str(tmp_path / "p"), "-q")
    assert again.exit_code == 2
    assert "proposes again runs it has run" in again.output
