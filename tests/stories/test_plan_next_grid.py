"""`gnsweep plan DIR`: a sweep whose B_crit lies above its grid gets a next grid, and the plan
runs exactly those runs (real processes, real SGD on linreg) until the answer is a fit, which
linreg's exact dynamics confirm."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from gnsweep import store
from gnsweep.cli import app
from gnsweep.runs import RunSpec

pytestmark = pytest.mark.xdist_group("linreg_bound")  # one launch of conftest's sweep


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.slow
def test_plan_runs_the_next_grid_and_turns_the_bound_into_a_fit(linreg_bound_sweep,
                                                                tmp_path):
    # The linreg_truth experiment's task on a grid of 2, 4, 8 at loss 0.5 (conftest.LINREG).
    sweep = tmp_path / "lin"
    shutil.copytree(linreg_bound_sweep, sweep)
    first = invoke("recommend", sweep, "--json")
    assert first.exit_code == 0, first.output
    before = json.loads(first.stdout)
    assert before["status"] == "bound" and before["batch_size_side"] == "at_least"
    grid = before["next_grid"]
    assert grid["runs"] and max(grid["batch_sizes"]) > 8
    ran_before = set(store.run_ids(sweep))

    # A budget of about four times the first sweep: the default (about doubling it) can be
    # spent by the first round alone where a run at the stability edge diverges.
    planned = invoke("plan", sweep, "-q", "--workers", "2", "--budget", "60000")
    assert planned.exit_code == 0, planned.output
    assert f"next grid, round 1 ({len(grid['runs'])} run(s)" in planned.output
    added = set(store.run_ids(sweep)) - ran_before
    # Round 1 is exactly the next grid `recommend` showed; later rounds only add to it.
    assert {RunSpec(r["batch_size"], r["learning_rate"], 0).run_id for r in grid["runs"]} \
        <= added
    assert len(added) <= len(grid["runs"]) + 6

    after = json.loads(invoke("recommend", sweep, "--json").stdout)
    assert after["status"] == "fit", after["reason"]
    from gnsweep.linreg_exact import exact_truth
    from gnsweep.tasks import make_task

    problem = make_task("linreg", {"dim": 32, "condition": 100.0, "noise": 0.5,
                                   "teacher_power": 1.0, "eval_size": 0}, 0).exact_problem()
    truth = exact_truth(problem, [2, 4, 8, 16, 32, 64], [0.5], limits=False).per_target[0]
    assert after["b_crit"] == pytest.approx(truth.b_crit_fit, rel=0.5)
    _, best_lr = problem.best_steps(after["batch_size"], [0.5])
    # One seed of real SGD: the exact-dynamics test (test_recommend) holds it to 20%.
    assert after["learning_rate"] == pytest.approx(float(best_lr[0]), rel=0.3)
    # Nothing left to run: a second plan only says the answer.
    again = invoke("plan", sweep, "-q")
    assert again.exit_code == 0 and "round(s): the answer is fit" in again.output
    assert set(store.run_ids(sweep)) == ran_before | added


def test_plan_dir_on_a_folder_that_is_not_a_sweep_is_one_line(tmp_path):
    for args, reason in (([tmp_path / "nothing"], "no such sweep folder"),
                         ([tmp_path], "not a sweep folder"),
                         ([tmp_path, "--sweep-dir", tmp_path / "x"], "drop --sweep-dir")):
        result = invoke("plan", *args)
        assert result.exit_code == 2, result.output
        assert result.output.count("gnsweep: error:") == 1 and reason in result.output
        assert "Traceback" not in result.output
