"""The noise probe inside a script's own process (`gnsweep.inscript`), against exact truth.

The script (tests/helpers/script_accum.py) is plain PyTorch that knows nothing of gnsweep: linear
regression held at fixed weights `w* + delta`, where B_simple is exact in closed form (Isserlis:
`(d (|delta|^2 + s^2) + |delta|^2) / |delta|^2` = 10 here, |G|^2 = |delta|^2 = 2). Each run is a
real process started by gnsweep; its metrics.parquet must carry the probe's B_simple, joined to
the script's printed rows by step. The window pools every step (`noise.ema_fraction=100`), so
the estimate is the ratio of the means of 200 unbiased single estimates: its standard error is
about 2.5% (a 10% band is about 4 of them)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from locations import HELPERS, ROOT

from gnsweep import paths, store, tables
from gnsweep.config import Config
from gnsweep.errors import ConfigError
from gnsweep.runs import RunSpec
from gnsweep.tasks.script import microbatch_size
from gnsweep.training.script_noise import ProbeRows, probe_environment

PY = sys.executable
SCRIPT = HELPERS / "script_accum.py"
TRUTH = 10.0
"""B_simple of script_accum.py's frozen regression, exact."""
STEPS = 200
GRID = ["sweep.learning_rates=[0.05]", "sweep.targets=[0.01]", f"sweep.max_steps={STEPS}",
        "sweep.max_retries=0", "noise.ema_fraction=100"]
PATTERN = (r"task.log_pattern=step (?P<step>\d+) loss (?P<loss>\S+) "
           r"b_simple_true (?P<b_simple_true>\S+)")


