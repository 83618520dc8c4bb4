"""A fit is an answer only where the grid supports it: bounds and refusals with their reasons,
front and late points, censored batch sizes, the learning-rate and B_crit(L) fits' ranges.

Ground truth: steps drawn from known hyperbolas S = S_min + E_min/B (eq. 2.11) and from the
perfectly-scaling regime S = E/B, whose B_crit the sweep cannot see (it is above the grid).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from gnsweep.analysis.bounds import LOWER_BOUND, STATUSES, UPPER_BOUND, judge_scale
from gnsweep.analysis.fit import fit_hyperbola
from gnsweep.analysis.front import LATE, OFF_FRONT
from gnsweep.analysis.loss_scaling import fit_loss_scaling
from gnsweep.analysis.lr import fit_lr, fit_lr_table
from gnsweep.analysis.pipeline import analyze_steps

S_MIN, B_CRIT = 60.0, 3780.0
E_MIN = S_MIN * B_CRIT
BATCHES = [256, 512, 1024, 2048, 4096]
LRS = (0.5e-3, 1e-3, 2e-3)


def steps_table(points: dict[int, tuple[float, float, float]], target: float = 2.2,
                reached: bool = True) -> pd.DataFrame:
    """steps.parquet rows: for each batch size (steps at its best lr, last logged step, lr share
    at the target), three learning rates, the middle one best (the others 25% slower)."""
    rows = []
    for b, (steps, last, lr_share) in points.items():
        for lr in LRS:
            s = steps * (1.0 if lr == LRS[1] else 1.25)
            rows.append(dict(run_id=f"b{b}_lr{lr:g}", batch_size=b, learning_rate=lr, seed=0,
                             target=target, state="done", reached=reached,
                             steps=s if reached else math.nan,
                             examples=s * b if reached else math.nan,
                             b_simple_at_target=math.nan, b_simple_mean=math.nan,
                             outcome="reached" if reached else "not_reached",
                             min_loss=target, last_step=last, lr_share=lr_share))
    return pd.DataFrame(rows)


def hyperbola_points(seed: int = 0, sigma: float = 0.03) -> dict[int, tuple[float, float, float]]:
    rng = np.random.default_rng(seed)
    return {b: ((S_MIN + E_MIN / b) * math.exp(sigma * rng.standard_normal()),
                3.0 * (S_MIN + E_MIN / b), 0.8) for b in BATCHES}


def fit_row(steps: pd.DataFrame, target: float = 2.2) -> pd.Series:
    return analyze_steps(steps, [target]).fits.iloc[0]


def test_an_off_front_point_reached_late_does_not_move_b_crit():
    # The sweep's B=8192 reached the target 110 steps into a 123-step budget, its cosine
    # decayed to 5% of the peak, needing more steps than B=4096: off the front, and late.
    clean = hyperbola_points()
    alone = fit_row(steps_table(clean))
    late_off = {**clean, 8192: (1.3 * clean[4096][0], 1.3 * clean[4096][0] / 0.89, 0.05)}
    result = analyze_steps(steps_table(late_off), [2.2])
    with_point = result.fits.iloc[0]
    assert alone["bcrit_status"] == with_point["bcrit_status"] == "fit"
    assert abs(alone["b_crit"] - B_CRIT) < 2 * alone["b_crit_se"]
    assert with_point["b_crit"] == pytest.approx(alone["b_crit"], rel=1e-9)
    row = result.front[result.front["batch_size"] == 8192].iloc[0]
    assert not row["in_fit"] and row["left_out"] == OFF_FRONT and row["late"]
    assert with_point["n_left_out"] == 1 and with_point["n_batch_sizes"] == len(BATCHES)


def test_a_late_point_on_the_front_is_left_out_and_named():
    # Annealed: reached in 80% of the hyperbola's steps, with the schedule at 5% of its peak.
    clean = hyperbola_points(seed=1)
    alone = fit_row(steps_table(clean))
    annealed = 0.8 * (S_MIN + E_MIN / 8192)
    result = analyze_steps(steps_table({**clean, 8192: (annealed, 3 * annealed, 0.05)}), [2.2])
    row = result.front[result.front["batch_size"] == 8192].iloc[0]
    assert row["on_front"] and row["late"] and not row["in_fit"] and row["left_out"] == LATE
    assert result.fits.iloc[0]["b_crit"] == pytest.approx(alone["b_crit"], rel=1e-9)
    # Late by budget alone: reached after 90% of the run's logged steps.
    result = analyze_steps(steps_table({**clean, 8192: (annealed, annealed / 0.9, 0.9)}), [2.2])
    assert not result.front[result.front["batch_size"] == 8192].iloc[0]["in_fit"]


def test_late_points_stay_when_the_fit_would_lose_them_and_say_so():
    points = {b: (S_MIN + E_MIN / b, 1.05 * (S_MIN + E_MIN / b), 0.8) for b in BATCHES[:3]}
    fit = fit_row(steps_table(points))
    assert fit["bcrit_status"] != "refused" or "3" not in fit["refused"]
    assert "reached late" in fit["quality"]


def test_batch_sizes_that_did_not_reach_it_inform_the_fit_as_bounds():
    steps = pd.concat([steps_table(hyperbola_points()),
                       steps_table({8192: (math.nan, 200.0, math.nan)}, reached=False)])
    result = analyze_steps(steps.reset_index(drop=True), [2.2])
    fit = result.fits.iloc[0]
    assert "8192 (> 200 steps)" in fit["censored"]
    # The hyperbola says 8192 needs 88 steps: it had 200 and did not get there.
    assert "8192 did not reach it in 200 steps" in fit["quality"]
    assert any("8192 did not reach it" in w for w in result.warnings)


def perfectly_scaling(targets: dict[float, float], seed: int = 0) -> pd.DataFrame:
    """Targets a hair below a branch point on linear regression: S = E/B, B_crit far above the
    grid (E the target's examples); 2% noise."""
    rng = np.random.default_rng(seed)
    parts = []
    for target, examples in targets.items():
        points = {b: (examples / b * math.exp(0.02 * rng.standard_normal()), 3 * examples / b,
                      0.8) for b in (64, 128, 256, 512, 1024)}
        parts.append(steps_table(points, target=target))
    return pd.concat(parts, ignore_index=True)


def test_a_b_crit_beyond_the_grid_is_a_lower_bound_never_a_number():
    # Before: B_crit 6.5e14 and 4.3e13 in fits.parquet, B* 3.6e+116 in loss_scaling.parquet.
    result = analyze_steps(perfectly_scaling({0.0095: 3000.0, 0.009: 9000.0}), [0.0095, 0.009])
    for fit in result.fits.itertuples(index=False):
        assert fit.bcrit_status == LOWER_BOUND and fit.b_crit_bound == 1024
        assert math.isnan(fit.b_crit) and math.isnan(fit.b_crit_se)
        assert fit.refused == fit.bcrit_reason and fit.bcrit_reason.startswith("B_crit above 1024")
        assert "e+" not in fit.bcrit_reason
        # E = B S is flat below the bend: E_min is what the points do fix.
        assert 0.5 < fit.e_min / {0.0095: 3000.0, 0.009: 9000.0}[fit.target] < 1.5
    law = result.loss_scaling.iloc[0]
    assert math.isnan(law["b_star"]) and law["refused"]


def test_a_b_crit_below_the_grid_is_an_upper_bound():
    # Every batch size on the plateau: S = S_min whatever B.
    rng = np.random.default_rng(3)
    points = {b: (S_MIN * math.exp(0.02 * rng.standard_normal()), 3 * S_MIN, 0.8)
              for b in BATCHES}
    fit = fit_row(steps_table(points))
    if fit["bcrit_status"] == UPPER_BOUND:
        assert fit["b_crit_bound"] == 256 and fit["refused"].startswith("B_crit below 256")
        assert fit["s_min"] == pytest.approx(S_MIN, rel=0.1)
    else:  # noise may make the plateau's bend unplaceable: refused, never a number
        assert fit["bcrit_status"] == "refused" and fit["refused"]
    assert math.isnan(fit["b_crit"])


def test_judge_scale_reads_the_support_and_the_error():
    assert judge_scale("B", 500.0, 100.0, 100, 1000).fitted
    assert judge_scale("B", 5000.0, 100.0, 100, 1000).fitted  # inside 10x the largest
    above = judge_scale("B", 1e23, 1e30, 100, 1000)
    assert above.status == LOWER_BOUND and above.bound == 1000 and "e+" not in above.reason
    assert judge_scale("B", 1.2e-15, 1.0, 100, 1000).status == UPPER_BOUND
    assert judge_scale("B", 500.0, 600.0, 100, 1000).status == "refused"
    assert judge_scale("B", 2000.0, 3000.0, 100, 1000).status == LOWER_BOUND
    assert judge_scale("B", math.nan, 1.0, 100, 1000).status == "refused"


def test_fit_hyperbola_keeps_the_raw_numbers_and_gives_the_verdict():
    b = np.array([64, 128, 256, 512, 1024], float)
    fit = fit_hyperbola(b, 3000.0 / b * (1 + 0.01 * np.array([1, -1, 1, -1, 1])))
    assert fit.status == LOWER_BOUND and fit.b_crit > 1024 * 10 and fit.b_crit_bound == 1024
    fit = fit_hyperbola(b, S_MIN + E_MIN / b)
    assert fit.status == "fit" and fit.b_crit == pytest.approx(B_CRIT, rel=1e-6)


def test_loss_scaling_refuses_what_overflowed():
    # Two targets a hair apart at small losses with B_crit 1e16 and 1e23: log B* beyond 700
    # made math.exp raise OverflowError, a traceback from `gnsweep analyze`.
    fits = pd.DataFrame({"target": [0.0095, 0.009], "b_crit": [1e16, 1e23],
                         "b_crit_se": [1e15, 1e22], "refused": ["", ""]})
    law = fit_loss_scaling(fits).iloc[0]
    assert law["refused"] and math.isnan(law["b_star"])
    # Bounds never enter the line, whatever their number column holds.
    fits = pd.DataFrame({"target": [3.0, 2.5, 2.0], "b_crit": [100.0, 150.0, 1e9],
                         "b_crit_se": [10.0, 15.0, 1.0], "refused": ["", "", "B_crit above"],
                         "bcrit_status": ["fit", "fit", LOWER_BOUND]})
    law = fit_loss_scaling(fits).iloc[0]
    assert law["n_targets"] == 2 and np.isfinite(law["b_star"])


def test_the_lr_fit_refuses_an_exponent_outside_its_range():
    # Best rates that rise then fall (Adam's surge): the saturating law bends the wrong way;
    # before, alpha -17-like exponents and B_noise +- 1e10 were printed without refusing.
    b = np.array([256, 512, 1024, 2048, 4096, 8192], float)
    lr = np.array([1.0e-3, 1.6e-3, 2.0e-3, 2.1e-3, 1.2e-3, 0.6e-3])
    fit = fit_lr(b, lr, "power")
    assert fit.status != "fit" and fit.reason and "e+" not in fit.reason
    table = fit_lr_table(pd.DataFrame({"target": 2.2, "batch_size": b, "lr_opt": lr,
                                       "lr_on_edge": False}), [2.2])
    for row in table.itertuples(index=False):
        assert row.status in STATUSES
        if row.status != "fit":
            assert row.refused and math.isnan(row.b_noise) and math.isnan(row.alpha)


def test_the_lr_fit_keeps_a_law_it_can_place():
    b = np.array([64, 128, 256, 512, 1024, 2048], float)
    fit = fit_lr(b, 0.1 / (1 + 300.0 / b), "sgd")
    assert fit.status == "fit" and fit.b_noise == pytest.approx(300.0, rel=1e-6)
    fit = fit_lr(b, 0.1 / (1 + (300.0 / b) ** 0.7), "power")
    assert fit.status == "fit" and fit.alpha == pytest.approx(0.7, rel=1e-4)


def test_analyze_table_of_targets_a_hair_apart_answers_with_bounds(tmp_path):
    # `gnsweep analyze --table` on this table died with OverflowError at B* = exp(coef[0]).
    from gnsweep.analysis.external import analyze_table
    from gnsweep.report.console import format_fits

    path = tmp_path / "steps.csv"
    table = perfectly_scaling({0.0095: 3000.0, 0.009: 9000.0})
    table[["batch_size", "learning_rate", "target", "steps"]].to_csv(path, index=False)
    result = analyze_table(path)
    assert list(result.fits["bcrit_status"]) == [LOWER_BOUND, LOWER_BOUND]
    printed = format_fits(result.fits, result.loss_scaling)
    assert "> 1024" in printed and "e+1" not in printed
    assert "2 more only bound it" in result.loss_scaling.iloc[0]["refused"]


def test_lr_share_reads_the_decay_not_the_warmup():
    from gnsweep.analysis.steps import steps_to_target

    step = np.arange(1, 101, dtype=float)
    lr = np.where(step <= 10, step / 10, 0.5 * (1 + np.cos(np.pi * (step - 10) / 90)))
    runs = pd.DataFrame({"run_id": ["r"], "batch_size": [8], "learning_rate": [1.0], "seed": [0],
                         "state": ["done"]})
    metrics = pd.DataFrame({"run_id": "r", "step": step, "examples": 8 * step,
                            "loss": 10.0 - 0.09 * step, "lr": lr})
    out = steps_to_target(metrics, runs, [9.5, 1.5], loss="raw").set_index("target")
    assert math.isnan(out.loc[9.5, "lr_share"])  # reached in the warmup: not a decay
    assert out.loc[1.5, "lr_share"] < 0.1  # 95 of 100 steps into the cosine


def test_a_b_star_known_to_a_factor_is_printed_as_one():
    """Targets close together (3.7..3.5) leave B* = B_crit at L = 1 an extrapolation whose
    log-scale error is large: printed as a factor, never as "7e+07 +- 2.2e+08"."""
    from gnsweep.analysis.loss_scaling import fit_loss_scaling
    from gnsweep.report.console import format_fits

    rng = np.random.default_rng(0)
    targets = np.array([3.7, 3.6, 3.5])
    b_crit = 5000.0 * (targets / 3.6) ** -7.0 * np.exp(rng.normal(0, 0.08, 3))
    from gnsweep.tables import columns

    fits = pd.DataFrame({name: [math.nan] * 3 for name in columns("fits")})
    fits = fits.assign(target=targets, b_crit=b_crit, b_crit_se=0.1 * b_crit, refused="",
                       quality="", bcrit_status="fit", n_batch_sizes=6)
    scaling = fit_loss_scaling(fits)
    row = scaling.iloc[0]
    assert row["refused"] == "" and row["b_star_se"] > row["b_star"]
    line = next(x for x in format_fits(fits, scaling).splitlines() if x.startswith("B_crit(L)"))
    assert "x/÷" in line and "extrapolated to L = 1" in line and "±" not in line.split(",")[0]


def test_the_recipe_summary_counts_warmup_and_decay_in_the_tasks_unit():
    from gnsweep.config import TrainConfig
    from gnsweep.report.html import recipe_words

    recipe = TrainConfig(optimizer="adamw", warmup_examples=4096, decay="cosine",
                         decay_examples=60000, microbatch_size=8)
    assert recipe_words(recipe, "tokens") == ("adamw, warmup 4096 tokens, cosine decay to 0x "
                                              "over 60000 tokens, micro-batches of 8 samples")
    assert "warmup 4096 examples" in recipe_words(recipe)


def test_batch_sizes_that_ran_out_of_steps_hold_the_curve_up_where_points_do_not():
    """Exact hyperbola S_min 100, E_min 1e5 (B_crit 1000), points at 64..512 with 5% noise and
    the largest one lucky: alone they cannot see the bend and B_crit runs off beyond the grid.
    Batch sizes 2048 and 4096 that did not reach the target in exactly the steps the truth needs
    there bound the curve from below, and the fit finds the bend."""
    from gnsweep.analysis.fit import fit_hyperbola, predict_steps

    s_min, e_min = 100.0, 1e5
    b = np.array([64.0, 128.0, 256.0, 512.0])
    steps = (s_min + e_min / b) * np.exp(np.random.default_rng(3).normal(0, 0.05, len(b)))
    steps[-1] *= 0.85
    alone = fit_hyperbola(b, steps)
    assert alone.status == LOWER_BOUND
    ran_out = np.array([2048.0, 4096.0])
    bounded = fit_hyperbola(b, steps, at_least=(ran_out, s_min + e_min / ran_out))
    assert bounded.status == "fit"
    assert abs(bounded.b_crit - 1000.0) < 0.1 * 1000.0
    assert abs(bounded.b_crit - 1000.0) < bounded.b_crit_se
    # The curve now passes (nearly) above the bounds; before it passed far below them.
    truth = s_min + e_min / ran_out
    assert (predict_steps(ran_out, alone.s_min, alone.e_min) < 0.75 * truth).all()
    assert (predict_steps(ran_out, bounded.s_min, bounded.e_min) > 0.95 * truth).all()
    # A bound the curve already clears changes nothing.
    clear = fit_hyperbola(b, steps, at_least=(np.array([64.0]), np.array([10.0])))
    assert (clear.s_min, clear.e_min) == pytest.approx((alone.s_min, alone.e_min), rel=1e-6)


def test_two_noisy_targets_fix_no_law():
    """Two targets a loss of 0.06 apart with B_crit 2380 +- 1100 and 3392 +- 870 (a nanoGPT
    branch point): the line through them is exact but its slope, carried from their errors,
    is -23 +- 34; no B* (3.6e+16 before) reaches the console."""
    fits = pd.DataFrame({"target": [3.76066, 3.70293], "b_crit": [2380.0, 3392.0],
                         "b_crit_se": [1100.0, 870.0], "refused": "", "bcrit_status": "fit"})
    law = fit_loss_scaling(fits).iloc[0]
    assert "slope's standard error is larger than the slope" in law["refused"]
    assert math.isnan(law["b_star"])
    # The same two targets with 2% errors: the slope stands, with an error from theirs.
    fits["b_crit_se"] = 0.02 * fits["b_crit"]
    law = fit_loss_scaling(fits).iloc[0]
    slope_se = math.hypot(0.02, 0.02) / math.log(3.76066 / 3.70293)
    assert law["refused"] == "" and law["alpha_b_se"] == pytest.approx(
        slope_se * law["alpha_b"] ** 2, rel=1e-6)
