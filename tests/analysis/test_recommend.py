"""`gnsweep recommend`: the batch size and learning rate to train with.

Ground truth from mathematics (eq. 2.11's tradeoff at multiples of B_crit) and from linreg's
exact expected SGD dynamics (`gnsweep.linreg_exact`): its loss curves are the analysis's input,
its best learning rate at the recommended batch size the answer to match, and the curves of
the runs a next grid adds show whether they turn a bound into a fit.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from gnsweep.analysis.decision import PREFERENCES, TRADEOFF_MULTIPLES, recommend, tradeoff
from gnsweep.analysis.setting import Setting
from gnsweep.cli import app
from gnsweep.folder import read_results

LINREG = {"dim": 32, "condition": 100.0, "noise": 0.5, "teacher_power": 1.0, "eval_size": 0}
"""The linreg_truth experiment's task (conf/experiment/linreg_truth.yaml)."""
GRID_LR = [0.2, 0.283, 0.4, 0.566, 0.8, 1.13, 1.6, 1.9, 2.1]
TARGETS = [0.5, 0.25, 0.2]
CONTRACT = ("batch_size", "batch_size_samples", "learning_rate", "learning_rate_low",
            "learning_rate_high", "steps", "examples", "target", "status", "next_grid")


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def problem():
    from gnsweep.tasks import make_task

    return make_task("linreg", LINREG, 0).exact_problem()


def exact_curves(problem, batch_sizes, learning_rates, steps: int = 1500) -> pd.DataFrame:
    """The exact expected loss curve of every (B, lr): a loss-curves table (docs/analysis.md),
    each run stopped a while after the hardest target (as a sweep's runs stop), a diverging one
    at its first non-finite loss."""
    parts = []
    for b in batch_sizes:
        for lr in learning_rates:
            with np.errstate(all="ignore"):
                curve = problem.loss_curve(lr, b, steps)
            curve = np.where(np.isfinite(curve) & (curve < 1e6), curve, np.inf)
            end = len(curve)
            hit = np.flatnonzero(curve <= min(TARGETS))
            if len(hit):
                end = min(end, int(hit[0] * 1.5) + 2)
            bad = np.flatnonzero(~np.isfinite(curve))
            if len(bad):
                end = min(end, int(bad[0]) + 1)
            parts.append(pd.DataFrame({"run_id": f"b{b}_lr{lr:g}", "batch_size": b,
                                       "learning_rate": lr, "step": np.arange(end),
                                       "loss": curve[:end]}))
    return pd.concat(parts, ignore_index=True)


