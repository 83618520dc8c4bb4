"""A sweep folder cannot be turned against its user: run files never name code or paths,
nothing is written outside the folder, secrets never reach a file or a printed line."""

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
from locations import HELPERS
from typer.testing import CliRunner

from gnsweep import paths, redact, store
from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.executors import log_event, open_folder, process_logger
from gnsweep.folder import read_run
from gnsweep.sweep import prepare

ONE_RUN = ["sweep=tiny", "sweep.batch_sizes=[8]", "sweep.learning_rates=[0.3]",
           "sweep.max_steps=20", "executor.workers=1"]


def _launch(sweep_dir: Path, *overrides: str):
    return CliRunner().invoke(app, ["launch", "-q", "--sweep-dir", str(sweep_dir), *ONE_RUN,
                                    *overrides])


def _record(sweep_dir: Path) -> tuple[Path, dict]:
    (run_id,) = store.run_ids(sweep_dir)
    path = paths.run_dir(sweep_dir, run_id) / paths.RUN_CONFIG
    return path, json.loads(path.read_text())


def _error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.slow
def test_a_run_file_naming_other_code_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    prepare(sweep, compose(ONE_RUN))
    # A payload inside the folder, named by a run file as its task; the working directory (on
    # sys.path for a user's task) is the folder.
    marker = tmp_path / "payload-ran"
    (sweep / "payload.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                      "def make(seed=0):\n    raise SystemExit(0)\n")
    path, record = _record(sweep)
    record["config"]["task"] = {"name": "custom", "options": {"_target_": "payload.make"}}
    path.write_text(json.dumps(record))
    monkeypatch.chdir(sweep)
    monkeypatch.syspath_prepend(str(sweep))

    result = _launch(sweep)
    assert result.exit_code == 2
    line = _error_line(result)
    assert str(path) in line and "task.name" in line
    assert not marker.exists()
    assert not (path.parent / paths.STATUS).exists()  # nothing ran, nothing recorded

    # The advice, followed: remove the run folder and relaunch.
    assert f"remove {path.parent} and relaunch" in line
    shutil.rmtree(path.parent)
    result = _launch(sweep)
    assert result.exit_code == 0, result.output
    assert not marker.exists()
    assert store.read_status(path.parent)["state"] == "done"


def test_a_run_field_of_the_wrong_type_is_refused_and_nothing_lands_outside(tmp_path):
    sweep = tmp_path / "sweep"
    prepare(sweep, compose(ONE_RUN))
    path, record = _record(sweep)
    record["run"]["seed"] = "0/../../../X"
    path.write_text(json.dumps(record))
    result = _launch(sweep)
    assert result.exit_code == 2
    line = _error_line(result)
    assert str(path) in line and "run.seed" in line and "not an integer" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]
    assert not (path.parent / paths.STATUS).exists()


@pytest.mark.slow
def test_linked_run_folders_and_files_are_refused(tmp_path):
    sweep, outside = tmp_path / "sweep", tmp_path / "outside"
    prepare(sweep, compose(ONE_RUN))
    path, _ = _record(sweep)
    shutil.move(path.parent, outside)
    path.parent.symlink_to(outside, target_is_directory=True)
    before = sorted(p.name for p in outside.iterdir())
    result = _launch(sweep)
    assert result.exit_code == 2
    line = _error_line(result)
    assert str(path.parent) in line and "symbolic link" in line
    assert sorted(p.name for p in outside.iterdir()) == before
    # The advice, followed: replace the link by a copy of what it points to.
    assert "replace it by a copy of what it points to" in line
    path.parent.unlink()
    shutil.move(outside, path.parent)
    assert _launch(sweep).exit_code == 0
    assert store.read_status(path.parent)["state"] == "done"

    # A file of a run folder that is a link: appends never follow it.
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    history = path.parent / "attempts.jsonl"
    history.rename(tmp_path / "attempts.jsonl")
    history.symlink_to(victim)
    with pytest.raises(store.StoreError, match=r"symbolic link.*remove the link"):
        log_event(path.parent, "start", attempt=1)
    history.unlink()  # the advice, followed
    log_event(path.parent, "start", attempt=1)
    (sweep / ".claims.lock").unlink()  # a launch takes it to write config.yaml
    (sweep / ".claims.lock").symlink_to(victim)
    with pytest.raises(store.StoreError, match="symbolic link"), store.exclusive(
            sweep / ".claims.lock"):
        pass
    assert victim.read_text() == "keep\n"


