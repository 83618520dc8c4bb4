"""Every benchmark subject runs, with its quickest options: a bench that no test runs rots unseen
(the probe bench once broke with the task protocol and nobody knew). No timings are asserted,
only that each subject runs to its end and reports finite, positive measurements."""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gnsweep.bench import SUBJECTS

QUICKEST = {
    "noise": ["--rounds", "1", "--steps", "2", "--batch-sizes", "32", "--no-ddp"],
    "sweep_cost": ["--rounds", "1", "--steps", "3", "--models", "mlp,gpt2"],
    "probe": ["--rounds", "1"],
    "analysis": ["--runs", "6", "--steps", "60", "--repeat", "1"],
    "executors": ["--workers", "1", "--skip-torchrun", "--set", "sweep=tiny",
                  "--set", "sweep.batch_sizes=[32]", "--set", "sweep.learning_rates=[1.0]"],
    "planner": ["--workers", "1", "--set", "sweep=tiny"],
    "recipe": ["--quick", "--batch-sizes", "64"],
    "checkpoint": ["--rounds", "1", "--runs", "1", "--steps", "20", "--every", "10"],
    "script_probe": ["--rounds", "1", "--steps", "3", "--models", "mlp"],
}


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    """The benches pin torch to one thread and hide GPUs; the rest of the session keeps its own
    setting and environment (a bench that leaked CUDA_VISIBLE_DEVICES='' once failed the GPU
    sharing tests that ran after it in the same worker)."""
    threads = torch.get_num_threads()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    yield
    torch.set_num_threads(threads)
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible, "a bench left its environment"


def _run(subject: str, options: list[str]) -> Any:
    return importlib.import_module(f"gnsweep.bench.{subject}").main(options)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_every_subject_has_quick_options() -> None:
    assert set(QUICKEST) == set(SUBJECTS)


def test_noise_bench_runs() -> None:
    result = _run("noise", QUICKEST["noise"])
    assert [(r["model"], r["batch"]) for r in result["rows"]] == [
        ("mlp", 32), ("cnn", 32), ("cnn_batchnorm", 32), ("gpt2", 32)]
    for row in result["rows"]:
        for key in ("plain_ms", "microbatch", "auto_cost"):
            assert _positive(row[key]), (row["model"], key, row[key])
        assert row["meets"] == (not row["misses"])
    rows = {r["model"]: r for r in result["rows"]}
    for name in ("mlp", "cnn"):
        assert _positive(rows[name]["per_example"]) and _positive(rows[name]["b_noise"])
    # At batch 32 per-example norms are kept (cnn: below the micro-batch threshold); a
    # BatchNorm model's examples interact: micro-batches, and per-example norms never timed.
    assert [r["auto"] for r in result["rows"]] == ["per_example", "per_example", "microbatch",
                                                   "per_example"]
    assert math.isnan(rows["cnn_batchnorm"]["per_example"])
    assert rows["cnn_batchnorm"]["auto_cost"] == rows["cnn_batchnorm"]["microbatch_vs_unsplit"]
    assert [rows[n]["conv"] for n in ("mlp", "cnn", "cnn_batchnorm", "gpt2")] == [
        False, True, True, False]


def test_sweep_cost_bench_runs() -> None:
    result = _run("sweep_cost", QUICKEST["sweep_cost"])
    rows = {r["model"]: r for r in result["rows"]}
    assert list(rows) == ["mlp", "gpt2"]
    for row in rows.values():
        assert _positive(row["none_s"])
        for key in ("default", "every_step", "per_example", "microbatch"):
            assert _positive(row[key]), (row["model"], key)
        assert row["default_share"] == 1.0  # 3 steps: the window holds too few to skip any
    # The MLP has no norm layers: norm_layers is refused there, timed on GPT-2.
    assert math.isnan(rows["mlp"]["norm_layers"]) and _positive(rows["gpt2"]["norm_layers"])
    # GPT-2 trains with Adam, whose preconditioned pair splits measured steps anyway.
    assert rows["mlp"]["default_method"] == "per_example"
    assert rows["gpt2"]["default_method"] == "microbatch"


def test_sweep_cost_runs_only_the_variants_asked_for() -> None:
    result = _run("sweep_cost", ["--rounds", "1", "--steps", "3", "--models", "mlp",
                                 "--variants", "none", "--clock", "cpu"])
    row = result["rows"][0]
    assert result["clock"] == "cpu" and _positive(row["none_s"])
    assert _positive(row["default"])  # always run, beside the baseline
    assert all(math.isnan(row[k]) for k in ("every_step", "per_example", "microbatch"))


def test_noise_goals_name_the_rows_that_miss() -> None:
    from gnsweep.bench.noise import misses

    def row(batch: int, auto_cost: float, per_example: float, conv: bool) -> dict:
        return {"batch": batch, "auto_cost": auto_cost, "per_example": per_example,
                "conv": conv}

    assert misses(row(32, 1.29, 1.29, True)) == []
    assert misses(row(32, 1.31, 1.0, False)) == ["auto_cost 1.31 > 1.3"]
    assert misses(row(128, 1.21, 1.0, False)) == ["auto_cost 1.21 > 1.2"]
    assert misses(row(512, 1.1, 1.5, False)) == []  # per-example goal: convolutions only
    assert misses(row(512, 1.1, 1.5, True)) == ["per_example 1.5 > 1.3 (convolutions)"]
    assert misses(row(512, 1.1, math.nan, True)) == []  # not timed: wrong for the model
    assert misses(row(512, math.nan, 1.0, False)) == ["auto_cost nan > 1.2"]


