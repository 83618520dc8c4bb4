"""The task protocol: a user's task by `_target_`, checked before anything runs (exit 2), runs
that raise (exit 1), the optimizer registry, micro-batches of dict batches, examples counted per
step."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from locations import HELPERS, ROOT
from typer.testing import CliRunner

from gnsweep import config as config_module
from gnsweep import paths, store
from gnsweep.cli import app
from gnsweep.config import Config, NoiseConfig, SweepConfig, TaskConfig, TrainConfig
from gnsweep.folder import read_config
from gnsweep.measure import NoiseScaleMonitor, hessian_norms
from gnsweep.measure.common import split_batch
from gnsweep.runs import RunSpec
from gnsweep.tasks import about, make_task
from gnsweep.training import recipe as optim
from gnsweep.training import train
from gnsweep.training.backward import backward

runner = CliRunner()


@pytest.fixture
def clean_env(monkeypatch):
    """The custom-task resolver puts the cwd on sys.path and PYTHONPATH: undo it after."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))


@pytest.mark.parametrize(("target", "expected"), [
    ("no_such_module_xyz.make", "no module named 'no_such_module_xyz'"),
    ("protocol_tasks.not_callable", "not a callable"),
    ("protocol_tasks.missing_function", "has no 'missing_function'"),
    ("protocol_tasks.vector_loss", "scalar"),
    ("protocol_tasks.frozen", "no trainable parameters"),
    ("protocol_tasks.foreign_noise_parameters", "not trainable parameters of the model"),
    ("protocol_tasks.no_data", "has neither dataset() nor sample"),
    ("protocol_tasks.not_a_dataset", "dataset() returned a list, not a map-style"),
])
def test_bad_tasks_exit_2_and_start_nothing(target, expected, tmp_path, clean_env):
    out = tmp_path / "sweep"
    result = runner.invoke(app, ["launch", "task=custom", f"task._target_={target}",
                                 "sweep.batch_sizes=[8]", "sweep.learning_rates=[0.1]",
                                 "sweep.targets=[0.1]", "--sweep-dir", str(out), "-q"])
    assert result.exit_code == 2, result.output
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize("grid", [[], ["sweep.batch_sizes=[8]"]])
def test_a_custom_task_without_a_grid_of_its_own_is_refused(grid, tmp_path, clean_env):
    """Not the digits task's grid, silently: exit 2, asking for a grid. Its loss targets are
    not asked for: they default to auto (chosen from the runs)."""
    out = tmp_path / "s"
    result = runner.invoke(app, ["launch", "task=custom", "task._target_=protocol_tasks.make",
                                 *grid, "--sweep-dir", str(out), "-q"])
    assert result.exit_code == 2, result.output
    assert "task=custom needs a grid of its own (" + ("sweep.batch_sizes, " if not grid
                                                      else "") in result.stderr
    assert "sweep.learning_rates" in result.stderr and "sweep=NAME" in result.stderr
    assert "sweep.targets" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()
    # A sweep file, or the batch sizes and learning rates (targets auto), are a grid.
    for given, targets in ((["sweep=tiny"], "targets 0.5,0.3,0.2"),
                           (["sweep.batch_sizes=[8]", "sweep.learning_rates=[0.1]"],
                            "targets auto (from the runs)"),
                           (["sweep.batch_sizes=[8]", "sweep.learning_rates=[0.1]",
                             "sweep.targets=[0.3,0.1,0.03]"], "targets 0.3,0.1,0.03")):
        result = runner.invoke(app, ["launch", "task=custom", "--dry-run",
                                     "task._target_=protocol_tasks.make", *given])
        assert result.exit_code == 0, result.output
        assert targets in result.output


def test_custom_task_without_target_is_refused(tmp_path):
    result = runner.invoke(app, ["launch", "task=custom", "--sweep-dir", str(tmp_path / "s")])
    assert result.exit_code == 2
    assert "task._target_=" in result.stderr