def test_a_folder_without_config_yaml_is_not_adopted_by_another_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    prepare(sweep, compose(ONE_RUN))
    saved = (sweep / paths.SWEEP_CONFIG).read_text()
    (sweep / paths.SWEEP_CONFIG).unlink()
    result = _launch(sweep, "task=linreg")
    assert result.exit_code == 2
    line = _error_line(result)
    assert "holds runs but no config.yaml" in line
    assert not (sweep / paths.SWEEP_CONFIG).exists()
    # The advice, followed: put config.yaml back; the folder's own settings launch again, the
    # other task is still refused.
    (sweep / paths.SWEEP_CONFIG).write_text(saved)
    prepare(sweep, compose(ONE_RUN))
    assert _launch(sweep, "task=linreg").exit_code == 2


SECRET = "S3CRET-9f2"


def test_secrets_never_reach_a_file_but_the_tracker_gets_them(tmp_path, monkeypatch):
    monkeypatch.setenv(redact.SECRETS_ENV, "{}")  # restored after the test
    uri = f"http://alice:{SECRET}@127.0.0.1:9/"
    config = compose([*ONE_RUN, "logger=mlflow", f"logger.tracking_uri={uri}"])
    prepare(tmp_path, config)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path
    assert "alice:***@127.0.0.1" in (tmp_path / paths.SWEEP_CONFIG).read_text()
    # The launcher hands the real value to its workers through their environment.
    redact.export(config.to_dict())
    assert SECRET in os.environ[redact.SECRETS_ENV]
    logger = process_logger(open_folder(tmp_path))
    assert logger.backend.tracking_uri == uri


