"""A branch sweep with the default branch settings on a language model counted in tokens (the
chars task made tiny: a one-block causal transformer whose positions are `wpe(arange(T))`):
each branch point answers with a local B_crit by both definitions, or says why not."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gnsweep import paths, store

TINY_LM = ["task=chars", "task.context=8", "task.width=16", "task.depth=1", "task.heads=2",
           "task.eval_windows=16", "train.optimizer=adam", "noise.every=1000"]
WINDOWS = [1, 2, 4, 8]
"""Branch batch sizes in windows of 8 tokens: 8 ... 64 tokens a step."""


@pytest.mark.slow
def test_a_default_branch_sweep_on_a_token_lm_answers_at_each_point(tmp_path):
    """Two branch points of a tiny LM's base run, the branch grid's batch sizes and learning
    rates and nothing else: targets chosen from what the runs reached on the eval loss, each
    point with a local B_crit of eq. 2.11 at some target (a value, or the bound a fit outside
    its batch sizes is) and a local B_crit by
    tolerance (or its bound, with the reason), in tokens, named by its point; no B_crit outside
    [0.1 x smallest, 10 x largest batch] without a reason."""
    from branch_base import make_base_run

    from gnsweep.branching import prepare_branch
    from gnsweep.folder import read_run
    from gnsweep.sweep_analysis import analyze_sweep
    from gnsweep.training import train

    base = make_base_run(tmp_path / "base", [*TINY_LM, "sweep.batch_sizes=[4]",
                                             "sweep.learning_rates=[0.02]",
                                             "sweep.targets=[0.01]", "sweep.max_steps=40"],
                         [256, 1024])
    out = tmp_path / "along"
    config, specs = prepare_branch(base, [256, 1024], out, [
        *TINY_LM[6:], f"sweep.batch_sizes={WINDOWS}".replace(" ", ""),
        "sweep.learning_rates=[0.01,0.03]"])
    assert config.analysis.loss == "eval" and config.branch.automatic
    for spec in specs:
        run_cfg, spec = read_run(out, spec.run_id)
        folder = paths.run_dir(out, spec.run_id)
        result = train(run_cfg, spec, folder)
        store.write_status(folder, result.state, reason=result.reason)
    analysis = analyze_sweep(out)
    along = analysis.along
    assert analysis.meta["unit"] == "tokens"
    smallest, largest = 8 * min(WINDOWS), 8 * max(WINDOWS)
    assert sorted(set(along["at_examples"])) == [256, 1024]
    for _, rows in along.groupby("at_examples"):
        assert (rows["target_source"] == "auto").all()
        # A fit, or the bound a fit outside the batch sizes it was fitted on is (said as one
        # in the table and the console alike), at some target of each point.
        answered = rows[((rows["refused"] == "") & np.isfinite(rows["b_crit"]))
                        | rows["bcrit_status"].isin(["lower_bound", "upper_bound"])]
        assert len(answered), rows[["target", "refused"]]
        bounds = rows[rows["bcrit_status"].isin(["lower_bound", "upper_bound"])]
        assert (bounds["refused"] != "").all() and np.isfinite(bounds["b_crit_bound"]).all()
        first = rows.iloc[0]
        # One window of 16 steps of the largest batch: 16 x 64 tokens.
        assert first["window"] == pytest.approx(16 * largest, rel=1 / 16)
        assert math.isfinite(first["b_crit_tol"]) or first["tol_refused"].startswith(
            "all batch sizes within tolerance: above")
        for value, why in [*zip(rows["b_crit"], rows["refused"], strict=True),
                           (first["b_crit_tol"], first["tol_refused"])]:
            assert why or not math.isfinite(value) or 0.1 * smallest <= value <= 10 * largest
    text = (out / "along.parquet").is_file() and _console(along)
    assert "at 256 tokens (step " in text and "by tolerance" in text


def _console(along) -> str:
    from gnsweep.report.console import format_along

    return format_along(along, "tokens")
