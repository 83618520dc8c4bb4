"""task=script: the user's own training command as the sweep's run (docs/scripts.md).

The scripts are real processes (tests/helpers/script_sgd.py, plain PyTorch written as a user would);
the rows are checked against what the script printed or wrote, and a run killed with -9 and
relaunched against the same run trained in one go."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from locations import HELPERS, ROOT
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.config import ConfigError
from gnsweep.tasks.script import ScriptOptions, command_args, sweep_name

SCRIPT = HELPERS / "script_sgd.py"
PY = sys.executable
GRID = ["sweep.batch_sizes=[16]", "sweep.learning_rates=[0.2]", "sweep.targets=[0.01]",
        "sweep.max_retries=1"]
runner = CliRunner()


def _command(*extra: str) -> str:
    return (f"{PY} {SCRIPT} --bs={{batch_size}} --lr={{learning_rate}} --seed={{seed}} "
            f"--out={{run_dir}} " + " ".join(extra))


@dataclass
class Launched:
    returncode: int
    stderr: str


def _launch(sweep_dir: Path, command: str, *overrides: str) -> Launched:
    """`gnsweep launch` through the CLI in this process, from the sweep's parent folder (its
    workers are forked from it, the scripts are their own processes): no interpreter and torch
    import for the launcher itself."""
    args = ["launch", "--sweep-dir", str(sweep_dir), "-q", "task=script",
            f"task.command={command}", *GRID, "executor.workers=1", *overrides]
    sweep_dir.parent.mkdir(parents=True, exist_ok=True)
    # The scripts' environment: restored after the test (conftest._process_state_restored).
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    with contextlib.chdir(sweep_dir.parent):
        result = runner.invoke(app, args)
    return Launched(result.exit_code, result.stderr + result.stdout)


def _env() -> dict[str, str]:
    root = str(ROOT)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def _rows(sweep_dir: Path) -> dict[str, np.ndarray]:
    (run_id,) = store.run_ids(sweep_dir)
    table = store.read_metrics(paths.run_dir(sweep_dir, run_id))
    assert table is not None
    return {name: table.column(name).to_numpy() for name in table.column_names}


def _status(sweep_dir: Path) -> dict:
    (run_id,) = store.run_ids(sweep_dir)
    return store.read_status(paths.run_dir(sweep_dir, run_id))


# ---- the settings, checked before anything runs ------------------------------------------


def test_the_command_is_split_like_a_shell_and_filled():
    args = command_args("python 'my train.py' --bs={batch_size} --lr {learning_rate}",
                        "task.command", {"batch_size": 32, "learning_rate": 0.05})
    assert args == ["python", "my train.py", "--bs=32", "--lr", "0.05"]
    assert sweep_name("python scripts/train.py --x=1") == "train"


@pytest.mark.parametrize(("options", "named"), [
    ({"command": "python t.py --bs={batch}"}, "unknown placeholder {batch}"),
    ({"command": "python t.py", "log_pattern": r"loss (?P<loss>\S+)"}, "no named group step"),
    ({"command": "python t.py", "log_pattern": r"(?P<step>\d+) (?P<loss>\S+) (?P<ms>\d+)"},
     "'ms' is not a metrics column"),
    ({"command": "python t.py", "log_file": "{run_dir}/l.csv", "columns": {"los": "x"}},
     "'los' is not a metrics column"),
    ({"command": "python t.py", "log_file": "log.csv"}, "the same file for every run"),
    ({"command": "python 't.py"}, "No closing quotation"),
    ({"command": "python t.py", "examples_per_sample": 0}, "task.examples_per_sample"),
])
def test_bad_settings_are_refused_naming_them(options, named):
    with pytest.raises(ConfigError, match=named.replace("{", r"\{").replace("}", r"\}")
                       .replace("(", r"\(").replace("'", "'")):
        ScriptOptions(**options)


def test_hydra_takes_the_command_and_pattern_as_written():
    config = compose(["task=script", "task.command=python t.py --bs={batch_size} 'a b'",
                      r"task.log_pattern=iter (?P<step>\d+): loss (?P<loss>[\d.]+)",
                      *GRID])
    assert config.task.options["command"] == "python t.py --bs={batch_size} 'a b'"
    assert config.task.options["log_pattern"] == r"iter (?P<step>\d+): loss (?P<loss>[\d.]+)"
    assert config.sweep.name == "t"


@pytest.mark.parametrize(("command", "named"), [
    ("no_such_program_gnsweep --bs={batch_size}", "no_such_program_gnsweep: command not found"),
    (f"{PY} missing_train.py", "missing_train.py: no such file"),
    (f"{PY} t.py --x={{lr}}", "unknown placeholder {lr}"),
])
def test_launch_refuses_bad_input_in_one_line_and_runs_nothing(tmp_path, command, named):
    out = tmp_path / "sweep"
    result = runner.invoke(app, ["launch", "--sweep-dir", str(out), "task=script",
                                 f"task.command={command}", *GRID])
    assert result.exit_code == 2, result.output
    assert named in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()



def test_gnsweeps_noise_and_ddp_rules_do_not_apply_to_a_script_that_trains_itself(tmp_path):
    """A script does its own DDP: the grid need not split over the processes by gnsweep's
    rule, and a noise.method of gnsweep's own loop (which the script would never see) is
    refused in one line instead of the DDP advice meant for that loop; auto and none (the
    in-script probe on or off) are taken."""
    torchrun = ["executor=torchrun", "executor.nproc_per_node=2"]
    command = "task.command=python t.py --bs={batch_size}"
    config = compose(["task=script", command, *torchrun, "sweep.batch_sizes=[3,10]",
                      *GRID[1:]])
    assert config.executor.world_size() == 2 and config.sweep.batch_sizes == [3, 10]
    with pytest.raises(ConfigError, match="3 does not split over 2"):  # gnsweep's own loop
        compose(["task=linreg", *torchrun, "sweep.batch_sizes=[3,10]", *GRID[1:]])
    for executor in ([], torchrun):
        for method in ("ddp", "per_example", "microbatch"):
            with pytest.raises(ConfigError, match=rf"noise.method={method} with task=script: "
                                                  r"gnsweep measures a script from its backward"):
                compose(["task=script", command, *executor, f"noise.method={method}", *GRID])
        for method in ("auto", "none"):
            config = compose(["task=script", command, *executor, f"noise.method={method}", *GRID])
            assert config.noise.method == method
    # From the command line: one line, exit 2, nothing written.
    out = tmp_path / "sweep"
    result = runner.invoke(app, ["launch", "--sweep-dir", str(out), "task=script", command,
                                 "noise.method=per_example", *GRID])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "noise.method=per_example with task=script" in result.output
    assert not out.exists()


# ---- real scripts ---------------------------------------------------------------------------


@pytest.mark.slow
def test_printed_lines_are_the_metrics_and_failures_are_recorded(tmp_path):
    """One sweep, one script behaviour a seed: a plain run whose printed lines are its rows
    and which the sweep stops at the target; exit 1 with a message on stderr; a NaN loss; a
    step logged again; no matching line at all."""
    sweep_dir = tmp_path / "sweep"
    done = _launch(sweep_dir, _command("--faults=none,fail,nan,back,quiet", "--steps=200"),
                   r"task.log_pattern=step (?P<step>\d+) \| loss (?P<loss>\S+) \| lr (?P<lr>\S+)",
                   "sweep.seeds=[0,1,2,3,4]", "sweep.targets=[0.3]", "sweep.max_retries=0",
                   "executor.workers=2")
    assert done.returncode == 1
    runs = {name: paths.run_dir(sweep_dir, f"b00016_lr0.2_s{seed}")
            for seed, name in enumerate(("none", "fail", "nan", "back", "quiet"))}
    status = {name: store.read_status(path) for name, path in runs.items()}

    assert status["none"]["state"] == "done" and status["none"]["reason"] == "target"
    table = store.read_metrics(runs["none"])
    assert table is not None
    rows = {name: table.column(name).to_numpy() for name in table.column_names}
    printed = [line for line in (runs["none"] / "stdout.log").read_text().splitlines()
               if line.startswith("step ")]
    n = len(rows["step"])
    assert list(rows["step"]) == list(range(1, n + 1))
    assert n < 200  # stopped at the target, before the script's own end
    assert [float(line.split("loss ")[1].split(" ")[0]) for line in printed[:n]] == \
        list(rows["loss"])
    assert list(rows["examples"]) == [16 * s for s in range(1, n + 1)]
    assert np.all(rows["lr"] == 0.2)
    assert np.isfinite(rows["loss_smooth"]).all()

    assert status["fail"]["state"] == "failed"
    assert "exit status 1: RuntimeError: CUDA out of memory" in status["fail"]["error"]
    assert any("CUDA out of memory" in line for line in status["fail"]["stderr"])
    shown = runner.invoke(app, ["status", str(sweep_dir)])
    assert "exit status 1" in shown.output
    assert status["nan"]["state"] == "diverged"
    table = store.read_metrics(runs["nan"])
    assert table is not None
    assert math.isnan(table.column("loss")[-1].as_py()) and table.column("step")[-1].as_py() == 5
    assert status["back"]["state"] == "failed"
    assert "stdout line 7: steps go backwards (step 3 after step 6)" in status["back"]["error"]
    assert status["quiet"]["state"] == "failed"
    assert "without printing a line that task.log_pattern matches" in status["quiet"]["error"]


def _wait_for(path: Path, launcher: subprocess.Popen, steps: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        row = store.last_metrics_row(path) if path.exists() else None
        if row is not None and row["step"] >= steps and (path / "ckpt.pt").exists():
            return
        assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
        time.sleep(0.1)
    raise AssertionError("the run logged no rows in time")


@pytest.mark.slow
def test_kill_9_then_relaunch_gives_the_rows_of_an_uninterrupted_run(tmp_path):
    """The script writes a CSV log (its own column names) and checkpoints every 10 steps; the
    launcher and its worker are killed with -9 mid-run, the script follows, and a relaunch
    resumes it from its checkpoint: the rows are those of the same script run in one go, in
    tokens (4 a sample)."""
    overrides = ["task.log_file={run_dir}/log.csv", "task.columns={step:iteration,"
                 "loss:train_loss}", "task.examples_per_sample=4", "task.unit=tokens"]
    whole = subprocess.run([PY, str(SCRIPT), "--bs=16", "--lr=0.2", "--seed=0", "--log=csv",
                            "--steps=60", f"--out={tmp_path / 'whole'}"], timeout=120,
                           capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    reference = np.loadtxt(tmp_path / "whole" / "log.csv", delimiter=",", skiprows=1)
    sweep_dir = tmp_path / "sweep"
    command = _command("--log=csv", "--steps=60", "--sleep=0.05")
    args = [PY, "-m", "gnsweep", "launch", "--sweep-dir", str(sweep_dir), "-q", "task=script",
            f"task.command={command}", *GRID, "executor.workers=1", *overrides]
    launcher = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, cwd=tmp_path, env=_env())
    run_id = "b00016_lr0.2_s0"
    _wait_for(sweep_dir / "runs" / run_id, launcher, 25)
    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and its worker; the script follows
    launcher.wait()
    again = _launch(sweep_dir, command, *overrides)
    assert again.returncode == 0, again.stderr
    assert _status(sweep_dir)["state"] == "done"
    history = (sweep_dir / "runs" / run_id / "attempts.jsonl").read_text()
    assert history.count('"event": "start"') == 2
    resumed = _rows(sweep_dir)
    assert list(resumed["step"]) == list(range(1, 61)) == list(reference[:, 0])
    assert list(resumed["loss"]) == list(reference[:, 1])
    assert list(resumed["examples"]) == [16 * 4 * s for s in range(1, 61)]
    log = (sweep_dir / "runs" / run_id / "log.csv").read_text().splitlines()
    # The script's own log holds every step at least once: the killed attempt's rows after
    # its checkpoint (none when the kill fell on a checkpoint) are written again by the resume.
    assert len(log) >= 61


@pytest.mark.slow
def test_the_default_task_as_a_script_gives_the_same_b_crit_and_b_simple(tmp_path, tiny_sweep):
    """task=digits on sweep=tiny (the suite's shared tiny sweep) and the same model in a plain
    script (tests/helpers/script_digits.py, B_simple from `current_run().monitor`) on the same grid:
    the fitted B_crit and the B_simple at each target agree within their standard errors (3
    sigma of the difference; the random streams differ)."""
    script_dir = tmp_path / "script"
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]  # restored after the test (conftest)
    with contextlib.chdir(tmp_path):
        done = runner.invoke(app, ["launch", "--sweep-dir", str(script_dir), "-q", "task=script",
                                   f"task.command={PY} {SCRIPT.with_name('script_digits.py')}",
                                   "sweep=tiny", "executor.workers=2"])
    assert done.exit_code == 0, done.output
    fits = {}
    for name, sweep_dir in (("task", tiny_sweep), ("script", script_dir)):
        result = runner.invoke(app, ["analyze", str(sweep_dir)])
        assert result.exit_code == 0, result.output
        fits[name] = store.read_table(sweep_dir / paths.FITS).to_pandas().set_index("target")
    task, script = fits["task"], fits["script"]
    assert list(task.index) == list(script.index)
    for column in ("b_crit", "b_simple_at_target"):
        difference = (task[column] - script[column]).abs()
        error = np.hypot(task[f"{column}_se"], script[f"{column}_se"])
        assert np.isfinite(script[column]).all(), column
        assert (difference <= 3 * error).all(), (column, task[column], script[column], error)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_script_doing_its_own_ddp_under_executor_torchrun(tmp_path):
    """executor=torchrun starts the command under torchrun with nproc_per_node processes; the
    script's DDP monitor measures B_simple from the ranks' gradients; rank 0 alone writes."""
    sweep_dir = tmp_path / "sweep"
    command = f"{PY} {SCRIPT.with_name('script_ddp.py')} --bs={{batch_size}} --lr={{learning_rate}}"
    done = _launch(sweep_dir, command, "executor=torchrun", "executor.nproc_per_node=2",
                   "sweep.batch_sizes=[32]", "sweep.targets=[0.3]")
    assert done.returncode == 0, done.stderr
    status, rows = _status(sweep_dir), _rows(sweep_dir)
    assert status["state"] == "done" and status["reason"] == "target", status
    (run_id,) = store.run_ids(sweep_dir)
    output = (paths.run_dir(sweep_dir, run_id) / "stdout.log").read_text()
    assert "torch.distributed.run --standalone --nproc_per_node=2" in output
    n = len(rows["step"])
    assert list(rows["step"]) == list(range(1, n + 1))  # one row a step: rank 0 alone wrote
    assert list(rows["examples"]) == [32 * s for s in range(1, n + 1)]
    measured = rows["b_simple"][np.isfinite(rows["b_simple"])]
    assert len(measured) > n // 2 and (measured > 0).all()


# ---- the rows, without a process ------------------------------------------------------------


def _row_log(tmp_path: Path, **sweep) -> tuple[Any, Path]:
    from gnsweep.config import Config
    from gnsweep.runs import RunSpec
    from gnsweep.training.script_rows import RowLog

    config = Config.from_dict({"task": {"name": "script", "command": "python t.py",
                                        "examples_per_sample": 2},
                               "sweep": {"batch_sizes": [8], "learning_rates": [0.1],
                                         "targets": [0.5], **sweep}})
    path = tmp_path / "runs" / "b00008_lr0.1_s0"
    path.mkdir(parents=True)
    options = ScriptOptions(**config.task.options)
    return (lambda: RowLog(config, RunSpec(8, 0.1), path,
                           store.clear_metrics(path, _last(path)), options)), path


def _last(path: Path) -> int:
    row = store.last_metrics_row(path)
    return int(row["step"]) if row else 0


def test_a_resumed_attempt_replaces_the_rows_after_its_first_step(tmp_path):
    make, path = _row_log(tmp_path)
    first = make()
    for step in range(1, 11):
        first.add(f"l{step}", {"step": str(step), "loss": str(2.0 - step / 100)})
    first.flush(force=True)
    assert first.rows["examples"][-1] == 10 * 8 * 2  # step x batch x examples a sample
    with pytest.raises(Exception, match="l12: steps go backwards"):
        first.add("l12", {"step": "4", "loss": "1"})
    again = make()  # the next attempt: the script resumed from its checkpoint at step 6
    assert again.kept_step == 10
    again.add("m1", {"step": "7", "loss": "0.5"})
    again.add("m2", {"step": "8", "loss": "0.4"})
    again.flush(force=True)
    table = store.read_metrics(path)
    assert table is not None
    assert table.column("step").to_pylist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert table.column("loss").to_pylist()[-2:] == [0.5, 0.4]



def test_a_resume_from_a_checkpoint_ahead_of_the_rows_says_which_steps_have_none(tmp_path,
                                                                                   capsys):
    make, _ = _row_log(tmp_path)
    first = make()
    for step in range(1, 6):
        first.add("l", {"step": step, "loss": 1.0})
    first.flush(force=True)
    again = make()  # killed at step 5 with rows on disk; the checkpoint was at step 8
    again.add("m1", {"step": 9, "loss": 0.9})
    assert "steps 6-8 have no rows" in capsys.readouterr().err


def test_rows_stop_at_the_budget_and_many_flushes_stay_few_parts(tmp_path, monkeypatch):
    from gnsweep.training import script_rows as script

    monkeypatch.setattr(script, "FLUSH_S", 0.0)
    monkeypatch.setattr(script, "COMPACT_PARTS", 5)
    make, path = _row_log(tmp_path, max_steps=12)
    rows = make()
    for step in range(1, 13):
        rows.add("x", {"step": step, "loss": 1.0})
        rows.flush()
    assert rows.reason == "max_steps"
    assert len(store.metric_parts(path)) < 5
    table = store.read_metrics(path)
    assert table is not None and table.column("step").to_pylist() == list(range(1, 13))


def test_a_log_file_is_read_as_it_grows_and_a_missing_column_is_named(tmp_path):
    from gnsweep.errors import ScriptFailed
    from gnsweep.training.script_rows import TableLog

    path = tmp_path / "log.csv"
    path.write_text("iter,train_loss\n1,0.5\n2,0.4")  # the last line not yet complete
    log = TableLog(path, "csv", {"step": "iter", "loss": "train_loss"}, skip_existing=False)
    assert [raw for _, raw, _ in log.rows()] == [{"step": "1", "loss": "0.5"}]
    with path.open("a") as handle:
        handle.write("5\n3,0.3\n")
    assert [(where, raw["step"]) for where, raw, _ in log.rows()] == \
        [(f"{path}:3", "2"), (f"{path}:4", "3")]
    path.write_text("iter,loss\n1,0.5\n")  # rewritten: read from its start again
    wrong = TableLog(path, "csv", {"loss": "train_loss"}, skip_existing=False)
    with pytest.raises(ScriptFailed, match="no column 'train_loss'"):
        list(wrong.rows())


def test_current_run_is_none_outside_a_sweep(monkeypatch):
    import gnsweep

    monkeypatch.delenv("GNSWEEP_RUN_DIR", raising=False)
    assert gnsweep.current_run() is None


@pytest.mark.parametrize(("executor", "expected"), [
    ({"kind": "local"}, ["python", "train.py", "--bs=8"]),
    ({"kind": "torchrun", "nproc_per_node": 4},
     ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "train.py",
      "--bs=8"]),
    ({"kind": "slurm", "nproc_per_node": 1}, ["python", "train.py", "--bs=8"]),
])
def test_the_command_under_each_executor(executor, expected):
    from gnsweep.config import Config
    from gnsweep.tasks.script import example_values
    from gnsweep.training.script_command import command, torchrun_args

    config = Config.from_dict({"task": {"name": "script",
                                        "command": "python train.py --bs={batch_size}"},
                               "sweep": {"batch_sizes": [8]}, "executor": executor})
    assert command(config, example_values()) == expected
    assert torchrun_args(["./run.sh", "x"], 2)[-3:] == ["--no-python", "./run.sh", "x"]


def test_a_multi_node_slurm_script_sweep_is_refused():
    from gnsweep.config import Config

    with pytest.raises(ConfigError, match=r"sweep\.schedule=adaptive with task=script"):
        Config.from_dict({"task": {"name": "script", "command": "python t.py"},
                          "sweep": {"batch_sizes": [8], "schedule": "adaptive",
                                    "exchange_rates": [10], "eps_max": 0.1}})
    with pytest.raises(ConfigError, match=r"executor\.nodes=2 with task=script"):
        Config.from_dict({"task": {"name": "script", "command": "python t.py"},
                          "sweep": {"batch_sizes": [8]},
                          "executor": {"kind": "slurm", "nodes": 2, "nproc_per_node": 1}})


@pytest.mark.slow
def test_a_hugging_face_trainer_script_with_the_callback_sweeps(tmp_path):
    """tests/helpers/script_hf.py: a Trainer script whose only gnsweep line is the callback; its
    rows (one a step) carry B_simple, and the sweep stops it at the target."""
    pytest.importorskip("transformers")
    sweep_dir = tmp_path / "sweep"
    command = (f"{PY} {SCRIPT.with_name('script_hf.py')} --bs={{batch_size}} "
               "--lr={learning_rate} --out={run_dir}/hf")
    done = _launch(sweep_dir, command, "sweep.batch_sizes=[32]", "sweep.learning_rates=[0.2]",
                   "sweep.targets=[2.0]")
    assert done.returncode == 0, done.stderr
    status, rows = _status(sweep_dir), _rows(sweep_dir)
    assert status["state"] == "done" and status["reason"] == "target", status
    n = len(rows["step"])
    assert list(rows["step"]) == list(range(1, n + 1)) and n < 200
    assert list(rows["examples"]) == [32 * s for s in range(1, n + 1)]
    assert np.all(rows["lr"] == 0.2)
    measured = rows["b_simple"][np.isfinite(rows["b_simple"])]
    assert len(measured) >= n - 1 and (measured > 0).all()


def test_a_json_lines_log_is_read_with_its_names_mapped(tmp_path):
    from gnsweep.errors import ScriptFailed
    from gnsweep.tasks.script import log_format
    from gnsweep.training.script_rows import TableLog

    options = ScriptOptions(command="python t.py", log_file="{run_dir}/log.jsonl")
    assert log_format(options, "x/log.jsonl") == "jsonl" and log_format(options, "a.csv") == "csv"
    path = tmp_path / "log.jsonl"
    path.write_text('{"iter": 1, "train_loss": 0.5, "val": 0.6}\n{"iter": 2, "val": 0.55}\n'
                    "not json\n")
    log = TableLog(path, "jsonl", {"step": "iter", "loss": "train_loss", "eval_loss": "val"},
                   skip_existing=False)
    rows = log.rows()
    assert next(rows)[1] == {"step": 1, "loss": 0.5, "eval_loss": 0.6}
    assert next(rows)[1] == {"step": 2, "eval_loss": 0.55}  # no loss: RowLog skips it
    with pytest.raises(ScriptFailed, match=r"log\.jsonl:3: not a JSON object"):
        next(rows)


def test_automatic_targets_train_the_budget(tmp_path):
    """sweep.targets=auto: no target to stop at, so the run trains its budget; {target} and
    {targets} are empty."""
    from gnsweep.runs import RunSpec
    from gnsweep.training.script_command import placeholder_values

    make, path = _row_log(tmp_path, targets=[], max_steps=30)
    rows = make()
    for step in range(1, 31):
        rows.add("x", {"step": step, "loss": 0.001})  # far below any loss target
        assert rows.reason == (None if step < 30 else "max_steps")
    values = placeholder_values(rows.config, RunSpec(8, 0.1), path, 0, 1)
    assert values["target"] == "" and values["targets"] == ""


def test_a_fixed_budget_trains_past_its_targets(tmp_path):
    """sweep.budget: the targets stay (for the analysis) but no run stops at them; the run
    trains its budget in examples, and {target} is empty, {max_examples} the budget."""
    from gnsweep.runs import RunSpec
    from gnsweep.training.script_command import placeholder_values

    make, path = _row_log(tmp_path, budget=480)  # 8 samples x 2 examples a step: 30 steps
    rows = make()
    for step in range(1, 31):
        rows.add("x", {"step": step, "loss": 0.001})  # far below the target 0.5
        assert rows.reason == (None if step < 30 else "max_examples")
    values = placeholder_values(rows.config, RunSpec(8, 0.1), path, 0, 1)
    assert values["target"] == "" and values["targets"] == "0.5"
    assert values["max_examples"] == 480


def test_rows_an_earlier_attempt_printed_but_never_wrote_are_recovered(tmp_path):
    """A worker killed between two flushes: its run's stdout.log still holds the lines; they
    are read as the run read them live (a step going back is a resume)."""
    from gnsweep.tasks.script import example_values, pattern_columns
    from gnsweep.training.script_runner import recovered

    (tmp_path / "stdout.log").write_text(
        "--- gnsweep attempt 1: python t.py\n"
        + "".join(f"step {s} loss {1 / s}\n" for s in range(1, 9))
        + "--- gnsweep attempt 2: python t.py\n"
        + "".join(f"step {s} loss {2 / s}\n" for s in range(6, 11)))
    options = ScriptOptions(command="python t.py", log_pattern=r"step (?P<step>\d+) loss "
                            r"(?P<loss>\S+)")
    rows = recovered(options, example_values(), str(tmp_path), tmp_path,
                     pattern_columns(options.log_pattern), after=4)
    assert [(raw["step"], float(raw["loss"])) for _, raw in rows] == \
        [("5", 1 / 5)] + [(str(s), 2 / s) for s in range(6, 11)]
    assert rows[0][0] == f"{tmp_path / 'stdout.log'}:6"