def _launch(sweep_dir: Path, command: str, *overrides: str) -> subprocess.CompletedProcess:
    args = [PY, "-m", "gnsweep", "launch", "--sweep-dir", str(sweep_dir), "-q", "task=script",
            f"task.command={command}", PATTERN, *GRID, "noise.runs=all", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                         os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(args, capture_output=True, text=True, timeout=400,
                          cwd=sweep_dir.parent, env=env)


def _metrics(sweep_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for run_id in store.run_ids(sweep_dir):
        table = store.read_table(paths.run_dir(sweep_dir, run_id) / paths.METRICS)
        out[run_id] = {name: table.column(name).to_numpy() for name in table.column_names}
    return out


def _command(*extra: str) -> str:
    return (f"{PY} {SCRIPT} --bs={{batch_size}} --micro={{microbatch_size}} "
            f"--accum={{accumulation}} --seed={{seed}} --steps={{max_steps}} --frozen "
            + " ".join(extra))


@pytest.mark.slow
def test_a_script_with_accumulation_and_one_with_a_loss_scale_get_the_exact_b_simple(tmp_path):
    """Two runs of an unmodified script, 4 micro-batches a step: one dividing its loss by the
    passes, one under a GradScaler (loss x 1024, then x 512 after the overflow it skips at
    step 7) that also clips: B_simple is the exact one in both, the scale is never known.
    Both are measured (`_launch` sets noise.runs=all: the plan would measure one seed)."""
    sweep_dir = tmp_path / "sweep"
    done = _launch(sweep_dir, _command("--scaled-seeds=1"), "task.accumulation=4",
                   "sweep.batch_sizes=[64]", "sweep.seeds=[0,1]", "executor.workers=2")
    assert done.returncode == 0, done.stderr
    for run_id, rows in _metrics(sweep_dir).items():
        scaled = run_id.endswith("_s1")
        assert list(rows["step"]) == list(range(1, STEPS + 1))
        assert np.isfinite(rows["b_simple"]).all()  # every row joined, step 7 (skipped) too
        assert rows["b_small"][-1] == 16 and rows["b_big"][-1] == 64
        assert abs(rows["b_simple"][-1] / TRUTH - 1) < 0.10, rows["b_simple"][-1]
        assert rows["b_simple_true"][-1] == TRUTH
        if not scaled:  # the passes' own scale is the loss's: |G|^2 = |delta|^2 = 2
            assert abs(rows["g2"][-1] / 2.0 - 1) < 0.10
        if scaled:  # the overflow of step 7 is left out: its row carries step 6's estimate
            assert rows["b_simple"][6] == rows["b_simple"][5]
        status = store.read_status(paths.run_dir(sweep_dir, run_id))
        assert status["noise_method"]["method"] == "inscript", status


@pytest.mark.slow
@pytest.mark.distributed
def test_a_torchrun_ddp_script_is_measured_from_its_ranks(tmp_path):
    """executor=torchrun, 2 gloo ranks of DDP, no accumulation: each rank's gradient before
    the all-reduce is the small batch (B / 2), the all-reduced one the big; exact B_simple."""
    sweep_dir = tmp_path / "sweep"
    done = _launch(sweep_dir, f"{PY} {SCRIPT} --bs={{batch_size}} --micro=32 --accum=2 --ddp "
                   "--frozen --seed={seed} --steps={max_steps}",
                   "executor=torchrun", "executor.nproc_per_node=2", "sweep.batch_sizes=[64]")
    assert done.returncode == 0, done.stderr
    (rows,) = _metrics(sweep_dir).values()
    assert np.isfinite(rows["b_simple"]).all()
    assert rows["b_small"][-1] == 32 and rows["b_big"][-1] == 64
    assert abs(rows["b_simple"][-1] / TRUTH - 1) < 0.10, rows["b_simple"][-1]


@pytest.mark.process
def test_a_script_without_accumulation_gets_nan_and_says_so_once(tmp_path):
    """One backward pass a step in one process: no second batch size. B_simple is NaN in every
    row, and the run says why once (its stderr.log, its status' noise_method)."""
    from gnsweep.training.script_runner import run_script

    config = Config.from_dict({
        "task": {"name": "script", "cwd": str(tmp_path), "log_pattern": PATTERN.split("=", 1)[1],
                 "command": f"{PY} {SCRIPT} --bs={{batch_size}} --frozen --steps=30"},
        "sweep": {"batch_sizes": [64], "learning_rates": [0.05], "targets": [0.01],
                  "max_steps": 30}})
    out = tmp_path / "runs" / "b00064_lr0.05_s0"
    out.mkdir(parents=True)
    result = run_script(config, RunSpec(64, 0.05), out)
    assert result.steps == 30
    table = store.read_table(out / paths.METRICS)
    assert np.isnan(table.column("b_simple").to_numpy()).all()
    said = [line for line in (out / "stderr.log").read_text().splitlines()
            if "no second batch size" in line]
    assert len(said) == 1, said
    assert "no second batch size" in result.noise_method["reason"]
    assert result.b_simple_nan_share == 1.0  # said by status and analyze as any run's NaN


def test_noise_method_none_starts_no_probe_and_b_must_divide_into_micro_batches(tmp_path):
    config = Config.from_dict({"task": {"name": "script", "command": "python t.py"},
                               "noise": {"method": "none"}})
    assert probe_environment(config, {"batch_size": 8}, 1.0, 1, tmp_path) == {}
    on = Config.from_dict({"task": {"name": "script", "command": "python t.py"}})
    env = probe_environment(on, {"batch_size": 8}, 1.0, 1, tmp_path)
    assert json.loads(env["GNSWEEP_NOISE_PROBE"])["batch_size"] == 8
    assert json.loads(env["GNSWEEP_NOISE_PROBE"])["every"] == "auto"
    every = Config.from_dict({"task": {"name": "script", "command": "python t.py"},
                              "noise": {"every": 4}})
    assert json.loads(probe_environment(every, {"batch_size": 8}, 1.0, 1, tmp_path)
                      ["GNSWEEP_NOISE_PROBE"])["every"] == 4
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("boot")
    assert microbatch_size(64, 4) == 16
    with pytest.raises(ConfigError, match=r"48 does not divide into task\.accumulation=5"):
        microbatch_size(48, 5)


def test_the_rows_join_by_step_in_the_tasks_unit_and_the_scripts_own_value_wins(tmp_path):
    """The probe's estimate at a step joins the row of that step; a step it left out (an
    overflow the script skipped) takes the last before it, but never past its last row; a
    script's own b_simple is kept; batch sizes and tr(Sigma) come in the task's unit."""
    estimate = {"b_small": 4.0, "b_big": 16.0, "sq_norm_small": 1.0, "sq_norm_big": 1.0,
                "g2_step": 1.0, "trace_sigma_step": 3.0, "g2": 1.0, "trace_sigma": 3.0,
                "b_simple": 3.0, "b_simple_se": 0.5}
    lines = [{"step": 1, **estimate}, {"step": 2, **estimate, "b_simple": 5.0},
             {"note": "said"}, {"step": 4, **estimate, "b_simple": 7.0}]
    (tmp_path / paths.NOISE_PROBE_ROWS).write_text(
        "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 5, "b_sm')
    rows = {name: [math.nan] * 5 for name in tables.METRICS_SCHEMA.names}
    rows["step"] = [1, 2, 3, 4, 5]
    rows["b_simple"][0] = 100.0  # logged by the script itself
    probe = ProbeRows(tmp_path, per_sample=32.0)
    probe.join(rows)
    assert rows["b_simple"][0] == 100.0
    assert rows["b_simple"][1:4] == [5.0 * 32, 5.0 * 32, 7.0 * 32]
    assert math.isnan(rows["b_simple"][4])  # the cut line is no row, and nothing after step 4
    assert rows["b_big"][1] == 16 * 32 and rows["g2"][1] == 1.0
    assert rows["trace_sigma"][1] == 3.0 * 32
    assert probe.notes == ["said"]


@pytest.mark.process
def test_the_startup_hook_chains_to_the_sitecustomize_it_hides(tmp_path):
    """gnsweep's sitecustomize.py runs the interpreter's own (the next one on the path) and,
    with the probe's settings in the environment, waits for torch.optim (no torch imported
    at startup); without them it only chains."""
    from gnsweep.training.script_noise import BOOT

    own = tmp_path / "site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins\nbuiltins.OWN_SITE = True\n")
    code = ("import builtins, sys\n"
            "print(getattr(builtins, 'OWN_SITE', False), 'torch' in sys.modules,\n"
            "      any(type(f).__name__ == '_Watch' for f in sys.meta_path))\n")
    for settings, watching in (('{"rows": "x", "batch_size": 8}', "True"), ("", "False")):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BOOT), str(own), str(ROOT)]),
               "GNSWEEP_NOISE_PROBE": settings}
        done = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env,
                              timeout=60, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["True", "False", watching], done.stdout + done.stderr


