"""The whole pipeline against the exact SGD dynamics of linreg (issue 9): a real sweep of
`+experiment=linreg_truth` through `gnsweep launch` and `gnsweep analyze`, checked against
`gnsweep.linreg_exact` (the expected loss of every (B, lr) by an exact recursion, docs/truth.md)
and against the exact noise scales the task logs along the same runs.

Ground truth comes from mathematics: B_crit from the hyperbola fit of the exact expected steps
S(B) at each batch size's best learning rate, and B_simple/B_noise from the closed-form
tr(Sigma)/|G|^2 and tr(H Sigma)/G^T H G at every step's parameters.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from gnsweep.folder import read_config
from gnsweep.linreg_exact import exact_truth
from gnsweep.tasks import make_task

# Its tests share one sweep: on one xdist worker (the group), trained once per session (scope
# "session", not "module": a worker that runs another module's test between two of these would
# otherwise tear the module's sweep down and train it again).
pytestmark = pytest.mark.xdist_group("truth_end_to_end")



def _gnsweep(*args: str) -> None:
    """A gnsweep command through the CLI in this process (a launch's workers forked from it,
    one torch thread each as the session's): no interpreter started for each command."""
    from typer.testing import CliRunner

    from gnsweep.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="session")
def sweep(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("truth") / "sweep"
    _gnsweep("launch", "-q", "+experiment=linreg_truth", "--sweep-dir", str(where))
    _gnsweep("analyze", str(where))
    _gnsweep("analyze", str(where), "--loss", "eval", "--out", str(where / "eval"))
    return where


@pytest.fixture(scope="session")
def exact(sweep):
    config = read_config(sweep)
    task = make_task(config.task.name, config.task.options, 0)
    truth = exact_truth(task.exact_problem(), config.sweep.batch_sizes, config.sweep.targets,
                        limits=False)
    return {t.target: t for t in truth.per_target}


@pytest.mark.slow
def test_public_contract_columns(sweep):
    for folder in (sweep, sweep / "eval"):
        fits = pd.read_parquet(folder / "fits.parquet")
        for column in ("b_crit", "b_simple_mean", "b_noise_mean", "b_simple_true_mean",
                       "b_noise_true_mean", "b_crit_window_lo", "b_crit_window_hi",
                       "b_crit_window_spread"):
            assert column in fits


@pytest.mark.slow
def test_regime_is_realistic(sweep, exact):
    """S_min at the hardest target >= ~30 steps; B_crit well inside the 4..256 grid."""
    fits = pd.read_parquet(sweep / "fits.parquet").set_index("target")
    assert fits["s_min"].min() > 25
    for target, truth in exact.items():
        assert 8 <= truth.b_crit_fit <= 128
        assert fits.loc[target, "b_crit"] == pytest.approx(truth.b_crit_fit, rel=0.3)


@pytest.mark.slow
def test_b_crit_within_30_percent_of_the_exact_dynamics(sweep, exact):
    for folder in (sweep, sweep / "eval"):
        fits = pd.read_parquet(folder / "fits.parquet").set_index("target")
        for target, truth in exact.items():
            assert fits.loc[target, "b_crit"] == pytest.approx(truth.b_crit_fit, rel=0.3), \
                (folder, target)


@pytest.mark.slow
def test_measured_noise_scales_within_25_percent_of_the_exact_ones(sweep, exact):
    """Measured S_min-weighted means against the same runs' exact values; B_crit within 2x of
    the exact S_min-weighted B_noise of the expected dynamics."""
    fits = pd.read_parquet(sweep / "fits.parquet").set_index("target")
    for target, truth in exact.items():
        row = fits.loc[target]
        assert math.isfinite(row.b_simple_true_mean) and math.isfinite(row.b_noise_true_mean)
        assert row.b_simple_mean == pytest.approx(row.b_simple_true_mean, rel=0.25), target
        assert row.b_noise_mean == pytest.approx(row.b_noise_true_mean, rel=0.25), target
        assert 0.5 <= row.b_crit / truth.b_noise_mean <= 2.0, target