def _launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS)]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "gnsweep", "launch", *args, "-q"], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_launch_exits_1_naming_the_run_whose_user_code_raised(tmp_path):
    result = _launch(["task=custom", "task._target_=protocol_tasks.raises_later",
                      "sweep.batch_sizes=[8]", "sweep.learning_rates=[0.1]",
                      "sweep.targets=[0.01]", "sweep.max_retries=0", "--workers", "1",
                      "--sweep-dir", str(tmp_path / "s")], tmp_path)
    assert result.returncode == 1, result.stderr
    assert "b00008_lr0.1_s0" in result.stderr
    # The first line names the grid it runs; with every run failed, nothing to analyze.
    assert result.stdout.splitlines()[0] == (
        "sweep protocol_tasks.raises_later: task protocol_tasks.raises_later, 1 runs (batch "
        f"sizes 8 x learning rates 0.1 x seeds 0; targets 0.01) -> {tmp_path / 's'}")
    assert "next: gnsweep analyze" not in result.stdout
    status = store.read_status(tmp_path / "s" / "runs" / "b00008_lr0.1_s0")
    assert status["state"] == "failed"
    assert "boom: the user's loss fails on purpose" in status["error"]


@pytest.mark.slow
def test_launch_exits_0_and_finds_a_module_in_the_working_directory(tmp_path):
    (tmp_path / "cwd_task_mod.py").write_text((HELPERS / "protocol_tasks.py").read_text())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "gnsweep", "launch", "task=custom",
         "task._target_=cwd_task_mod.make", "+task.dim=3", "sweep.batch_sizes=[8]",
         "sweep.learning_rates=[0.1]", "sweep.targets=[0.01]", "sweep.max_steps=20",
         "--workers", "1", "-q",
         "--sweep-dir", "s"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr
    assert "1 done" in result.stdout