def test_launch_refuses_a_batch_that_does_not_divide_into_micro_batches(tmp_path):
    from typer.testing import CliRunner

    from gnsweep.cli import app

    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, [
        "launch", "--sweep-dir", str(out), "task=script", f"task.command={_command()}",
        "task.accumulation=5", "sweep.batch_sizes=[40,48]", *GRID])
    assert result.exit_code == 2, result.output
    assert "48 does not divide into task.accumulation=5 micro-batches" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


# ---- the probe run directly on a script (no sweep): its rows file --------------------------

def _probed(tmp_path: Path, args: list[str], every: int | str = 1, resume_step: int = 0,
            script: Path = SCRIPT) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`script` run as gnsweep starts a measured script run (the startup hook first on
    PYTHONPATH, the probe's settings in the environment); the lines of its rows file."""
    from gnsweep.training.script_noise import BOOT

    rows = tmp_path / "rows.jsonl"
    settings = {"rows": str(rows), "batch_size": 64, "accumulation": 4, "every": every,
                "ema_fraction": 100}
    env = {**os.environ, "GNSWEEP_NOISE_PROBE": json.dumps(settings),
           "GNSWEEP_RESUME_STEP": str(resume_step),
           "PYTHONPATH": os.pathsep.join([str(BOOT), str(ROOT)])}
    done = subprocess.run([PY, str(script), *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() \
        else []
    return done, lines


@pytest.mark.process
def test_noise_every_measures_every_kth_step_of_the_run_and_stays_exact(tmp_path):
    """noise.every=3 under a GradScaler that skips step 7: rows at steps 1, 4, 10, 13, ...
    (7 was skipped: left out, and counted, so the later steps stay the script's), each
    standing for 3 steps; B_simple is still the exact one (the frozen regression: 10)."""
    _, lines = _probed(tmp_path, ["--bs=64", "--micro=16", "--accum=4", "--frozen",
                                  "--steps=200", "--scaler", "--sum", "--clip=0.5"], every=3)
    rows = [line for line in lines if "step" in line]
    assert [row["step"] for row in rows] == [s for s in range(1, 201, 3) if s != 7]
    assert {row["span"] for row in rows} == {3}
    assert rows[-1]["b_small"] == 16 and rows[-1]["b_big"] == 64
    assert abs(rows[-1]["b_simple"] / TRUTH - 1) < 0.15, rows[-1]["b_simple"]


@pytest.mark.process
def test_a_resumed_script_whose_optimizer_counts_no_steps_is_not_measured_and_says_so(
        tmp_path):
    """Plain SGD keeps no step count: in an attempt gnsweep resumed (resume_step 50) the probe
    cannot tell the script's step, so it writes no row (a row counted from 1 would replace
    the first attempt's) and says why once."""
    done, lines = _probed(tmp_path, ["--bs=64", "--micro=16", "--accum=4", "--frozen",
                                     "--steps=20"], resume_step=50)
    assert not [line for line in lines if "step" in line]
    (note,) = lines
    assert "cannot tell which step" in note["note"]
    assert done.stderr.count("cannot tell which step") == 1


RESUMING = '''
import sys

import torch

torch.manual_seed(int(sys.argv[1]))
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
if sys.argv[1] == "1":
    optimizer.load_state_dict(torch.load(sys.argv[2]))
for step in range(3):
    optimizer.zero_grad()
    for _ in range(4):
        x = torch.randn(16, 4)
        (model(x).square().mean() / 4).backward()
    optimizer.step()
torch.save(optimizer.state_dict(), sys.argv[2])
'''


@pytest.mark.process
def test_a_resumed_adam_script_continues_from_the_optimizers_own_step(tmp_path):
    """Adam's state counts its steps: the attempt resumed from it writes rows 4-6 after the
    first attempt's 1-3."""
    script = tmp_path / "resuming.py"
    script.write_text(RESUMING)
    state = str(tmp_path / "adam.pt")
    _, first = _probed(tmp_path, ["0", state], script=script)
    _, both = _probed(tmp_path, ["1", state], resume_step=3, script=script)
    assert [line["step"] for line in first] == [1, 2, 3]
    assert [line["step"] for line in both] == [1, 2, 3, 4, 5, 6]


def test_a_row_stands_for_the_steps_of_its_span_after_the_last():
    """Between two rows every step takes the earlier one's estimate (not measured, or
    skipped); after the last row only the steps of its span do (`noise.every`), so a probe
    that stopped is not carried on."""
    import tempfile

    estimate = {"b_small": 4.0, "b_big": 16.0, "sq_norm_small": 1.0, "sq_norm_big": 1.0,
                "g2_step": 1.0, "trace_sigma_step": 3.0, "g2": 1.0, "trace_sigma": 3.0,
                "b_simple": 3.0, "b_simple_se": 0.5}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder)
        (path / paths.NOISE_PROBE_ROWS).write_text(
            json.dumps({"step": 1, "span": 3, **estimate}) + "\n"
            + json.dumps({"step": 4, "span": 3, **estimate, "b_simple": 6.0}) + "\n")
        rows = {name: [math.nan] * 8 for name in tables.METRICS_SCHEMA.names}
        rows["step"] = list(range(1, 9))
        ProbeRows(path, per_sample=1.0).join(rows)
    assert rows["b_simple"][:6] == [3.0, 3.0, 3.0, 6.0, 6.0, 6.0]
    assert all(math.isnan(value) for value in rows["b_simple"][6:])  # steps 7, 8


def test_the_squared_norms_are_exact_whatever_the_tensors():
    """The pass norms: numpy's dot on CPU fp32/fp64 (a transposed view too), torch for the
    half precisions; the sum against float64 arithmetic."""
    import torch

    from gnsweep.inscript.probe import _floats, _sq_sum

    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(300, 70, generator=generator),
             torch.randn(40, 50, generator=generator, dtype=torch.float64).t(),
             torch.randn(33, generator=generator).to(torch.bfloat16)]
    truth = sum(float(g.double().square().sum()) for g in grads)
    cpu_only = _sq_sum(torch, grads[:2])
    assert isinstance(cpu_only, float)
    assert abs(cpu_only / sum(float(g.double().square().sum()) for g in grads[:2]) - 1) < 1e-6
    mixed = _sq_sum(torch, grads)
    assert isinstance(mixed, torch.Tensor)
    (value,) = _floats(torch, mixed)
    assert abs(value / truth - 1) < 1e-5
    assert _floats(torch, 2.0, torch.tensor(3.0)) == [2.0, 3.0]
