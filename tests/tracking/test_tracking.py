"""Run logging, for real: TensorBoard event files and an MLflow store read back with the tools'
own readers; a backend that cannot start or log warns once and never raises."""

from __future__ import annotations

import logging
import math
import os

import pytest
from locations import ROOT

from gnsweep.tracking import KINDS, METRICS, make_logger

PARAMS = {"task": {"name": "linreg", "dim": 16}, "run": {"batch_size": 32, "lr": 0.1}}


def _curve(step: int) -> dict[str, float]:
    """Per-step metrics as a run logs them (b_noise NaN between measurements)."""
    return {"loss": 1.0 / (step + 1), "loss_smooth": 1.1 / (step + 1), "eval_loss": 2.0,
            "b_simple": 10.0 + step, "b_noise": math.nan if step % 2 else 20.0 + step,
            "lr": 0.1, "batch_size": 32.0, "examples": 32.0 * (step + 1)}


def _run(logger, run_id: str, steps: int = 5) -> None:
    logger.start(run_id, {**PARAMS, "run_id": run_id})
    for step in range(steps):
        logger.log(step, _curve(step))
    logger.close()


def test_kinds_and_bad_input():
    assert KINDS == ("none", "tensorboard", "mlflow", "wandb")
    assert set(_curve(0)) == set(METRICS)
    with pytest.raises(ValueError, match="logger=bogus: unknown; choose one of none, "):
        make_logger("bogus", "x")
    with pytest.raises(ValueError, match="unknown option colour; accepted: tracking_uri"):
        make_logger("mlflow", "x", colour="red")
    with pytest.raises(ValueError, match=r"logger\.mode=loud: choose one of online, offline"):
        make_logger("wandb", "x", mode="loud")
    _run(make_logger("none", "x"), "r0")  # a no-op that accepts the calls


def test_tensorboard_event_files_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    logger = make_logger("tensorboard", tmp_path)
    for run_id in ("bs32_lr0.1_s0", "bs64_lr0.1_s0"):
        _run(logger, run_id)
    # What `tensorboard --logdir <sweep>/tensorboard` lists: one run per gnsweep run.
    multiplexer = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "tensorboard"))
    multiplexer.Reload()
    assert set(multiplexer.Runs()) == {"bs32_lr0.1_s0", "bs64_lr0.1_s0"}
    events = multiplexer.GetAccumulator("bs64_lr0.1_s0")
    assert set(events.Tags()["scalars"]) == set(METRICS)
    assert [e.step for e in events.Scalars("b_simple")] == [0, 1, 2, 3, 4]
    assert [e.value for e in events.Scalars("b_simple")] == [10, 11, 12, 13, 14]
    assert [e.step for e in events.Scalars("b_noise")] == [0, 2, 4]  # NaN left out