def test_probe_bench_runs() -> None:
    rows = _run("probe", QUICKEST["probe"])["probe"]
    assert {r["task"] for r in rows} == {"linreg", "digits"}
    assert all(_positive(r["probe_steps"]) and _positive(r["truth_steps"]) for r in rows)


def test_analysis_bench_runs() -> None:
    result = _run("analysis", QUICKEST["analysis"])
    assert result["rows"] == 6 * 60
    assert _positive(result["ratio"]) and _positive(result["ratio_core"])


@pytest.mark.process
def test_executors_bench_runs() -> None:
    local = _run("executors", QUICKEST["executors"])["local"]
    assert local["runs"] == 1 and _positive(local["wall_s"]) and _positive(local["train_sum_s"])


@pytest.mark.process
def test_planner_bench_runs() -> None:
    result = _run("planner", QUICKEST["planner"])
    assert result["grid_runs"] == 6 and result["plan_runs"] >= 1
    assert 0 < result["compute_ratio"] <= 1  # the plan never trains more than the grid


def test_recipe_bench_runs() -> None:
    rows = _run("recipe", QUICKEST["recipe"])["rows"]
    assert [r["batch"] for r in rows] == [64]
    assert all(_positive(r[k]) for r in rows for k in ("whole_ms", "pieces", "bf16"))


def test_checkpoint_bench_runs() -> None:
    result = _run("checkpoint", QUICKEST["checkpoint"])
    assert result["runs"] == 1
    assert _positive(result["save_ms"]) and _positive(result["checkpoint_bytes"])


@pytest.mark.distributed
def test_ddp_bench_sets_up_and_tears_down_cleanly() -> None:
    """The two-process DDP part of the noise bench (its processes once aborted at exit with
    SIGABRT from gloo's threads: mp.spawn then raises)."""
    result = _run("noise", ["--rounds", "1", "--steps", "2", "--batch-sizes", "32",
                            "--models", "mlp"])
    assert _positive(result["rows"][0]["ddp"])


@pytest.mark.process
def test_script_probe_bench_runs() -> None:
    (row,) = _run("script_probe", QUICKEST["script_probe"])["rows"]
    assert row["model"] == "mlp"
    assert all(_positive(row[key]) for key in ("plain_ms", "probed_ms", "ratio"))


def test_sweep_agreement_is_within_15_percent_or_two_standard_errors() -> None:
    from gnsweep.bench.sweep_cost import agreement

    assert agreement(110.0, 5.0, 100.0, 5.0)["agrees"]  # 10%
    assert not agreement(130.0, 5.0, 100.0, 5.0)["agrees"]  # 30%, 4.2 combined errors
    assert agreement(130.0, 12.0, 100.0, 9.0)["agrees"]  # 30%, 2.0 combined errors
    assert agreement(130.0, math.nan, 100.0, 16.0)["agrees"]  # the finite error alone
    assert not agreement(math.nan, 1.0, 100.0, 1.0)["agrees"]
    assert agreement(130.0, 12.0, 100.0, 9.0)["ratio"] == 1.3


@pytest.mark.slow
def test_sweep_cost_measures_whole_sweeps() -> None:
    result = _run("sweep_cost", ["--sweeps", "tiny"])
    (row,) = result["sweeps"]
    assert row["sweep"] == "tiny" and _positive(row["none_s"])
    assert _positive(row["default"]) and _positive(row["full"])
    assert _positive(row["default_cpu"]) and _positive(row["full_cpu"])
    assert _positive(row["none_train_cpu_s"]) and _positive(row["default_train_cpu"])
    # Two rates a batch size: the plan measures both.
    assert row["runs_measured"] == "2/2"
    assert [t["target"] for t in row["targets"]] == [0.5]
    assert all(t["agrees"] and _positive(t["b_simple"]) for t in row["targets"])


def test_the_script_sweep_is_a_valid_launch_of_the_default_grid(tmp_path) -> None:
    """`--sweeps script` launches the default sweep's grid as a script with 4 micro-batches a
    step; its overrides, with the bench's placeholders filled, must be a launch gnsweep takes
    (a dry run: nothing started)."""
    import sys

    from typer.testing import CliRunner

    from gnsweep.bench.sweep_cost import SWEEPS
    from gnsweep.cli import app

    overrides = [o.replace("{python}", sys.executable).replace("{cpu_dir}", str(tmp_path))
                 for o in SWEEPS["script"]]
    result = CliRunner().invoke(app, ["launch", "--dry-run", "--sweep-dir",
                                      str(tmp_path / "s"), *overrides])
    assert result.exit_code == 0, result.output
    assert "56 runs" in result.output
    shown = [line for line in result.output.splitlines() if line.startswith("    $ ")]
    assert "--batch-size=8 --accumulation=4 --lr=0.1 " in shown[0]
    assert f"--cpu-out={tmp_path}/b00008_lr0.1_s0.json" in shown[0]
