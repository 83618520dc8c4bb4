"""Every benchmark subject runs, with its quickest options: a bench that no test runs rots unseen
(the probe bench once broke with the task protocol and nobody knew). No timings are asserted,
only that each subject runs to its end and reports finite, positive measurements."""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gnsweep.bench import SUBJECTS

QUICKEST = {
    "noise": ["--rounds", "1", "--steps", "2", "--batch-sizes", "32", "--no-ddp"],
    "probe": ["--rounds", "1"],
    "analysis": ["--runs", "6", "--steps", "60", "--repeat", "1"],
    "executors": ["--workers", "1", "--skip-torchrun", "--set", "sweep=tiny",
                  "--set", "sweep.batch_sizes=[32]", "--set", "sweep.learning_rates=[1.0]"],
    "planner": ["--workers", "1", "--set", "sweep=tiny"],
    "recipe": ["--quick", "--batch-sizes", "64"],
    "checkpoint": ["--rounds", "1", "--runs", "1", "--steps", "20", "--every", "10"],
}


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    """The benches pin torch to one thread; the rest of the session keeps its own setting."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(subject: str, options: list[str]) -> Any:
    return importlib.import_module(f"gnsweep.bench.{subject}").main(options)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_every_subject_has_quick_options() -> None:
    assert set(QUICKEST) == set(SUBJECTS)


def test_noise_bench_runs() -> None:
    result = _run("noise", QUICKEST["noise"])
    assert [(r["model"], r["batch"]) for r in result["rows"]] == [("mlp", 32), ("cnn", 32)]
    for row in result["rows"]:
        for key in ("plain_ms", "per_example", "microbatch", "hessian_steps", "b_noise",
                    "auto_cost"):
            assert _positive(row[key]), (row["model"], key, row[key])
    # At batch 32 per-example norms are kept for both (cnn: below the micro-batch threshold).
    assert [r["auto"] for r in result["rows"]] == ["per_example", "per_example"]


def test_probe_bench_runs() -> None:
    rows = _run("probe", QUICKEST["probe"])["probe"]
    assert {r["task"] for r in rows} == {"linreg", "digits"}
    assert all(_positive(r["probe_steps"]) and _positive(r["truth_steps"]) for r in rows)


def test_analysis_bench_runs() -> None:
    result = _run("analysis", QUICKEST["analysis"])
    assert result["rows"] == 6 * 60
    assert _positive(result["ratio"]) and _positive(result["ratio_core"])


def test_executors_bench_runs() -> None:
    local = _run("executors", QUICKEST["executors"])["local"]
    assert local["runs"] == 1 and _positive(local["wall_s"]) and _positive(local["train_sum_s"])


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
