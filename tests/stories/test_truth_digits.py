"""Digits as the second oracle (issue 9, item 6): the training set is small enough for exact
truth. Per-example gradients over every training example give the exact B_simple of the
distribution SGD samples from (uniform over the training set), and the loss over the whole
training set gives steps-to-target free of sampling noise and smoothing; the measured values
of a real sweep are checked against both."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from gnsweep.measure import measure_noise_scale
from gnsweep.tasks import make_task

# Its tests share one module-scoped sweep: on one xdist worker it is trained once, not twice.
pytestmark = pytest.mark.xdist_group("truth_digits")



def test_exact_b_simple_is_the_training_sets_gradient_spread():
    """tr(Sigma)/|G|^2 over the training set from torch.func per-example gradients equals the
    one from the monitor's per-example hooks on the whole set as one batch (b_small 1, b_big N:
    |G|^2 = |G_N|^2 and tr(Sigma) = mean |g_i|^2 - |G|^2 exactly, sampling with replacement)."""
    task = make_task("digits", {"exact_truth": True, "hidden": 16}, 0)
    model = task.model()
    truth = task.truth(model)
    est = measure_noise_scale(model, task.output_loss, [(task.x, task.y)])
    exact = (est.sq_norm_small - est.sq_norm_big) / est.sq_norm_big
    assert truth.b_simple == pytest.approx(exact, rel=1e-5)
    with torch.no_grad():
        whole = float(task.output_loss(model(task.x), task.y))
    assert truth.loss == pytest.approx(whole, rel=1e-6)
    assert math.isnan(truth.b_noise)


@pytest.fixture(scope="session")
def sweep(tmp_path_factory) -> Path:
    from typer.testing import CliRunner

    from gnsweep.cli import app

    # Through the CLI in this process (its workers forked from it, one torch thread each as the
    # session's), as conftest's tiny sweep: no interpreter started for each command.
    where = tmp_path_factory.mktemp("digits_truth") / "sweep"
    for args in (["launch", "-q", "sweep=tiny", "task.exact_truth=true", "sweep.eval_every=1",
                  "--sweep-dir", str(where)],
                 ["analyze", str(where)],
                 ["analyze", str(where), "--loss", "eval", "--out", str(where / "whole")]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    return where


@pytest.mark.slow
def test_digits_sweep_against_the_training_set_truth(sweep):
    """Measured S_min-weighted B_simple within 25% of the exact one along the same runs; B_crit
    from the smoothed training loss within 50% of B_crit from the whole training set's loss
    (3 batch sizes only: the tiny grid's B_crit moves 10-40% between smoothing windows)."""
    fits = pd.read_parquet(sweep / "fits.parquet").set_index("target")
    whole = pd.read_parquet(sweep / "whole" / "fits.parquet").set_index("target")
    for target, row in fits.iterrows():
        assert row.b_simple_mean == pytest.approx(row.b_simple_true_mean, rel=0.25), target
        assert row.b_crit == pytest.approx(whole.loc[target, "b_crit"], rel=0.5), target