def test_the_optimizer_registry_matches_the_config_and_steps_as_its_update_rule():
    assert tuple(optim.REGISTRY) == config_module.OPTIMIZERS
    lr, g1, g2 = 0.1, torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5])
    for name in config_module.OPTIMIZERS:
        p = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
        opt = optim.make_optimizer(name, [p], lr=lr, train=TrainConfig(weight_decay=0.01))
        p.grad = g1.clone()
        opt.step()
        if name in ("sgd", "momentum"):
            expected1 = 1.0 - lr * (g1 + 0.01)  # L2: weight decay 0.01 x p (= 1) added to g
        elif name == "adam":
            # L2 added to g before normalising: bias-corrected m / sqrt(v) = sign(g + 0.01 p).
            expected1 = 1.0 - lr * (g1 + 0.01).sign()
        else:
            expected1 = 1.0 * (1 - lr * 0.01) - lr * g1.sign()  # decoupled weight decay 0.01
        torch.testing.assert_close(p.detach(), expected1, rtol=0, atol=1e-6)
        if name == "momentum":
            p.grad = g2.clone()
            opt.step()
            # Heavy ball, mu = 0.9, on the gradients with the L2 term: v = 0.9 d1 + d2.
            d1, d2 = g1 + 0.01, g2 + 0.01 * expected1
            torch.testing.assert_close(p.detach(), expected1 - lr * (0.9 * d1 + d2))
    with pytest.raises(ValueError, match="choose one of"):
        optim.make_optimizer("lion", [torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_split_batch_cuts_dicts_tuples_and_lists_along_dim_0():
    batch = {"x": torch.arange(10.0).reshape(5, 2), "pair": (torch.arange(5), [torch.ones(5)]),
             "name": "kept"}
    parts = split_batch(batch, 2)
    assert parts is not None and [len(p["x"]) for p in parts] == [2, 3]
    torch.testing.assert_close(torch.cat([p["x"] for p in parts]), batch["x"])
    torch.testing.assert_close(torch.cat([p["pair"][0] for p in parts]), batch["pair"][0])
    assert all(isinstance(p["pair"][1], list) and p["name"] == "kept" for p in parts)
    assert split_batch({"x": torch.ones(4), "y": torch.ones(3)}, 2) is None
    assert split_batch(torch.ones(3), 4) is None
    assert split_batch(["no tensor"], 2) is None


def test_micro_batches_of_a_dict_batch_give_the_batch_mean_gradient(clean_env):
    """The batch-mean loss is the size-weighted mean of the micro-batch means, so the summed
    weighted gradients equal the whole batch's gradient."""
    task = make_task("custom", {"_target_": "protocol_tasks.make"}, seed=0)
    batch = task.sample(10, torch.Generator().manual_seed(1))
    model = task.model()
    task.loss(model, batch).backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    monitor = NoiseScaleMonitor(model, "microbatch")
    loss = backward(model, task, batch, 3, monitor)
    for p, g in zip(model.parameters(), whole, strict=True):
        torch.testing.assert_close(p.grad, g)
    assert math.isclose(loss, float(task.loss(model, batch).detach()), rel_tol=1e-5)
    assert monitor.step() is not None  # three micro-batches measured
    monitor.close()


@pytest.mark.parametrize("method", ["per_example", "microbatch"])
def test_examples_are_counted_per_step_in_the_tasks_unit(method, tmp_path, clean_env):
    config = Config(task=TaskConfig("custom", {"_target_": "protocol_tasks.make",
                                               "per_sample": 3}),
                    sweep=SweepConfig(batch_sizes=[8], learning_rates=[0.05], targets=[1e-9],
                                      max_steps=7, eval_every=0),
                    noise=NoiseConfig(method=method, hessian_every=2))
    result = train(config, RunSpec(8, 0.05, 0), tmp_path)
    assert result.steps == 7 and result.reason == "max_steps"
    metrics = store.read_table(tmp_path / paths.METRICS).to_pandas()
    assert metrics["examples"].tolist() == [24 * s for s in range(1, 8)]
    # The noise scales are in the task's unit: b_big = 8 samples x 3 examples each.
    assert metrics["b_big"].iloc[-1] == 24
    assert metrics["b_noise"].notna().any()  # the Hessian ran on the task's loss


def test_max_examples_budget_counts_the_tasks_unit(tmp_path, clean_env):
    config = Config(task=TaskConfig("custom", {"_target_": "protocol_tasks.make",
                                               "per_sample": 4}),
                    sweep=SweepConfig(batch_sizes=[8], learning_rates=[0.05], targets=[1e-9],
                                      max_steps=100, max_examples=96))
    result = train(config, RunSpec(8, 0.05, 0), None)
    assert (result.steps, result.reason) == (3, "max_examples")  # 3 steps x 32 examples


def test_a_stop_request_is_its_own_exception(tmp_path):
    from gnsweep.errors import StopRequested

    config = Config(sweep=SweepConfig(batch_sizes=[8], learning_rates=[0.1], max_steps=50))
    with pytest.raises(StopRequested):
        train(config, RunSpec(8, 0.1, 0), None, should_stop=lambda: True)
    assert not issubclass(StopRequested, KeyboardInterrupt)


def test_linreg_eval_loss_is_the_exact_population_loss():
    """0.5 E[(w.x + b - y)^2] = 0.5 (dw^T diag(lam) dw + b^2 + noise^2), checked against a
    large Monte-Carlo sample."""
    task = make_task("linreg", {"dim": 4, "condition": 10.0, "noise": 0.5}, seed=0)
    model = task.model()
    exact = task.eval_loss(model)
    with torch.no_grad():
        x, y = task.sample(400_000, torch.Generator().manual_seed(3))
        sampled = float(task.output_loss(model(x), y))
    assert math.isclose(exact, sampled, rel_tol=0.01)
    w = model.weight.detach().double().reshape(-1) - task.w_star
    expected = 0.5 * (float((w * task.variances * w).sum()) + float(model.bias) ** 2 + 0.25)
    assert math.isclose(exact, expected, rel_tol=1e-9)


@pytest.mark.parametrize("name", ["mnist1d", "chars", "vae", "cartpole"])
def test_new_tasks_compose_and_pass_the_launch_check(name):
    from gnsweep.compose import compose
    from gnsweep.tasks.launch_check import check_task

    pytest.importorskip({"mnist1d": "mnist1d", "cartpole": "gymnasium"}.get(name, "torch"))
    overrides = [f"task={name}", f"sweep={name}"]
    if name == "chars":
        overrides += ["task.width=16", "task.heads=2", "task.depth=1", "task.context=8"]
    config = compose(overrides)
    assert config.task.name == name and config.sweep.name == name  # one choice of each group
    check_task(config.task.name, config.task.options)


def test_microbatch_method_on_an_unsplittable_batch_falls_back_said_once(tmp_path, clean_env,
                                                                        caplog):
    config = Config(task=TaskConfig("custom", {"_target_": "protocol_tasks.unsplittable"}),
                    sweep=SweepConfig(batch_sizes=[8], learning_rates=[0.05], targets=[1e-9],
                                      max_steps=5),
                    noise=NoiseConfig(method="microbatch"))
    with caplog.at_level("WARNING", logger="gnsweep.measure"):
        result = train(config, RunSpec(8, 0.05, 0), tmp_path)
    assert result.steps == 5
    assert sum("cannot be split" in r.getMessage() for r in caplog.records) == 1
    metrics = store.read_table(tmp_path / paths.METRICS).to_pandas()
    assert (metrics["b_small"] == 1).all()  # per-example norms


@pytest.mark.slow
def test_the_analysis_sees_batch_sizes_in_the_tasks_unit(tmp_path):
    """A task counting 3 tokens a sample: the steps table's batch_size is 3 x the grid's, and
    examples = steps x batch_size; a run without metrics takes the sweep's ratio. The unit the
    task declares (`unit = "tokens"`) is recorded in the sweep's config."""
    from gnsweep.analysis.steps import steps_to_target
    from gnsweep.folder import load_curves

    result = _launch(["task=custom", "task._target_=protocol_tasks.tokens", "+task.per_sample=3",
                      "sweep.batch_sizes=[4,8]", "sweep.learning_rates=[0.05]",
                      "sweep.targets=[3.5,1e-9]", "sweep.max_steps=6", "--workers", "1",
                      "--sweep-dir", str(tmp_path / "s")], tmp_path)
    assert result.returncode == 0, result.stderr
    missing = tmp_path / "s" / "runs" / "b00008_lr0.05_s0" / paths.METRICS
    missing.unlink()
    curves = load_curves(tmp_path / "s")
    assert curves.runs.set_index("run_id")["batch_size"].to_dict() == {
        "b00004_lr0.05_s0": 12, "b00008_lr0.05_s0": 24}
    # The raw loss: six steps of 4 samples never fill the smoothing window.
    steps = steps_to_target(curves, None, [3.5], loss="raw")
    row = steps[steps["run_id"] == "b00004_lr0.05_s0"].iloc[0]
    assert row["reached"] and row["examples"] == row["steps"] * 12
    # What the analysis, figures, report and compare read (docs/recipes.md's test runs them).
    assert about(read_config(tmp_path / "s").task).unit == "tokens"


class _Prototypes(torch.nn.Module):
    """Logits from distances to learned prototypes: `torch.cdist` has no double backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 3)
        self.prototypes = torch.nn.Parameter(torch.randn(5, 3))

    def forward(self, x):
        return -torch.cdist(self.embed(x), self.prototypes)


def test_b_noise_on_a_model_without_double_backward_is_said_once_and_left_out(caplog):
    """An op without double backward: the monitor says so once and goes on without B_noise;
    B_simple is still measured."""
    torch.manual_seed(0)
    model = _Prototypes()
    loss_fn = torch.nn.functional.cross_entropy
    monitor = NoiseScaleMonitor(model, "microbatch", loss_fn=loss_fn, hessian_every=1)
    g = torch.Generator().manual_seed(0)
    with caplog.at_level("WARNING", logger="gnsweep.measure"):
        for _ in range(3):
            x, y = torch.randn(8, 4, generator=g), torch.randint(5, (8,), generator=g)
            model.zero_grad(set_to_none=True)
            for part in (slice(0, 4), slice(4, 8)):
                (loss_fn(model(x[part]), y[part]) / 2).backward()
                monitor.accumulate()
            estimate = monitor.step(batch=(x, y))
    monitor.close()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("double backward" in m for m in messages) == 1
    assert not any("too small" in m for m in messages)
    assert estimate is not None and math.isfinite(estimate.b_simple)
    assert math.isnan(estimate.b_noise)


class _Square(torch.autograd.Function):
    """x^2 with a backward that builds no graph (`once_differentiable`, as custom kernels)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _SquaredHidden(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.second(_Square.apply(torch.tanh(self.first(x))))


def test_b_noise_through_a_once_differentiable_op_is_refused_not_wrong(caplog):
    """Double backward through an op whose backward builds no graph misses its second-derivative
    terms and returns a number all the same: the monitor says so once and leaves B_noise out."""
    torch.manual_seed(0)
    model = _SquaredHidden()
    loss_fn = torch.nn.functional.cross_entropy
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randint(3, (8,), generator=g)
    with pytest.raises(RuntimeError, match=r"_Square .*once_differentiable"):
        hessian_norms(model, loss_fn, (x, y), 2)
    monitor = NoiseScaleMonitor(model, "per_example", loss_fn=loss_fn, hessian_every=1)
    with caplog.at_level("WARNING", logger="gnsweep.measure"):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            estimate = monitor.step(batch=(x, y))
    monitor.close()
    assert sum("double backward" in r.getMessage() for r in caplog.records) == 1
    assert estimate is not None and math.isfinite(estimate.b_simple)
    assert math.isnan(estimate.b_noise)


def test_b_noise_of_a_model_with_fused_attention_is_measured(caplog):
    """`chars`' attention (`scaled_dot_product_attention`, fused kernels without double
    backward) runs by the math kernel in the Hessian passes: B_noise is measured."""
    from gnsweep.tasks import chars

    task = chars.make(chars.Options(context=8, width=16, heads=2, depth=1, eval_windows=0), 0)
    model = task.model()
    # Micro-batches (per-example norms would do too: chars' positions arange(T) are measured
    # through their output expanded along the batch).
    monitor = NoiseScaleMonitor(model, "microbatch", task_loss=task.loss, hessian_every=1)
    generator = torch.Generator().manual_seed(0)
    with caplog.at_level("WARNING", logger="gnsweep.measure"):
        for _ in range(3):
            batch = task.sample(8, generator)
            model.zero_grad(set_to_none=True)
            for part in batch.chunk(2):
                (task.loss(model, part) / 2).backward()
                monitor.accumulate()
            estimate = monitor.step(batch=batch)
    monitor.close()
    assert not any("double backward" in r.getMessage() for r in caplog.records)
    assert estimate is not None and math.isfinite(estimate.b_noise)


def test_tasks_lists_the_new_tasks_and_the_custom_form():
    result = runner.invoke(app, ["tasks"])
    assert result.exit_code == 0
    names = ["digits", "linreg", "chars", "vae", "custom"]
    if importlib.util.find_spec("gymnasium") is not None:  # cartpole is listed where it runs
        names.append("cartpole")
    for name in names:
        assert any(line.startswith(name) for line in result.output.splitlines()), name
    assert "task._target_=" in result.output


@pytest.mark.slow
def test_dataloader_workers_under_the_local_pool_and_a_notice_said_once(tmp_path):
    """Four runs over a Dataset on two pool workers, each run's DataLoader with two worker
    processes of its own (a daemonic pool worker could not start them); each run's monitor
    says it measures a layer by micro-batches: printed once for the launch, not once a run."""
    result = _launch(["task=custom", "task._target_=protocol_tasks.scaled_table",
                      "+task.n=100", "train.loader_workers=2", "sweep.batch_sizes=[8,16]",
                      "sweep.learning_rates=[0.05,0.1]", "sweep.targets=[1e-9]",
                      "sweep.max_steps=10", "--workers", "2", "--sweep-dir",
                      str(tmp_path / "s")], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "4 done" in result.stdout
    assert result.stderr.count("no per-example norms") == 1, result.stderr
    assert not (tmp_path / "s" / ".notices").exists()
    for batch in (8, 16):
        metrics = store.read_table(tmp_path / "s" / "runs" / f"b{batch:05d}_lr0.1_s0" /
                                   paths.METRICS).to_pandas()
        # Ten steps of B items from 100: the passes over the Dataset.
        assert metrics["epoch"].tolist() == pytest.approx([s * batch / 100 for s in
                                                           range(1, 11)])