def analyze_curves(frame: pd.DataFrame, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    table = folder / "curves.csv"
    frame.to_csv(table, index=False)
    result = invoke("analyze", "--table", table, "--out", folder / "out", "--targets",
                    ",".join(map(str, TARGETS)), "--loss", "raw")
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def linreg_table(problem, tmp_path_factory) -> Path:
    """linreg_truth's grid (4..256 x 9 rates) analysed from its exact loss curves."""
    folder = tmp_path_factory.mktemp("linreg")
    analyze_curves(exact_curves(problem, [4, 8, 16, 32, 64, 128, 256], GRID_LR), folder)
    return folder / "out"


def test_tradeoff_is_eq_2_11():
    """S = S_min (1 + B_crit/B) and E = E_min (1 + B/B_crit): at m B_crit, S/S_min = 1 + 1/m
    and E/E_min = 1 + m, so (S/S_min - 1)(E/E_min - 1) = 1 on every row."""
    rows = tradeoff(400.0, 50.0, 20_000.0, Setting())
    assert [r["multiple"] for r in rows] == list(TRADEOFF_MULTIPLES)
    for row in rows:
        m = row["multiple"]
        assert row["batch_size"] == 400 * m
        assert row["steps_over_min"] == pytest.approx(1 + 1 / m)
        assert row["examples_over_min"] == pytest.approx(1 + m)
        assert row["steps"] == pytest.approx(50 * (1 + 1 / m))
        assert row["examples"] == pytest.approx(row["steps"] * row["batch_size"])
        assert (row["steps_over_min"] - 1) * (row["examples_over_min"] - 1) == pytest.approx(1)


def test_samples_are_multiples_of_the_data_parallel_size_and_tokens_follow():
    """A language model: B in tokens, 128 tokens a sequence, 8 processes: a B_crit of 100,000
    tokens is 781.25 sequences, set as 784 (98 x 8), which is 100,352 tokens."""
    setting = Setting(unit="tokens", per_sample=128.0, data_parallel=8)
    assert setting.samples(100_000) == 784
    assert setting.samples(10.0) == 8  # never below one sequence per process
    row = tradeoff(100_000.0, 10.0, 1e6, setting, (1.0,))[0]
    assert row["batch_size_samples"] == 784 and row["batch_size"] == 784 * 128
    # The cost is eq. 2.11 at the batch that will run, not at B_crit itself.
    assert row["steps"] == pytest.approx(10 * (1 + 100_000 / 100_352))


def test_on_linreg_the_learning_rate_is_within_20_percent_of_the_exact_optimum(
        linreg_table, problem):
    """For each preference: B is its multiple of the fitted B_crit, the learning rate comes
    from the eq. 2.7 fit inside the grid, and it is within 20% of the learning rate that
    reaches the target in fewest expected steps at that batch size (exact dynamics)."""
    results = read_results(linreg_table)
    for prefer, multiple in PREFERENCES.items():
        rec = recommend(results, prefer)
        assert rec.status == "fit", rec.reason
        assert rec.target == min(TARGETS)  # the hardest, well determined here
        row = results.fits[results.fits["target"] == rec.target].iloc[0]
        assert rec.batch_size_samples == round(multiple * row["b_crit"])
        assert rec.lr_status == "fit"
        _, best_lr = problem.best_steps(rec.batch_size, [rec.target])
        assert rec.learning_rate == pytest.approx(float(best_lr[0]), rel=0.2), prefer
        assert rec.learning_rate_low <= rec.learning_rate <= rec.learning_rate_high
        # The cost by eq. 2.11 at the batch size set, against the exact steps there.
        exact_steps, _ = problem.best_steps(rec.batch_size, [rec.target])
        assert rec.steps == pytest.approx(float(exact_steps[0]), rel=0.2), prefer


def test_recommend_json_has_the_contract(linreg_table):
    result = invoke("recommend", linreg_table, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(CONTRACT) <= set(data)
    assert data["status"] == "fit" and data["next_grid"] is None
    assert data["batch_size"] == data["batch_size_samples"]  # a task counting examples
    # Balanced: B = B_crit, 2 S_min and 2 E_min (eq. 2.11) up to the rounding of B.
    assert data["steps"] == pytest.approx(2 * data["s_min"], rel=0.05)
    assert data["examples"] == pytest.approx(2 * data["e_min"], rel=0.05)
    text = invoke("recommend", linreg_table, "--prefer", "compute", "--target", "0.25")
    assert text.exit_code == 0, text.output
    assert "recommendation: Train at loss 0.25 (compute)" in text.stdout
    assert "next launch: sweep.batch_sizes=[" in text.stdout
    # analyze wrote the same decision into fits.json.
    saved = json.loads((linreg_table / "fits.json").read_text())["recommendation"]
    assert saved["batch_size"] == data["batch_size"] and saved["status"] == "fit"


def test_a_target_beyond_the_runs_is_a_bound_through_the_loss_law(linreg_table):
    """A loss no target was analysed at: B_crit(L) = B*/L^(1/alpha_B) of loss_scaling.parquet,
    a bound that says how far beyond the hardest fitted loss it is carried."""
    law = pd.read_parquet(linreg_table / "loss_scaling.parquet").iloc[0]
    result = invoke("recommend", linreg_table, "--target", "0.1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["status"] == "bound" and data["bcrit_status"] == "law"
    assert data["b_crit"] == pytest.approx(law["b_star"] / 0.1 ** (1 / law["alpha_b"]))
    assert "2x beyond the hardest loss it was fitted on (0.2)" in data["reason"]
    assert data["learning_rate"] is None and data["steps"] is None


@pytest.mark.parametrize(("args", "reason"), [
    (["--prefer", "fast"], "--prefer: 'fast' is not one of time, balanced, compute"),
    (["--target", "0.3"], "target 0.3 was not analysed (analysed: 1.5)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, reason):
    """A bad preference; a target not analysed where no B_crit(L) stands (one target)."""
    table = tmp_path / "steps.csv"
    pd.DataFrame([(b, 1.5, 200.0 * (1 + 64 / b)) for b in (8, 32, 128, 512)],
                 columns=["batch_size", "target", "steps"]).to_csv(table, index=False)
    assert invoke("analyze", "--table", table, "--out", tmp_path / "out").exit_code == 0
    result = invoke("recommend", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert result.output.count("gnsweep: error:") == 1 and reason in result.output
    assert "Traceback" not in result.output


def test_no_folder_is_one_line(tmp_path):
    result = invoke("recommend", tmp_path / "nothing")
    assert result.exit_code == 2 and "no such folder" in result.output


def test_a_bound_gets_a_next_grid_that_turns_it_into_a_fit(problem, tmp_path):
    """Batch sizes 2..8 only, where linreg's B_crit (about 40 at the hardest target) lies
    above: the answer is a bound with a next grid above the grid. Adding the exact curves of
    exactly the runs each next grid names (as `gnsweep plan DIR` runs them, round after round)
    turns it into a fit within two rounds and 20 runs, whose learning rate is within 20% of the
    exact optimum at its batch size."""
    frame = exact_curves(problem, [2, 4, 8], GRID_LR)
    analyze_curves(frame, tmp_path / "r0")
    rec = recommend(read_results(tmp_path / "r0" / "out"))
    assert rec.status == "bound" and rec.bcrit_status == "bound", rec
    assert rec.batch_size_side == "at_least" and rec.batch_size == 8
    assert rec.next_grid is not None
    new = set(rec.next_grid.batch_sizes) - {2, 4, 8}
    assert new and min(new) > 8
    added = 0
    for k in (1, 2):
        assert rec.next_grid is not None and rec.next_grid.runs, rec
        added += len(rec.next_grid.runs)
        frame = pd.concat([frame, *(exact_curves(problem, [run.batch_size], [run.learning_rate])
                                    for run in rec.next_grid.runs)], ignore_index=True)
        analyze_curves(frame, tmp_path / f"r{k}")
        rec = recommend(read_results(tmp_path / f"r{k}" / "out"))
        if rec.status == "fit":
            break
    assert rec.status == "fit", rec.reason
    assert added <= 20
    _, best_lr = problem.best_steps(rec.batch_size, [rec.target])
    assert rec.learning_rate == pytest.approx(float(best_lr[0]), rel=0.2)


@pytest.mark.slow
def test_tiny_sweep_recommends_from_its_fit_and_says_it_is_not_settled(tiny_sweep):
    """The default task (digits, sweep=tiny): 3 batch sizes and 2 learning rates. B is the
    hardest fitted target's B_crit, but 3 batch sizes cannot settle it and every best rate sits
    on the grid's edge: a bound, whose next grid adds batch sizes and one rate beyond each
    edge."""
    result = invoke("analyze", tiny_sweep)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("recommendation: ")
    results = read_results(tiny_sweep)
    rec = recommend(results)
    fits = results.fits.set_index("target")
    assert rec.target in fits.index
    assert rec.bcrit_status == "thin" and rec.status == "bound"
    assert "rests on only 3 batch sizes" in rec.reason
    assert rec.batch_size_samples == round(fits.loc[rec.target, "b_crit"])
    assert rec.lr_status in ("lower_bound", "upper_bound") and math.isnan(rec.learning_rate)
    grid = rec.next_grid
    assert grid is not None and set(grid.batch_sizes) - {8, 32, 128}
    front = results.front[results.front["target"] == rec.target]
    for point in front[front["lr_on_edge"]].itertuples():
        beyond = [r.learning_rate for r in grid.runs if r.batch_size == point.batch_size]
        assert beyond and all(x > 1.0 if point.lr_edge == "high" else x < 0.3 for x in beyond)
    # The report's answer box opens with the same sentence (`gnsweep report` renders it).
    from gnsweep.report.html import recommendation_box

    (box,) = recommendation_box(results)
    assert "Not settled: B_crit" in box and "run the next grid" in box


def test_auto_targets_lie_where_the_exact_curves_say(problem, tmp_path):
    """`--targets auto` on linreg's exact loss curves: no run is below the easiest level within
    its first 10 updates, and at least 4 batch sizes (each at its best rate) get below the
    hardest before the last 20% of their curve; the levels are recorded with how they were
    chosen and the recommendation uses them."""
    batch_sizes = [4, 8, 16, 32, 64, 128, 256]
    frame = exact_curves(problem, batch_sizes, GRID_LR)
    table = tmp_path / "curves.csv"
    frame.to_csv(table, index=False)
    result = invoke("analyze", "--table", table, "--out", tmp_path / "out", "--targets", "auto",
                    "--loss", "raw")
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "out" / "fits.json").read_text())
    targets = [row["target"] for row in saved["fits"]]
    assert len(targets) == 3 and "automatic: 3 levels" in saved["meta"]["targets_auto"]
    easiest, hardest = max(targets), min(targets)
    reached = 0
    for b in batch_sizes:
        best = math.inf
        for lr in GRID_LR:
            with np.errstate(all="ignore"):
                curve = problem.loss_curve(lr, b, 1500)
            # Row k of the table is the loss before update k: the first 10 updates are rows
            # 0..10.
            assert not (curve[:11] <= easiest).any(), (b, lr)
            run = frame[frame["run_id"] == f"b{b}_lr{lr:g}"]["loss"].to_numpy()
            timely = run[1:max(2, int(0.8 * (len(run) - 1)) + 1)]
            best = min(best, float(np.min(timely)))
        reached += best <= hardest
    assert reached >= 4
    assert saved["recommendation"]["target"] in targets


@pytest.mark.slow
def test_a_custom_task_in_tokens_without_targets_gets_auto_targets_and_both_units(tmp_path,
                                                                              monkeypatch):
    """A custom task counting 3 tokens a sample, launched with no targets: runs train their
    budget, the analysis chooses the targets, and the recommendation says the batch in tokens
    and in sequences (samples) a step."""
    # The custom-task resolver puts the cwd on sys.path and PYTHONPATH: undone after.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    sweep = tmp_path / "tok"
    launched = invoke("launch", "-q", "task=custom", "task._target_=protocol_tasks.tokens",
                      "sweep.batch_sizes=[2,4,8,16]", "sweep.learning_rates=[0.3]",
                      "sweep.max_steps=60", "--workers", "2", "--sweep-dir", sweep)
    assert launched.exit_code == 0, launched.output
    assert "targets auto (from the runs)" in launched.output
    status = json.loads((sweep / "runs" / "b00004_lr0.3_s0" / "status.json").read_text())
    assert status["steps"] == 60  # no target to stop at: the whole budget
    result = invoke("recommend", sweep, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["unit"] == "tokens" and data["per_sample"] == 3.0
    assert data["status"] in ("fit", "bound"), data["reason"]
    assert data["batch_size"] == 3 * data["batch_size_samples"]
    saved = json.loads((sweep / "fits.json").read_text())
    assert saved["meta"]["targets_auto"].startswith("automatic: ")
    text = invoke("recommend", sweep)
    assert "sequences a step" in text.stdout


def test_a_table_of_tuned_points_gets_a_batch_size_and_no_made_up_rate(tmp_path):
    """Steps-to-target rows without learning rates (each already tuned): the batch size is
    the answer; the learning rate is said to be the user's own, never a NaN called a fit."""
    rows = [(b, t, s_min * (1 + b_crit / b)) for t, s_min, b_crit in ((2.0, 100.0, 40.0),
                                                                     (1.5, 200.0, 64.0))
            for b in (8, 16, 32, 64, 128, 256, 512)]
    table = tmp_path / "steps.csv"
    pd.DataFrame(rows, columns=["batch_size", "target", "steps"]).to_csv(table, index=False)
    assert invoke("analyze", "--table", table, "--out", tmp_path / "out").exit_code == 0
    data = json.loads(invoke("recommend", tmp_path / "out", "--json").stdout)
    # Exact hyperbolas: B = B_crit at the hardest target, 2 S_min steps (eq. 2.11).
    assert data["status"] == "fit" and data["target"] == 1.5
    assert data["batch_size"] == 64 and data["steps"] == pytest.approx(400)
    assert data["learning_rate"] is None and data["lr_status"] == "not_measured"
    assert data["launch"] == "sweep.batch_sizes=[64]"
