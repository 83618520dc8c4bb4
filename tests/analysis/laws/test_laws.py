"""`gnsweep laws` from the command line: the tables it reads (fixed budget, steps to target by
model size), the files and the JSON contract it writes, its one-line errors, and the cell
optimum's edges. Ground truth: losses and steps built from known optima and known B_crit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from gnsweep.analysis.laws.cells import CellRefused, cell_optimum, configuration_table
from gnsweep.analysis.laws.family import fixed_budget_laws
from gnsweep.cli import app

CELL_KEYS = {"N", "D", "batch_size", "learning_rate", "loss", "edge"}
PREDICTION_KEYS = {"N", "D", "batch_size", "batch_size_low", "batch_size_high", "learning_rate",
                   "learning_rate_low", "learning_rate_high", "extrapolation"}


def _fixed_budget(path: Path, rng: np.random.Generator) -> Path:
    """B_opt = 0.5 D^0.5, lr_opt = 2 N^-0.5 D^0.2 exactly, a bowl in (log B, log lr)."""
    rows = []
    for n in (1e6, 4e6, 16e6):
        for d in (1e8, 4e8, 16e8):
            b_opt, lr_opt = 0.5 * d ** 0.5, 2 * n ** -0.5 * d ** 0.2
            for b in 2.0 ** np.arange(10, 18):
                for lr in lr_opt * 2.0 ** np.arange(-3.3, 3, 1):
                    u, v = math.log(b / b_opt), math.log(lr / lr_opt)
                    noise = 1 + 5e-4 * rng.standard_normal()
                    loss = 3 * (1 + 0.01 * u * u + 0.02 * v * v) * noise
                    rows.append({"N": n, "D": d, "batch_size": b, "learning_rate": lr,
                                 "loss": loss, "seed": 0})
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def _invoke(*args: object):
    return CliRunner().invoke(app, ["laws", *(str(a) for a in args)])


def test_fixed_budget_table_writes_the_contract(tmp_path):
    table = _fixed_budget(tmp_path / "grid.csv", np.random.default_rng(0))
    out = tmp_path / "out"
    result = _invoke("--table", table, "--out", out, "--predict", "N=1e8,D=1e10,M=6e8",
                     "--bootstrap", "60", "--tolerance", "0.005", "--json")
    assert result.exit_code == 0, result.output
    assert (out / "laws.parquet").is_file() and (out / "laws_fits.png").is_file()
    assert "data:image/png;base64" in (out / "laws.html").read_text()
    data = json.loads((out / "laws.json").read_text())
    assert {law["quantity"] for law in data["laws"]} == {"batch_size", "learning_rate", "b_crit"}
    forms = {law["quantity"]: law["form"] for law in data["laws"]}
    # B_opt = 0.5 D^0.5 has no N: the form the data determine leaves N out; lr_opt keeps both.
    assert forms["batch_size"] == "c * D^b" and forms["learning_rate"] == "c * N^a * D^b"
    for law in data["laws"]:
        names = {"c"} | {"a" for v in ("N^a",) if v in law["form"]} | {
            "b" for v in ("D^b",) if v in law["form"]}
        assert set(law["coefficients"]) == names
        assert law["form_reason"]
        for coef in law["coefficients"].values():
            assert set(coef) >= {"value", "low", "high"}
            assert coef["low"] <= coef["value"] <= coef["high"]
        assert set(law["held_out"]) >= {"N", "D", "predicted", "measured"}
        assert (law["held_out"]["N"], law["held_out"]["D"]) == (16e6, 16e8)
    assert len(data["cells"]) == 9
    assert all(set(cell) >= CELL_KEYS and cell["edge"] is False for cell in data["cells"])
    prediction = data["prediction"]
    assert set(prediction) >= PREDICTION_KEYS
    assert prediction["extrapolation"] == pytest.approx(1e10 / 16e8)
    # DeepSeek LLM's law at C = M D (eq. 1), given the FLOPs a token: a reference only.
    refs = prediction["references"]
    assert refs["deepseek_batch_size"] == pytest.approx(0.2920 * (6e8 * 1e10) ** 0.3271)
    assert refs["deepseek_learning_rate"] == pytest.approx(0.3118 * (6e8 * 1e10) ** -0.125)
    assert prediction["batch_size_low"] <= 0.5 * 1e10 ** 0.5 <= prediction["batch_size_high"]
    true_lr = 2 * 1e8 ** -0.5 * 1e10 ** 0.2
    assert prediction["learning_rate_low"] <= true_lr <= prediction["learning_rate_high"]
    table_rows = pd.read_parquet(out / "laws.parquet")
    assert list(table_rows["quantity"]) == ["batch_size", "learning_rate", "b_crit"]


def test_steps_table_by_model_size_fits_bcrit_against_n(tmp_path):
    """Steps to target from eq. 2.11 with B_crit = 40 N^0.3 (no D, no target column)."""
    rng = np.random.default_rng(3)
    rows = []
    for n in (1e5, 1e6, 1e7, 1e8):
        s_min = 200.0
        e_min = s_min * 40 * n ** 0.3
        for b in 2.0 ** np.arange(4, 15):
            for lr, slower in ((0.1, 1.0), (0.2, 1.3)):
                steps = (s_min + e_min / b) * slower * math.exp(0.02 * rng.standard_normal())
                rows.append({"model": f"m{n:g}", "N": n, "batch_size": b, "steps": steps,
                             "learning_rate": lr})
    table = tmp_path / "steps.csv"
    pd.DataFrame(rows).to_csv(table, index=False)
    out = tmp_path / "out"
    result = _invoke("--table", table, "--out", out, "--bootstrap", "60")
    assert result.exit_code == 0, result.output
    data = json.loads((out / "laws.json").read_text())
    (law,) = data["laws"]
    assert law["quantity"] == "b_crit" and law["form"] == "c * N^a"
    a = law["coefficients"]["a"]
    assert a["low"] <= 0.3 <= a["high"]
    held = law["held_out"]
    assert held["N"] == 1e8 and abs(held["predicted"] / (40 * 1e8 ** 0.3) - 1) < 0.2
    assert "B_crit (target 1) = c * N^a" in result.output


@pytest.mark.parametrize(("args", "reason"), [
    (["--predict", "N=1e8"], "D missing"),
    (["--predict", "N=1e8,D=x"], "D=x is not a number"),
    (["--tolerance", "2"], "--tolerance 2"),
    (["--predict", "N=1e8,D=1e9,N=5"], "N given twice"),
])
def test_bad_options_fail_in_one_line(tmp_path, args, reason):
    table = _fixed_budget(tmp_path / "grid.csv", np.random.default_rng(0))
    result = _invoke("--table", table, "--out", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert reason in result.output.strip().splitlines()[-1]
    assert not (tmp_path / "out" / "laws.json").exists()


def test_bad_tables_fail_in_one_line(tmp_path):
    missing = tmp_path / "missing.csv"
    pd.DataFrame({"N": [1.0], "batch_size": [8], "learning_rate": [0.1], "loss": [1.0]}).to_csv(
        missing, index=False)
    bad = tmp_path / "bad.csv"
    pd.DataFrame({"N": [1.0, -2.0], "D": [1.0, 1.0], "batch_size": [8, 8],
                  "learning_rate": [0.1, 0.2], "loss": [1.0, 1.0]}).to_csv(bad, index=False)
    for path, reason in ((missing, "missing column(s) D"), (bad, "column 'N': -2.0 must be > 0"),
                         (tmp_path / "nope.csv", "no such file")):
        result = _invoke("--table", path, "--out", tmp_path / "out")
        assert result.exit_code == 2, result.output
        line = result.output.strip().splitlines()[-1]
        assert line.startswith("gnsweep: error:") and reason in line, line
    result = _invoke("--out", tmp_path / "out")
    assert result.exit_code == 2 and "--table FILE" in result.output


def test_cell_optimum_inside_and_on_edges():
    b, lr = np.meshgrid(2.0 ** np.arange(0, 7), 0.1 * 2.0 ** np.arange(-3, 4), indexing="ij")
    b, lr = b.ravel(), lr.ravel()

    def bowl(b_opt: float, lr_opt: float) -> np.ndarray:
        return 2 + 0.05 * np.log(b / b_opt) ** 2 + 0.08 * np.log(lr / lr_opt) ** 2

    inside = cell_optimum(b, lr, bowl(6.0, 0.13), tolerance=0.002, bootstrap=0)
    assert not inside.edge and inside.method == "quadratic"
    # An exact quadratic in (log B, log lr): its minimum is found between grid points.
    assert inside.batch_size == pytest.approx(6.0, rel=1e-6)
    assert inside.learning_rate == pytest.approx(0.13, rel=1e-6)
    low_batch = cell_optimum(b, lr, bowl(0.3, 0.13), tolerance=0.002, bootstrap=0)
    assert low_batch.edge and "smallest batch size 1" in low_batch.edge_reason
    high_lr = cell_optimum(b, lr, bowl(6.0, 5.0), tolerance=0.002, bootstrap=0)
    assert high_lr.edge and "largest learning rate" in high_lr.edge_reason
    # A larger learning rate that diverged brackets the optimum: not an edge.
    diverged = bowl(6.0, 0.7)
    diverged[lr > 0.7] = np.inf
    bracketed = cell_optimum(b, lr, diverged, tolerance=0.002, bootstrap=0)
    assert not bracketed.edge and bracketed.n_diverged == 7  # lr 0.8 at each batch size
    # A neighbour near divergence (40x the loss) is another regime: left out of the local
    # model, which would otherwise be bent far below every run's loss.
    steep = bowl(6.0, 0.13)
    steep[(lr == 0.2) & (b == 8)] *= 40
    located = cell_optimum(b, lr, steep, tolerance=0.002, bootstrap=0)
    assert not located.edge and located.loss >= 2.0 - 1e-9
    assert located.batch_size == pytest.approx(6.0, rel=0.05)


ZHANG_N = (85e6, 151e6, 302e6, 604e6, 1.2e9)
"""Zhang et al. 2024's five model sizes, each with B_crit at its own (Chinchilla) target:
2191, 3240, 5433, 7907, 11131 sequences, which B_crit = 0.0282 N^0.619 follows within 8%."""


def _zhang_shaped(path: Path, rng: np.random.Generator) -> Path:
    """Steps to target from eq. 2.11 for five models, each at its own target loss
    L = 12 N^-0.1 (so B_crit = 0.0282 N^0.619 is exactly B* L^g with g = -6.19), two learning
    rates, 1% noise on the steps."""
    rows = []
    for n in ZHANG_N:
        b_crit = 0.0282 * n ** 0.619
        s_min, target = 2000.0, 12 * n ** -0.1
        for b in 2.0 ** np.arange(8, 17):
            for lr, slower in ((3e-4, 1.0), (6e-4, 1.2)):
                steps = (s_min + s_min * b_crit / b) * slower * math.exp(
                    0.01 * rng.standard_normal())
                rows.append({"N": n, "D": 20 * n, "target": target, "batch_size": b,
                             "steps": steps, "learning_rate": lr})
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_models_each_at_their_own_target_fit_a_bcrit_law(tmp_path):
    """Each model at its own target: one cell per target, yet a B_crit law across models,
    against N and against the target loss (Kaplan's B_crit(L) = B* / L^(1/alpha_B)), with the
    largest model held out and predicted within a factor 1.5."""
    table = _zhang_shaped(tmp_path / "zhang.csv", np.random.default_rng(4))
    out = tmp_path / "out"
    result = _invoke("--table", table, "--out", out, "--bootstrap", "100",
                     "--predict", "N=2.4e9,D=4.8e10")
    assert result.exit_code == 0, result.output
    data = json.loads((out / "laws.json").read_text())
    by_form = {law["form"]: law for law in data["laws"]}
    assert set(by_form) == {"c * N^a", "c * L^g"}, data["refused"]
    truth = {"c * N^a": ("a", 0.619), "c * L^g": ("g", -6.19)}
    for form, (name, value) in truth.items():
        law = by_form[form]
        assert law["scope"] == "each model at its own target" and law["n_points"] == 5
        coef = law["coefficients"][name]
        assert coef["low"] <= value <= coef["high"], (form, coef)
        held = law["held_out"]
        assert held["N"] == 1.2e9
        assert 1 / 1.5 < held["predicted"] / (0.0282 * 1.2e9 ** 0.619) < 1.5, held
    alpha = by_form["c * L^g"]["alpha_B"]
    assert alpha["low"] <= 1 / 6.19 <= alpha["high"]
    assert data["prediction"]["b_crit"] == pytest.approx(0.0282 * 2.4e9 ** 0.619, rel=0.2)
    assert "alpha_B" in result.output and "each model at its own target" in result.output


def test_negative_losses_are_compared_by_differences(tmp_path):
    """A loss below zero (a negative log-likelihood, a -ELBO) is still a number to minimise:
    the same grid shifted below zero locates the same optima."""
    rng = np.random.default_rng(0)
    positive = pd.read_csv(_fixed_budget(tmp_path / "grid.csv", rng))
    positive = positive[positive["N"] == 1e6]  # three cells: enough for a law
    negative = positive.assign(loss=positive["loss"] - 10.0)
    negative.to_csv(tmp_path / "negative.csv", index=False)
    result = _invoke("--table", tmp_path / "negative.csv", "--out", tmp_path / "out",
                     "--bootstrap", "20", "--tolerance", "0.005")
    assert result.exit_code == 0, result.output
    cells = json.loads((tmp_path / "out" / "laws.json").read_text())["cells"]
    assert len(cells) == 3 and not any(cell["edge"] for cell in cells)
    for cell in cells:
        assert cell["best_loss"] < 0
        assert cell["batch_size"] == pytest.approx(0.5 * cell["D"] ** 0.5, rel=0.1)
    # A best loss of exactly 0 has no scale for a relative tolerance: refused, said why.
    one = positive[positive["D"] == 1e8]
    with pytest.raises(CellRefused, match="best loss is exactly 0"):
        cell_optimum(one["batch_size"].to_numpy(), one["learning_rate"].to_numpy(),
                     (one["loss"] - one["loss"].min()).to_numpy(), tolerance=0.005)


def test_repeated_configurations_are_averaged_with_their_spread():
    """Seeds of one configuration: their mean and standard deviation, in any row order; a
    diverged seed makes the configuration diverged."""
    rng = np.random.default_rng(1)
    rows = [(b, lr, 2.0 + 0.1 * b + lr + 0.01 * k) for b in (8.0, 16.0) for lr in (0.1, 0.2)
            for k in range(5)]
    rows.append((32.0, 0.1, 1.0))
    rows += [(32.0, 0.2, 1.0), (32.0, 0.2, math.inf)]
    order = rng.permutation(len(rows))
    b, lr, loss = (np.array([rows[i][j] for i in order]) for j in range(3))
    sizes, rates, mean, seeds, spread = configuration_table(b, lr, loss)
    assert list(zip(sizes, rates, strict=True))[:4] == [(8, 0.1), (8, 0.2), (16, 0.1), (16, 0.2)]
    expected = [2.0 + 0.1 * s + r + 0.02 for s, r in zip(sizes[:4], rates[:4], strict=True)]
    assert mean[:4] == pytest.approx(expected)
    assert spread[:4] == pytest.approx([np.std([0.01 * k for k in range(5)], ddof=1)] * 4)
    assert list(seeds) == [5, 5, 5, 5, 1, 2]
    assert mean[4] == 1.0 and math.isnan(spread[4])
    assert mean[5] == math.inf



def test_a_tolerance_below_the_seed_noise_is_said():
    """Two seeds a configuration, each loss with 1% noise: a configuration's mean is known to
    about 0.7%, far above half of Step Law's 0.25%; the laws say so and report the spread."""
    rng = np.random.default_rng(2)
    b, lr = np.meshgrid(2.0 ** np.arange(0, 7), 0.1 * 2.0 ** np.arange(-3, 4), indexing="ij")
    b, lr = np.repeat(b.ravel(), 2), np.repeat(lr.ravel(), 2)
    loss = (2 + 0.05 * np.log(b / 6.0) ** 2 + 0.08 * np.log(lr / 0.13) ** 2) * (
        1 + 0.01 * rng.standard_normal(len(b)))
    runs = pd.DataFrame({"N": 1.0, "D": 1.0, "batch_size": b, "learning_rate": lr,
                         "loss": loss})
    result = fixed_budget_laws(runs, bootstrap=0)
    assert result.tolerance == 0.0025 and "Step Law" in result.tolerance_source
    (cell,) = result.cells.itertuples()
    assert cell.seeds == 2 and 0.004 < cell.seed_sd / 2 < 0.015  # about 1% of a loss of 2
    assert any("above half the tolerance" in w for w in result.warnings)
    quiet = fixed_budget_laws(runs, tolerance=0.05, bootstrap=0)
    assert quiet.tolerance_source == "given (--tolerance)"
    assert not any("above half the tolerance" in w for w in quiet.warnings)


def test_a_located_optimum_whose_near_set_reaches_an_edge_is_used_with_a_wider_interval():
    """A minimum inside the grid (B = 3 on 1...64) in a valley so shallow in B that the
    near-optimal set reaches the smallest batch size: the cell is used (not an edge), its
    optimum found, and its interval widened down to that batch size."""
    b, lr = np.meshgrid(2.0 ** np.arange(0, 7), 0.1 * 2.0 ** np.arange(-3, 4), indexing="ij")
    b, lr = b.ravel(), lr.ravel()
    loss = 2 + 0.002 * np.log(b / 3.0) ** 2 + 0.08 * np.log(lr / 0.13) ** 2
    cell = cell_optimum(b, lr, loss, tolerance=0.0025, bootstrap=50)
    assert not cell.edge and cell.method == "quadratic"
    assert cell.near_batch_low == 1.0 and "smallest batch size 1" in cell.widened
    assert cell.batch_size == pytest.approx(3.0, rel=1e-6)
    assert cell.batch_size_low == 1.0 <= cell.batch_size <= cell.batch_size_high
    assert np.exp(cell.draws[:, 0]).min() < 1.5  # the law's draws carry the wider interval


def test_a_law_whose_cells_determine_no_exponent_is_refused():
    """B_opt = 3000 at every budget (truth: no scaling), lr_opt = 2e-3 (D / 1e8)^0.2: the
    learning rate's law keeps D; the batch size's finds no exponent and is refused, saying
    why, instead of a constant fitted through the cells. (The four cells' landscapes are the
    same but for their noise: on 5 of 6 noise seeds tried the exponent is left out.)"""
    rng = np.random.default_rng(0)
    rows = []
    for d in (1e8, 2e8, 4e8, 8e8):
        lr_opt = 2e-3 * (d / 1e8) ** 0.2
        for b in 2.0 ** np.arange(8, 16):
            for lr in lr_opt * 2.0 ** np.arange(-3.3, 3, 1):
                u, v = math.log(b / 3000), math.log(lr / lr_opt)
                loss = 3 * (1 + 0.01 * u * u + 0.02 * v * v) * (1 + 3e-4 * rng.standard_normal())
                rows.append((1e6, d, b, lr, loss))
    runs = pd.DataFrame(rows, columns=["N", "D", "batch_size", "learning_rate", "loss"])
    result = fixed_budget_laws(runs, tolerance=0.005, bootstrap=100)
    assert not result.cells["edge"].any()
    law = result.law("learning_rate")
    assert law is not None and law.law.form == "c * D^b"
    (refused,) = [r for r in result.refused if r["quantity"] == "batch_size"]
    assert "determine no exponent" in refused["reason"] and "D left out" in refused["reason"]
