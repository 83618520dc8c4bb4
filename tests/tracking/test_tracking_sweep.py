"""`gnsweep launch logger=...` for real: a tiny sweep's every run shows up in the tracker's own
reader (TensorBoard's EventMultiplexer, mlflow.search_runs), with the run's config and its
per-step metrics; a logger that cannot start never fails a run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from locations import ROOT
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.config import ConfigError, LoggerConfig

# Four quick runs of the tiny sweep (digits), two worker processes.
SMALL = ["sweep=tiny", "sweep.batch_sizes=[8,32]", "sweep.learning_rates=[0.3,1.0]",
         "sweep.max_steps=60", "--workers", "2", "--quiet"]


def _launch(sweep, *overrides: str):
    result = CliRunner().invoke(app, ["launch", *SMALL, *overrides, "--sweep-dir", str(sweep)])
    assert result.exit_code == 0, result.output
    return result


def _steps(sweep, run_id: str) -> list[int]:
    table = store.read_table(paths.run_dir(sweep, run_id) / paths.METRICS)
    return [int(s) for s in table.column("step").to_pylist()]


def test_logger_settings_are_checked_once():
    assert compose([]).logger.kind == "none"
    assert compose(["logger=tensorboard"]).logger.options() == {"flush_secs": 10}
    assert compose(["logger=mlflow", "logger.experiment=e"]).logger.options() == {
        "experiment": "e"}
    with pytest.raises(ConfigError, match=r"logger\.flush_secs: not an option of logger=mlflow"):
        compose(["logger=mlflow", "logger.flush_secs=3"])
    with pytest.raises(ConfigError, match="logger=bogus: no such logger; choose one of mlflow"):
        compose(["logger=bogus"])
    with pytest.raises(ConfigError, match=r"logger\.mode=loud: choose one of online"):
        LoggerConfig(kind="wandb", mode="loud")
    result = CliRunner().invoke(app, ["launch", "logger=wandb", "logger.mode=loud", "--dry-run"])
    assert result.exit_code == 2
    assert "logger.mode=loud" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_tensorboard_lists_every_run(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    sweep = tmp_path / "tb"
    _launch(sweep, "logger=tensorboard")
    runs = store.run_ids(sweep)
    assert len(runs) == 4
    # What `tensorboard --logdir <sweep>/tensorboard` lists: one run per gnsweep run.
    multiplexer = EventMultiplexer().AddRunsFromDirectory(str(sweep / "tensorboard"))
    multiplexer.Reload()
    assert set(multiplexer.Runs()) == set(runs)
    for run_id in runs:
        events = multiplexer.GetAccumulator(run_id)
        assert {"loss", "loss_smooth", "b_simple", "lr", "batch_size", "examples"} <= set(
            events.Tags()["scalars"])
        # Every metrics row the run wrote, at its step; the batch size is the run's.
        assert [e.step for e in events.Scalars("loss")] == _steps(sweep, run_id)
        batch = int(run_id[1:6])
        assert {e.value for e in events.Scalars("batch_size")} == {batch}
        assert [e.value for e in events.Scalars("examples")] == [
            batch * s for s in _steps(sweep, run_id)]


@pytest.mark.slow
def test_a_relaunch_may_switch_logging_on(tmp_path):
    """Where runs are logged changes nothing they train: a relaunch with another logger= is
    accepted, and the runs it still has to do are logged."""
    pytest.importorskip("tensorboard")
    sweep = tmp_path / "later"
    _launch(sweep, "sweep.batch_sizes=[8]")
    _launch(sweep, "logger=tensorboard")
    logged = {p.name for p in (sweep / "tensorboard").iterdir()}
    assert logged == {r for r in store.run_ids(sweep) if r.startswith("b00032")}


@pytest.mark.parametrize("env_uri", [False, True], ids=["local-store", "MLFLOW_TRACKING_URI"])
@pytest.mark.slow
def test_mlflow_finds_every_run(tmp_path, monkeypatch, env_uri):
    mlflow = pytest.importorskip("mlflow")
    sweep = tmp_path / "mlsweep"
    uri = f"sqlite:///{tmp_path / 'server.db'}"
    if env_uri:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the workers inherit it
    else:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        uri = f"sqlite:///{sweep / 'mlflow' / 'mlflow.db'}"
    _launch(sweep, "logger=mlflow")
    assert (sweep / "mlflow").exists() != env_uri
    mlflow.set_tracking_uri(uri)
    found = mlflow.search_runs(experiment_names=["mlsweep"])
    runs = store.run_ids(sweep)
    assert sorted(found["tags.mlflow.runName"]) == sorted(runs)
    assert set(found["status"]) == {"FINISHED"}
    assert set(found["params.task.name"]) == {"digits"}
    client = mlflow.tracking.MlflowClient()
    for _, row in found.iterrows():
        run_id = row["tags.mlflow.runName"]
        assert row["params.run.batch_size"] == str(int(run_id[1:6]))
        history = client.get_metric_history(row["run_id"], "loss")
        assert sorted(m.step for m in history) == _steps(sweep, run_id)


@pytest.mark.slow
def test_logging_that_cannot_start_never_fails_a_run(tmp_path):
    """An MLflow store under a regular file (unwritable even for root): each worker says so
    once, and every run still trains and finishes. A real `gnsweep` process: the warning must
    reach the user's terminal."""
    pytest.importorskip("mlflow")
    blocked = tmp_path / "file"
    blocked.write_text("")
    sweep = tmp_path / "sweep"
    root = str(ROOT)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    out = subprocess.run(
        [sys.executable, "-m", "gnsweep", "launch", *SMALL, "logger=mlflow",
         f"logger.tracking_uri=sqlite:///{blocked}/sub/mlflow.db", "--sweep-dir", str(sweep)],
        capture_output=True, text=True, env={**env, "PYTHONPATH": root}, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "4 done" in out.stdout
    assert all(store.read_status(paths.run_dir(sweep, r))["state"] == "done"
               for r in store.run_ids(sweep))
    # One warning per worker process at most (2 workers), never one per run.
    assert 1 <= out.stderr.count("logger=mlflow could not start") <= 2, out.stderr
    assert "pip install 'gnsweep[mlflow]'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.distributed
def test_torchrun_logs_each_run_once_from_rank_0(tmp_path):
    """Two DDP processes train each run; only rank 0 writes its events: one file a run."""
    pytest.importorskip("tensorboard")
    sweep = tmp_path / "tr"
    result = CliRunner().invoke(app, [
        "launch", "sweep=tiny", "sweep.batch_sizes=[8,32]", "sweep.learning_rates=[0.3]",
        "sweep.max_steps=60", "executor=torchrun", "executor.nproc_per_node=2",
        "logger=tensorboard", "--sweep-dir", str(sweep), "-q"])
    assert result.exit_code == 0, result.output
    runs = store.run_ids(sweep)
    assert sorted(p.name for p in (sweep / "tensorboard").iterdir()) == sorted(runs)
    for run_id in runs:
        assert len(list((sweep / "tensorboard" / run_id).glob("events.out.tfevents.*"))) == 1
