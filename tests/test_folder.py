"""The opened sweep folder (`gnsweep.folder`): its paths are the layout docs/storage.md gives,
its config.yaml is parsed once per process that needs it (launch, a worker, analyze), its run
files are checked once when it opens, and the analysis gets its rows from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.errors import ConfigError, StoreError
from gnsweep.folder import RunPaths, SweepFolder, read_config
from gnsweep.sweep import expand_grid, prepare

SMALL = ["sweep=tiny", "sweep.batch_sizes=[8,16]", "sweep.learning_rates=[0.3]",
         "sweep.max_steps=5", "executor.workers=2"]


def _count_parses(monkeypatch, into: Path) -> None:
    """Append this process's id to `into` each time config.yaml is parsed: forked workers
    inherit the patch, so the file says how often each process parsed it."""
    real = store.read_sweep_config

    def counted(sweep_dir: Path):
        with open(into, "a") as out:
            out.write(f"{os.getpid()}\n")
        return real(sweep_dir)

    monkeypatch.setattr(store, "read_sweep_config", counted)


def _parses(path: Path) -> dict[str, int]:
    pids = path.read_text().split() if path.exists() else []
    return {pid: pids.count(pid) for pid in set(pids)}


def test_the_paths_are_the_documented_layout(tmp_path):
    prepare(tmp_path, compose(SMALL))
    folder = SweepFolder.open(tmp_path)
    run_id = sorted(folder.specs)[0]
    run = folder.run(run_id)
    # docs/storage.md's layout, written out here once.
    assert folder.config_file == tmp_path / "config.yaml"
    assert run.folder == tmp_path / "runs" / run_id and run.run_id == run_id
    assert run.record == tmp_path / "runs" / run_id / "config.json"
    assert run.status == tmp_path / "runs" / run_id / "status.json"
    assert run.metrics == tmp_path / "runs" / run_id / "metrics.parquet"
    assert run.history == tmp_path / "runs" / run_id / "attempts.jsonl"
    assert run.claim == tmp_path / "runs" / run_id / "claim.json"
    assert run.checkpoints == tmp_path / "runs" / run_id / "checkpoints"
    assert run.sweep == tmp_path
    assert folder.result("fits") == tmp_path / "fits.parquet"
    assert folder.fits_json == tmp_path / "fits.json"
    assert folder.plan == tmp_path / "plan.json"  # docs/planner.md
    assert folder.jobs == tmp_path / "slurm" / "jobs.json"  # docs/executors.md
    assert RunPaths(run.folder) == run
    with pytest.raises(StoreError, match="not a run id"):
        folder.run("../elsewhere")


def test_open_parses_the_config_once_and_checks_every_run(tmp_path, monkeypatch):
    config = compose(SMALL)
    prepare(tmp_path, config)
    _count_parses(monkeypatch, tmp_path / "parses")
    folder = SweepFolder.open(tmp_path)
    # The grid's points, as the pure expansion gives them.
    assert sorted(folder.specs.values(), key=lambda s: s.run_id) == \
        sorted(expand_grid(config), key=lambda s: s.run_id)
    for run_id in folder.specs:
        run_config, spec = folder.read_run(run_id)
        assert spec == folder.specs[run_id] and run_config.task == folder.config.task
    assert sum(_parses(tmp_path / "parses").values()) == 1
    # A run file whose task options differ from config.yaml's: refused at the open, named.
    run_id = sorted(folder.specs)[0]
    path = folder.run(run_id).record
    record = json.loads(path.read_text())
    record["config"]["task"]["options"]["hidden"] = 7
    path.write_text(json.dumps(record))
    with pytest.raises(StoreError, match=run_id):
        SweepFolder.open(tmp_path)


def test_the_task_is_checked_where_the_config_enters(tmp_path):
    prepare(tmp_path, compose(SMALL))
    text = (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(text.replace("name: digits", "name: nosuchtask", 1))
    with pytest.raises(ConfigError, match=r"config\.yaml: task=nosuchtask: no such task"):
        read_config(tmp_path)


@pytest.mark.slow
def test_a_launch_parses_the_config_only_to_compare_a_relaunch(tmp_path, monkeypatch):
    parses = tmp_path / "parses"
    sweep = tmp_path / "s"
    _count_parses(monkeypatch, parses)
    launch = ["launch", *SMALL, "--sweep-dir", str(sweep), "--quiet"]
    result = CliRunner().invoke(app, launch)
    assert result.exit_code == 0, result.output
    # A new folder: the launch wrote config.yaml and handed its config to its two workers
    # (forked), which parse nothing.
    assert _parses(parses) == {}
    result = CliRunner().invoke(app, launch)  # a relaunch compares with the folder's settings
    assert result.exit_code == 0, result.output
    assert list(_parses(parses).values()) == [1]


def test_analyze_parses_the_config_once(tiny_sweep, tmp_path, monkeypatch):
    parses = tmp_path / "parses"
    _count_parses(monkeypatch, parses)
    for command in (["analyze", str(tiny_sweep)], ["report", str(tiny_sweep)]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 0, result.output
        assert _parses(parses) == {str(os.getpid()): 1}, command
        parses.unlink()


@pytest.mark.slow
def test_a_worker_opens_the_folder_once_for_all_its_runs(tmp_path, monkeypatch):
    from gnsweep.executors import worker

    specs = prepare(tmp_path, compose(SMALL))
    runs_file = tmp_path / "todo"
    runs_file.write_text("".join(f"{s.run_id}\n" for s in specs))
    _count_parses(monkeypatch, tmp_path / "parses")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert worker.main([str(tmp_path), "--runs-file", str(runs_file)]) == 0
    assert {store.read_status(paths.run_dir(tmp_path, s.run_id)).state for s in specs} == \
        {store.RunState.DONE}
    assert _parses(tmp_path / "parses") == {str(os.getpid()): 1}


def test_a_workers_folder_whose_config_does_not_read_fails_each_use_with_the_reason(tmp_path):
    # A worker gets a folder even where config.yaml does not read at its start: each run then
    # fails with the reason, and a config written since (a relaunch) is read at the next use.
    prepare(tmp_path, compose(SMALL))
    good = (tmp_path / paths.SWEEP_CONFIG).read_text()
    (tmp_path / paths.SWEEP_CONFIG).write_text("sweep: [unclosed\n")
    folder = SweepFolder.for_worker(tmp_path)
    assert folder.root == tmp_path
    for _ in range(2):
        with pytest.raises(StoreError, match=r"config\.yaml: unreadable"):
            _ = folder.config
    (tmp_path / paths.SWEEP_CONFIG).write_text(good)
    assert list(folder.config.sweep.batch_sizes) == [8, 16]