def test_a_secret_task_option_is_masked_on_disk_and_real_in_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv(redact.SECRETS_ENV, "{}")  # restored after the test
    monkeypatch.syspath_prepend(str(HELPERS))
    config = compose(["sweep=tiny", "sweep.batch_sizes=[8]", "sweep.learning_rates=[0.3]",
                      "task=custom", "task._target_=blocking_task.make_custom",
                      f"+task.api_key={SECRET}"])
    (spec,) = prepare(tmp_path, config)
    assert not any(SECRET in p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    redact.export(config.to_dict())
    run_config, _ = read_run(tmp_path, spec.run_id)
    assert run_config.task.options["api_key"] == SECRET


def test_printed_errors_and_tracker_warnings_mask_credentials(tmp_path, caplog):
    from gnsweep.tracking.run_logger import RunLogger, SafeLogger

    class Failing(RunLogger):
        kind = "mlflow"

        def start(self, run_id, params):
            raise ConnectionError(f"cannot reach http://alice:{SECRET}@127.0.0.1:9/api")

    with caplog.at_level(logging.WARNING, logger="gnsweep.tracking"):
        SafeLogger(Failing(), "hint").start("r", {})
    assert "alice:***@" in caplog.text and SECRET not in caplog.text
    # A task that quotes its data server's URI, password included, in its error: the line
    # printed says which server, without the password.
    sys.path.insert(0, str(HELPERS))
    try:
        result = CliRunner().invoke(app, [
            "launch", "-q", "--sweep-dir", str(tmp_path / "sweep"), *ONE_RUN, "task=custom",
            "task._target_=blocking_task.make_unreachable",
            f"+task.data_url=http://alice:{SECRET}@127.0.0.1:9/"])
    finally:
        sys.path.remove(str(HELPERS))
    assert result.exit_code == 2
    line = _error_line(result)
    assert "cannot reach the data server http://alice:***@127.0.0.1:9/" in line
    assert SECRET not in result.output + result.stderr


def test_the_html_report_masks_credentials_of_an_older_config():
    import pandas as pd

    from gnsweep.analysis.results import Results
    from gnsweep.report.html import render

    text = f"logger:\n  kind: mlflow\n  tracking_uri: https://bob:{SECRET}@mlflow.example/\n"
    empty = {name: pd.DataFrame(columns=list(store.RESULT_SCHEMAS[name].names))
             for name in ("steps", "front", "fits")}
    html = render(Results(**empty), {}, None, text, "title")
    assert SECRET not in html and "bob:***@" in html


def test_the_analysis_refuses_a_run_file_of_another_task(tmp_path):
    prepare(tmp_path, compose(ONE_RUN))
    path, record = _record(tmp_path)
    record["config"]["task"]["name"] = "linreg"
    path.write_text(json.dumps(record))
    result = CliRunner().invoke(app, ["analyze", str(tmp_path)])
    assert result.exit_code == 2
    line = _error_line(result)
    assert str(path) in line and "task.name: 'linreg' -> 'digits'" in line


def test_folders_gnsweep_writes_into_are_never_links(tmp_path):
    from gnsweep.tracking.tensorboard_logger import TensorBoardLogger

    sweep, outside = tmp_path / "sweep", tmp_path / "outside"
    sweep.mkdir()
    outside.mkdir()
    for name in ("figures", "tensorboard", "queue"):
        (sweep / name).symlink_to(outside, target_is_directory=True)
        with pytest.raises(store.StoreError, match="symbolic link"):
            store.subdir(sweep, sweep / name)
    with pytest.raises(store.StoreError, match="symbolic link"):
        TensorBoardLogger(sweep).start("b00008_lr0.3_s0", {})
    with pytest.raises(store.StoreError, match="outside the sweep folder"):
        store.subdir(sweep, sweep / "../outside")
    # The once-per-launch markers of warnings: said, but no marker through the link.
    from gnsweep.notices import OncePerLaunch
    from gnsweep.paths import NOTICES

    (sweep / NOTICES).symlink_to(outside, target_is_directory=True)
    record = logging.LogRecord("gnsweep", logging.WARNING, "x", 1, "a notice", None, None)
    assert OncePerLaunch(sweep / NOTICES / "launch-id").filter(record)
    assert list(outside.iterdir()) == []
    assert store.subdir(sweep, sweep / "slurm").is_dir()


def test_a_run_file_outside_the_grid_that_names_code_is_refused(tmp_path):
    prepare(tmp_path, compose(ONE_RUN))
    _, record = _record(tmp_path)
    extra = paths.run_dir(tmp_path, "b00099_lr0.3_s0")
    extra.mkdir()
    record["run"]["batch_size"] = 99
    record["run_id"] = extra.name
    record["config"]["task"] = {"name": "custom", "options": {"_target_": "os.system"}}
    (extra / paths.RUN_CONFIG).write_text(json.dumps(record))
    result = _launch(tmp_path)
    assert result.exit_code == 2
    assert str(extra / paths.RUN_CONFIG) in _error_line(result)


def test_a_run_folder_whose_name_is_not_a_run_id_is_named(tmp_path):
    prepare(tmp_path, compose(ONE_RUN))
    path, _ = _record(tmp_path)
    odd = tmp_path / paths.RUNS / "odd name;rm"
    shutil.copytree(path.parent, odd)
    result = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert result.exit_code == 2
    assert "'odd name;rm' is not a run id" in _error_line(result)
    shutil.move(odd, tmp_path / "odd")  # the advice, followed
    assert CliRunner().invoke(app, ["status", str(tmp_path)]).exit_code == 0


def test_a_run_file_with_a_setting_the_sweep_lacks_is_refused(tmp_path):
    prepare(tmp_path, compose(ONE_RUN))
    path, record = _record(tmp_path)
    record["config"]["noise"]["hook"] = "os.system"
    path.write_text(json.dumps(record))
    result = _launch(tmp_path)
    assert result.exit_code == 2
    line = _error_line(result)
    assert str(path) in line and "noise.hook" in line
