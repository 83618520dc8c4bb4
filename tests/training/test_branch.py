"""Branch runs (gnsweep.training.branch_start): a run built for a branch point starts from the base
run's saved model and optimizer state, at its own learning rate, with its own counters, smoother,
monitor and data; its first update is the one the base run's optimizer state dictates."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from gnsweep.config import (
    BranchConfig,
    Config,
    ConfigError,
    SweepConfig,
    TaskConfig,
    TrainConfig,
)
from gnsweep.folder import read_config
from gnsweep.runs import RunSpec, parse_run_record, run_config
from gnsweep.training import StopRequested, TrainState, build_run, run, train
from gnsweep.training.branch_start import start_branch
from gnsweep.training.checkpoint import Checkpointer
from gnsweep.training.data import DataSource

BASE = Config(task=TaskConfig(name="linreg", options={"dim": 8}),
              sweep=SweepConfig(batch_sizes=[16], learning_rates=[0.05], targets=[1e-9],
                                max_steps=12), train=TrainConfig(optimizer="adam"))


def _base_state(tmp_path: Path, steps: int = 10) -> tuple[TrainState, Path]:
    """A base run stopped after `steps` updates, its state saved as a checkpoint."""
    state = build_run(BASE, RunSpec(16, 0.05, 0))
    with pytest.raises(StopRequested):
        run(state, should_stop=lambda: state.step >= steps)
    saved = Checkpointer(tmp_path / "base").save(state)  # as the base run keeps one
    assert saved is not None
    return state, saved.path


def _branch_config(base: TrainState, path: Path, **sweep) -> Config:
    point = {"at_examples": base.examples, "at_step": base.step, "at_loss": 1.0,
             "b_simple": math.nan, "b_noise": math.nan, "checkpoint": str(path)}
    return dataclasses.replace(
        BASE, sweep=dataclasses.replace(BASE.sweep, **sweep),
        branch=BranchConfig(base=str(path.parent), points=[point]))


def test_a_branch_run_starts_from_the_base_runs_model_and_optimizer(tmp_path):
    torch.set_num_threads(1)
    base, path = _base_state(tmp_path)
    config = _branch_config(base, path, batch_sizes=[32], learning_rates=[0.01], max_steps=3)
    spec = RunSpec(32, 0.01, 7, at_examples=base.examples)
    branch = build_run(config, spec)
    start_branch(branch)  # as `train` does for a run with a branch point
    # Kept: parameters and Adam's moments and step count; reset: the learning rate, counters,
    # smoother, rows.
    for mine, theirs in zip(branch.model.parameters(), base.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    saved = base.optimizer.state_dict()["state"]
    loaded = branch.optimizer.state_dict()["state"]
    for key, value in saved.items():
        assert torch.equal(loaded[key]["exp_avg_sq"], value["exp_avg_sq"])
        assert float(loaded[key]["step"]) == base.step
    assert [g["lr"] for g in branch.optimizer.param_groups] == [0.01]
    assert (branch.step, branch.examples, branch.rows["step"]) == (0, 0, [])
    assert math.isnan(branch.watch.first)

    # Its first update is Adam's 11th from the base run's moments, on the branch's own batch
    # (a fresh Adam would take a bias-corrected first step instead: a different update).
    expected = copy.deepcopy(base.model)
    adam = torch.optim.Adam(expected.parameters(), lr=0.01)
    adam.load_state_dict(base.optimizer.state_dict())
    for group in adam.param_groups:
        group["lr"] = 0.01
    batch = DataSource(branch.task, 7, 1, 0, torch.device("cpu")).draw(32)
    adam.zero_grad()
    first_loss = branch.task.loss(expected, batch)
    first_loss.backward()
    adam.step()
    with pytest.raises(StopRequested):
        run(branch, should_stop=lambda: branch.step >= 1)
    assert branch.rows["loss"][0] == pytest.approx(float(first_loss.detach()), rel=1e-6)
    for mine, theirs in zip(branch.model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    fresh = copy.deepcopy(base.model)  # what a reset optimizer would have done
    fresh_adam = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_adam.zero_grad()
    branch.task.loss(fresh, batch).backward()
    fresh_adam.step()
    assert not torch.allclose(next(fresh.parameters()), next(branch.model.parameters()))


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path):
    base, path = _base_state(tmp_path, steps=2)
    config = _branch_config(base, path)
    other = dataclasses.replace(config, task=TaskConfig(name="linreg", options={"dim": 4}))
    with pytest.raises(ConfigError, match="does not fit this run's model") as err:
        train(other, RunSpec(16, 0.05, 0, at_examples=base.examples), None)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no branch point at 5 examples"):
        train(config, RunSpec(16, 0.05, 0, at_examples=5), None)


def test_branch_targets_are_fractions():
    with pytest.raises(ConfigError, match="not a fraction"):
        BranchConfig(targets=[0.9, 1.5])
    assert RunSpec(16, 0.05, 0, at_examples=160).run_id == "at160_b00016_lr0.05_s0"


# ---- `gnsweep branch` from a base run that kept checkpoints --------------------------------

LINREG = ["task=linreg", "task.dim=8", "sweep=linreg", "sweep.eval_every=1",
          "analysis.loss=eval"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    from branch_base import make_base_run

    return make_base_run(tmp_path_factory.mktemp("base") / "sweep",
                         [*LINREG, "sweep.batch_sizes=[16]", "sweep.learning_rates=[0.5]",
                          "sweep.targets=[0.13]", "sweep.max_steps=60"], [160, 640])


@pytest.mark.parametrize(("args", "expected"), [
    (["--at", "100"], "no checkpoint kept at or before 100 examples (kept: 160, 640)"),
    (["--at", "1000", "task.dim=4"], "this changes them (task.options.dim: 8 -> 4)"),
    (["--at", "1000", "train.optimizer=adam"], "train.optimizer: 'sgd' -> 'adam'"),
    (["--at", "1000", "train.warmup_examples=64"], "drop train.warmup_steps/warmup_examples"),
    (["--at", "ten"], "--at: 'ten' is not a number of examples"),
    (["--at", "1000", "branch.targets=[0.9,1.1]"], "branch.targets: 1.1 is not a fraction"),
])
def test_branch_mistakes_are_one_line_and_exit_2(base_run, tmp_path, args, expected):
    from typer.testing import CliRunner

    from gnsweep.cli import app

    out = tmp_path / "branch"
    result = CliRunner().invoke(app, ["branch", str(base_run), "--sweep-dir", str(out), *LINREG,
                                      *args])
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (out / "runs").exists()


@pytest.mark.slow
def test_branch_sweep_end_to_end_and_resumed(base_run, tmp_path):
    """Two branch points x a 3 x 2 grid through the CLI: runs under D/runs start at their point
    (the first logged examples count from zero), analyze writes along.parquet, plot draws the
    along figure, the report has its section, and the same command again runs nothing."""
    from typer.testing import CliRunner

    from gnsweep import paths, store
    from gnsweep.cli import app

    out = tmp_path / "branch"
    args = ["branch", str(base_run), "--at", "200,700", "--sweep-dir", str(out), *LINREG,
            "sweep.batch_sizes=[4,16,64]", "sweep.learning_rates=[0.3,0.6]",
            "branch.targets=[0.8,0.6]", "--workers", "2", "-q"]
    runner = CliRunner()
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    ids = store.run_ids(out)
    assert len(ids) == 12 and {i.split("_")[0] for i in ids} == {"at160", "at640"}
    config = read_config(out)
    assert [p["at_step"] for p in config.branch.points] == [10, 40]
    config_run, spec = parse_run_record(store.read_json(paths.run_dir(out, ids[0])
                                                        / paths.RUN_CONFIG))
    at_loss = config.branch.points[0]["at_loss"]
    assert run_config(config_run, spec).sweep.targets == pytest.approx([0.8 * at_loss,
                                                                         0.6 * at_loss])
    metrics = store.read_table(paths.run_dir(out, ids[0]) / paths.METRICS).to_pandas()
    assert metrics["step"].iloc[0] == 1 and metrics["examples"].iloc[0] == 4

    assert runner.invoke(app, ["analyze", str(out)]).exit_code == 0
    along = store.read_table(out / "along.parquet").to_pandas()
    assert len(along) == 4 and set(along["target"]) == {0.8, 0.6}
    assert runner.invoke(app, ["plot", str(out)]).exit_code == 0
    assert (out / "figures" / "bcrit_along_training.png").is_file()
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0
    assert "Critical batch size along training" in (out / "report.html").read_text()

    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "0 done, 0 diverged, 0 failed this launch" in again.output


@pytest.mark.slow
def test_branch_runs_find_the_exact_local_b_crit_on_linreg(tmp_path):
    """Real branch runs (`prepare_branch`, then `training.train` on each run's record, then
    `gnsweep analyze`'s along analysis) from three kept checkpoints of a linreg base run: the
    local B_crit within 25% of the exact one from each checkpoint's own parameters
    (`linreg_exact.local_truth`) and within a factor 2 of the exact B_noise on the way there."""
    import numpy as np
    from branch_base import make_base_run

    from gnsweep import paths, store
    from gnsweep.branching import prepare_branch
    from gnsweep.folder import read_run
    from gnsweep.linreg_exact import local_truth
    from gnsweep.sweep_analysis import analyze_sweep
    from gnsweep.tasks import make_task

    task = ["task=linreg", "task.dim=32", "task.teacher_power=1.0", "sweep=linreg",
            "sweep.eval_every=1", "analysis.loss=eval"]
    base = make_base_run(tmp_path / "base", [*task, "sweep.batch_sizes=[16]",
                                             "sweep.learning_rates=[0.5]", "sweep.targets=[0.13]",
                                             "sweep.max_steps=200"], [256, 512, 1024])
    out = tmp_path / "along"
    batches = [4, 8, 16, 32, 64, 128, 256]
    config, specs = prepare_branch(base, [256, 512, 1024], out, [
        *task[4:], f"sweep.batch_sizes={batches}".replace(" ", ""),
        "sweep.learning_rates=[0.293,0.431,0.632,0.928,1.36,2.0]", "branch.targets=[0.6]",
        "sweep.max_steps=400"])
    for spec in specs:
        run_config, _ = read_run(out, spec.run_id)
        folder = paths.run_dir(out, spec.run_id)
        result = train(run_config, spec, folder)
        store.write_status(folder, result.state, reason=result.reason)
    along = analyze_sweep(out, write=False).along
    problem = make_task("linreg", config.task.options, 0).exact_problem()
    good = 0
    for point in config.branch.points:
        model = torch.load(point["checkpoint"], weights_only=True)["model"]
        w_star = make_task("linreg", config.task.options, 0).w_star.numpy()
        delta = np.concatenate([model["weight"].double().numpy().ravel() - w_star,
                                model["bias"].double().numpy()])
        (row,) = along[along["at_examples"] == point["at_examples"]].itertuples()
        exact = local_truth(problem, delta, batches, [row.target_value], max_steps=3000)
        (truth,) = exact.per_target
        assert 0.5 < row.b_crit / truth.b_noise_mean < 2.0, point
        good += abs(row.b_crit / truth.b_crit_fit - 1) < 0.25
    assert good >= 3


def test_branch_dry_run_lists_done_and_pending_runs_and_writes_nothing(base_run, tmp_path):
    """`gnsweep branch --dry-run` names each branch run with its point and state, trains and
    writes nothing; after one run has finished, the same dry run says it is done."""
    from typer.testing import CliRunner

    from gnsweep import paths, store
    from gnsweep.branching import prepare_branch
    from gnsweep.cli import app
    from gnsweep.folder import read_run

    out = tmp_path / "branch"
    grid = ["sweep.batch_sizes=[4,16]", "sweep.learning_rates=[0.3]"]
    args = ["branch", str(base_run), "--at", "200,700", "--sweep-dir", str(out), *LINREG,
            *grid, "--dry-run"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "4 runs (0 done, 4 to run); automatic targets" in result.output
    assert result.output.count("pending") == 4 and "at160_b00004_lr0.3_s0" in result.output
    assert not out.exists()

    _, specs = prepare_branch(base_run, [200, 700], out, [*LINREG, *grid])
    first = specs[0]
    config, spec = read_run(out, first.run_id)
    folder = paths.run_dir(out, first.run_id)
    store.write_status(folder, train(config, spec, folder).state)
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "(1 done, 3 to run)" in again.output
    assert f"{first.run_id}" in again.output and again.output.count("pending") == 3


def test_automatic_branch_runs_train_one_window_of_examples(base_run, tmp_path):
    """Without branch.targets a branch run stops at no target: each trains window_steps steps
    of the largest batch size's examples (a batch 4x smaller: 4x the steps), evaluating about
    32 times; with branch.targets a run still stops at its point's hardest one."""
    from gnsweep.branching import prepare_branch
    from gnsweep.folder import read_run

    out = tmp_path / "branch"
    config, specs = prepare_branch(base_run, [700], out, [
        *LINREG[2:], "sweep.batch_sizes=[4,16]", "sweep.learning_rates=[0.3]",
        "branch.window_steps=8"])
    assert config.analysis.loss == "eval" and config.branch.automatic
    budgets = {}
    for spec in specs:
        run_cfg, spec = read_run(out, spec.run_id)
        trained = run_config(run_cfg, spec)
        result = train(run_cfg, spec, tmp_path / spec.run_id)
        budgets[spec.batch_size] = (trained.sweep.max_steps, result.reason, result.steps)
    assert budgets == {4: (32, "max_steps", 32), 16: (8, "max_steps", 8)}


def test_a_custom_task_branches_without_sweep_targets(tmp_path):
    """A custom task's branch sweep names its batch sizes and learning rates; its targets are
    relative (branch.targets or automatic), so no sweep.targets is asked for."""
    from branch_base import make_base_run

    from gnsweep.branching import branch_config

    task = ["task=custom", "task._target_=protocol_tasks.make", "sweep.batch_sizes=[8]",
            "sweep.learning_rates=[0.05]", "sweep.targets=[0.01]", "sweep.max_steps=20"]
    base = make_base_run(tmp_path / "base", task, [80])
    base_config, _ = parse_run_record(__import__("json").loads(
        (base / "config.json").read_text()))
    config = branch_config(base_config, ["task=custom", "task._target_=protocol_tasks.make",
                                         "sweep.batch_sizes=[4,16]",
                                         "sweep.learning_rates=[0.05]"])
    assert config.sweep.batch_sizes == [4, 16] and config.branch.automatic
    with pytest.raises(ConfigError, match=r"sweep\.learning_rates") as err:
        branch_config(base_config, ["sweep.batch_sizes=[4,16]"])
    assert "sweep.targets" not in str(err.value)