@pytest.fixture
def no_mlflow_env(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.mark.slow
def test_mlflow_local_store_in_the_sweep(tmp_path, no_mlflow_env):
    mlflow = pytest.importorskip("mlflow")
    sweep = tmp_path / "mysweep"
    logger = make_logger("mlflow", sweep)
    _run(logger, "bs32_lr0.1_s0")
    _run(logger, "bs64_lr0.1_s0")
    _run(logger, "bs64_lr0.1_s0", steps=3)  # a retry replaces the earlier attempt
    mlflow.set_tracking_uri(f"sqlite:///{sweep / 'mlflow' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["mysweep"])
    assert sorted(runs["tags.mlflow.runName"]) == ["bs32_lr0.1_s0", "bs64_lr0.1_s0"]
    assert set(runs["status"]) == {"FINISHED"}
    assert set(runs["params.task.dim"]) == {"16"}
    assert set(runs["params.run.batch_size"]) == {"32"}
    row = runs.set_index("tags.mlflow.runName").loc["bs64_lr0.1_s0"]
    assert row["metrics.b_simple"] == 12.0  # the last of the retry's three steps
    history = mlflow.tracking.MlflowClient().get_metric_history(row["run_id"], "b_simple")
    assert sorted((m.step, m.value) for m in history) == [(0, 10.0), (1, 11.0), (2, 12.0)]


@pytest.mark.process
def test_mlflow_follows_the_tracking_uri(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    _run(make_logger("mlflow", tmp_path / "sweep", experiment="shared"), "r1")
    assert not (tmp_path / "sweep" / "mlflow").exists()
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["shared"])
    assert list(runs["tags.mlflow.runName"]) == ["r1"]
    assert runs["metrics.loss"].iloc[0] == pytest.approx(0.2)


@pytest.mark.process
def test_a_backend_that_cannot_start_warns_once(tmp_path, caplog, no_mlflow_env):
    """An unwritable store: one warning naming the logger and the fix, no exception, and
    every later call a no-op."""
    pytest.importorskip("mlflow")
    if os.geteuid() == 0:
        blocked = tmp_path / "file"  # root writes anywhere: a file where a folder must go
        blocked.write_text("")
        sweep = blocked / "sweep"
    else:
        sweep = tmp_path / "ro"
        sweep.mkdir(mode=0o500)
    logger = make_logger("mlflow", sweep)
    with caplog.at_level(logging.WARNING, logger="gnsweep.tracking"):
        _run(logger, "r1")
        _run(logger, "r2")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "logger=mlflow could not start" in warnings[0]
    assert "pip install 'gnsweep[mlflow]'" in warnings[0]


def test_a_backend_that_fails_while_logging_warns_once(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    logger = make_logger("tensorboard", tmp_path)
    logger.start("r1", PARAMS)
    logger.log(0, {"loss": 1.0})
    with caplog.at_level(logging.WARNING, logger="gnsweep.tracking"):
        logger.log(1, {"loss": "not a number"})  # type: ignore[dict-item]
        logger.log(2, {"loss": 0.5})
        logger.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "logger=tensorboard could not log" in warnings[0]


def test_wandb_missing_package_warns_once(tmp_path, caplog, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    logger = make_logger("wandb", tmp_path)
    with caplog.at_level(logging.WARNING, logger="gnsweep.tracking"):
        _run(logger, "r1")
        _run(logger, "r2")
    assert len(caplog.records) == 1
    assert "pip install 'gnsweep[wandb]'" in caplog.records[0].getMessage()


@pytest.mark.slow
def test_mlflow_workers_share_a_fresh_local_store(tmp_path, no_mlflow_env):
    """Worker processes of one sweep open the local store at once: the first creates it, the
    others wait for it; every run lands, none warns."""
    import subprocess
    import sys

    mlflow = pytest.importorskip("mlflow")
    sweep = tmp_path / "sweep"
    script = ("import sys\nfrom gnsweep.tracking import make_logger\n"
              "logger = make_logger('mlflow', sys.argv[1])\n"
              "for run in sys.argv[2:]:\n"
              "    logger.start(run, {'run': run})\n"
              "    logger.log(0, {'loss': 1.0})\n"
              "    logger.close()\n"
              "assert logger.failed is None, logger.failed\n")
    root = str(ROOT)
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    workers = [subprocess.Popen([sys.executable, "-c", script, str(sweep), f"w{i}a", f"w{i}b"],
                                env=env, stderr=subprocess.PIPE, text=True) for i in range(3)]
    for worker in workers:
        _, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err
        assert "could not" not in err
    mlflow.set_tracking_uri(f"sqlite:///{sweep / 'mlflow' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["sweep"])
    assert sorted(runs["tags.mlflow.runName"]) == [f"w{i}{s}" for i in range(3) for s in "ab"]


@pytest.mark.process
def test_importing_gnsweep_needs_no_framework_or_tracker():
    import subprocess
    import sys

    heavy = ["lightning", "transformers", "tensorboard", "mlflow", "wandb"]
    code = ("import sys, gnsweep, gnsweep.tracking, gnsweep.integrations\n"
            f"print([m for m in {heavy!r} if m in sys.modules])")
    root = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root}, check=True)
    assert out.stdout.strip() == "[]"


def test_wandb_offline_when_not_configured(tmp_path, monkeypatch):
    """No WANDB_MODE, no API key, no netrc entry: the run is written offline under
    <sweep>/wandb/, with its config and history."""
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = make_logger("wandb", tmp_path / "sweep")
    _run(logger, "bs32_lr0.1_s0")
    assert logger.failed is None
    offline = list((tmp_path / "sweep" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    assert list(offline[0].glob("*.wandb"))  # the run's history, for `wandb sync`


def test_the_config_knows_each_trackers_options_without_building_one():
    from gnsweep.config import LOGGER_OPTIONS
    from gnsweep.tracking import KINDS, options_of

    assert set(LOGGER_OPTIONS) == set(KINDS)
    for kind in KINDS:
        assert set(LOGGER_OPTIONS[kind]) == set(options_of(kind)), kind
