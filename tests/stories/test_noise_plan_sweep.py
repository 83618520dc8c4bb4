"""noise.runs=auto on a real sweep: only the planned runs measure, the plan is recorded before
any run starts and survives a relaunch, and the sweep's B_simple stays within its stated error
of the closed-form noise scale of linreg (the same runs' exact tr(Sigma)/|G|^2 at every step,
`gnsweep.linreg_exact`, docs/truth.md)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from gnsweep import paths
from gnsweep.cli import app

# One launch of the module's sweep, on one worker: xdist builds a module fixture once per
# worker that runs one of its tests.
pytestmark = pytest.mark.xdist_group("noise_plan_sweep")

GRID = ["+experiment=linreg_truth", "sweep.batch_sizes=[8,32,128]",
        "sweep.targets=[0.5,0.25]", "noise.probe_per_octave=0", "sweep.eval_every=0",
        "sweep.max_steps=600"]
RATES = "sweep.learning_rates=[0.283,0.566,1.13]"


def _gnsweep(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("noiseplan") / "sweep"
    _gnsweep("launch", *GRID, RATES, "--sweep-dir", str(where), "--workers", "2", "--quiet")
    _gnsweep("analyze", str(where))
    return where


def _plan(where: Path) -> dict[str, dict[str, str]]:
    return json.loads((where / paths.NOISE_PLAN).read_text())["runs"]


@pytest.mark.slow
def test_only_the_planned_runs_measure(sweep):
    plan = _plan(sweep)
    assert len(plan) == 9
    # The guess rises with the batch size (eq. 2.7): 0.4 at batch 8 (0.283 and 0.566 tie),
    # 0.566 at 32 and 0.8 at 128 (0.566 and 1.13 tie there); ties go to the larger rate.
    measuring = sorted(r for r, a in plan.items() if a["role"] != "off")
    assert measuring == sorted(f"b{b:05d}_lr{lr}_s0" for b, lr in (
        (8, "0.283"), (8, "0.566"), (32, "0.566"), (32, "1.13"), (128, "0.566"), (128, "1.13")))
    assert all(a.get("pooled") == 3 for a in plan.values() if a["role"] != "off")
    for run_id, part in plan.items():
        status = json.loads((sweep / "runs" / run_id / "status.json").read_text())
        b_simple = pd.read_parquet(sweep / "runs" / run_id / "metrics.parquet")["b_simple"]
        if part["role"] == "off":
            assert status["noise_measured"]["method"] == "none"
            assert status["noise_measured"]["measured"] == 0
            assert b_simple.isna().all()
        else:
            assert status["noise_measured"]["measured"] > 0
            assert math.isfinite(b_simple.iloc[-1])


@pytest.mark.slow
def test_b_simple_within_its_stated_error_of_the_exact_noise_scale(sweep):
    """The sweep's B_simple (median over batch sizes of each best rate's, or its nearest
    measured rate's) against the exact B_simple of the same runs, both S_min-weighted means up
    to the target (eq. 2.9 at every step's parameters): within two of its standard errors or
    25%, and each batch size's within 25%."""
    fits = pd.read_parquet(sweep / "fits.parquet")
    assert len(fits) == 2
    for row in fits.itertuples(index=False):
        assert math.isfinite(row.b_simple_mean_se) and row.b_simple_mean_se > 0
        assert math.isfinite(row.b_simple_at_target) and row.b_simple_at_target_se > 0
        error = abs(row.b_simple_mean - row.b_simple_true_mean)
        assert error <= max(2 * row.b_simple_mean_se, 0.25 * row.b_simple_true_mean), row
    front = pd.read_parquet(sweep / "front.parquet")
    assert front["b_simple_lr"].notna().all()
    for row in front.itertuples(index=False):
        assert row.b_simple_mean == pytest.approx(row.b_simple_true_mean, rel=0.25), row


@pytest.mark.slow
def test_the_plan_survives_a_relaunch_and_plans_only_new_runs(sweep, tmp_path):
    # On a copy: the module's other tests read the sweep as first launched, in any order.
    sweep = Path(shutil.copytree(sweep, tmp_path / "sweep"))
    before = (sweep / paths.NOISE_PLAN).read_bytes()
    _gnsweep("launch", *GRID, RATES, "--sweep-dir", str(sweep), "--quiet")
    assert (sweep / paths.NOISE_PLAN).read_bytes() == before
    output = _gnsweep("status", str(sweep))
    assert "6 of 9 runs measure" in output and "3 off" in output
    # A relaunch that adds a rate: the old runs keep their parts; the new ones are planned
    # against the best rates the finished runs show (0.566 at batch 8, 1.13 at 32 and 128),
    # 0.8 being nearest after them.
    old = _plan(sweep)
    _gnsweep("launch", *GRID, "sweep.learning_rates=[0.283,0.566,0.8,1.13]", "--sweep-dir",
             str(sweep), "--workers", "2", "--quiet")
    new = _plan(sweep)
    assert {k: new[k] for k in old} == old
    added = {k: v for k, v in new.items() if k not in old}
    assert sorted(added) == [f"b{b:05d}_lr0.8_s0" for b in (8, 32, 128)]
    for part in added.values():
        assert part["role"] == "dense" and "best learning rate so far" in part["why"]
