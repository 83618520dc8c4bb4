"""A sweep folder turned against its user, second round: a branch from a tampered run file, a
checkpoint copied over another run's, a metrics table cut short, a task that blocks in the
launcher, secrets in parser errors, links where gnsweep writes, two launchers with different
grids, an empty seed list. Each is refused or repaired, said in one line."""

import hashlib
import json
import shutil
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from locations import HELPERS
from typer.testing import CliRunner

from gnsweep import paths, redact, store
from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.errors import StoreError
from gnsweep.executors import open_folder, run_taken, take_run
from gnsweep.paths import CLAIM
from gnsweep.sweep import prepare, prepare_folder

ONE_RUN = ["sweep=tiny", "sweep.batch_sizes=[8]", "sweep.learning_rates=[0.3]",
           "sweep.max_steps=20", "executor.workers=1"]


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def _launch(sweep_dir: Path, *overrides: str):
    return _cli("launch", "-q", "--sweep-dir", str(sweep_dir), *ONE_RUN, *overrides)


def _error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def _record(sweep_dir: Path, run_id: str | None = None) -> tuple[Path, dict]:
    run_id = run_id or store.run_ids(sweep_dir)[0]
    path = paths.run_dir(sweep_dir, run_id) / paths.RUN_CONFIG
    return path, json.loads(path.read_text())


@pytest.mark.slow
def test_branch_never_builds_the_task_a_tampered_base_run_file_names(tmp_path):
    base = tmp_path / "base"
    assert _launch(base, "train.keep_checkpoints_at=[64]").exit_code == 0
    # A torch.hub "repository" inside the folder whose import leaves a marker.
    marker, payload = tmp_path / "payload-ran", base / "payload"
    payload.mkdir()
    (payload / "hubconf.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                        "def make(*args, **kwargs):\n    return None\n")
    path, record = _record(base)
    record["config"]["task"] = {"name": "custom", "options": {
        "_target_": "torch.hub.load", "repo_or_dir": str(payload), "model": "make",
        "source": "local"}}
    path.write_text(json.dumps(record))
    result = _cli("branch", str(path.parent), "--at", "64", "--sweep-dir",
                  str(tmp_path / "along"), "-q", "sweep=tiny", "sweep.batch_sizes=[8]",
                  "sweep.learning_rates=[0.3]")
    assert result.exit_code == 2
    line = _error_line(result)
    assert str(path) in line and "task.name" in line
    assert not marker.exists()
    assert not (tmp_path / "along").exists()


def _forge(pt: Path, source: Path) -> None:
    """Copy `source` over `pt` and give `pt`'s sidecar the copy's size and checksum."""
    shutil.copyfile(source, pt)
    sidecar = pt.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    data = pt.read_bytes()
    meta.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    sidecar.write_text(json.dumps(meta))


@pytest.mark.slow
def test_a_checkpoint_copied_from_another_run_is_refused_and_the_run_starts_over(tmp_path,
                                                                                capfd):
    from gnsweep.training.checkpoint import kept, verify

    sweep = tmp_path / "sweep"
    # Each run keeps its checkpoint at 64 examples: b8's at step 8, b16's at step 4.
    assert _launch(sweep, "sweep.batch_sizes=[8,16]", "train.keep_checkpoints_at=[64]",
                   "sweep.targets=[0.0001]").exit_code == 0
    b8, b16 = (paths.run_dir(sweep, r) for r in ("b00008_lr0.3_s0", "b00016_lr0.3_s0"))
    ((_, mine),), ((_, theirs),) = kept(b8), kept(b16)
    _forge(mine, theirs)
    with pytest.raises(StoreError, match="copied from elsewhere, refused"):
        verify(mine, run_id=b8.name)
    # The run interrupted after its checkpoint: a relaunch resumes it from there.
    store.write_status(b8, "pending")
    capfd.readouterr()
    assert _launch(sweep, "sweep.batch_sizes=[8,16]", "train.keep_checkpoints_at=[64]",
                   "sweep.targets=[0.0001]").exit_code == 0
    err = capfd.readouterr().err
    assert "copied from elsewhere, refused" in err and "continuing from" not in err
    rows = pq.read_table(b8 / paths.METRICS, columns=["step", "examples"]).to_pydict()
    assert rows["step"] == list(range(1, 21))
    assert rows["examples"] == [8 * s for s in rows["step"]]  # never b16's examples


@pytest.mark.slow
def test_a_metrics_table_cut_short_is_named_and_run_again(tmp_path):
    sweep = tmp_path / "sweep"
    assert _launch(sweep, "sweep.batch_sizes=[8,16]", "sweep.targets=[0.0001]").exit_code == 0
    run = paths.run_dir(sweep, "b00008_lr0.3_s0")
    table = pq.read_table(run / paths.METRICS)
    assert table.num_rows == 20
    pq.write_table(table.slice(0, 5), run / paths.METRICS)  # valid parquet, 5 of 20 rows
    status = _cli("status", str(sweep))
    assert status.exit_code == 0
    line = next(x for x in status.stdout.splitlines() if x.startswith(run.name))
    assert "rerun" in line and "cut short" in line
    # The raw loss: the smoothed one meets 2 before its window fills (an early reach, not counted).
    analysis = _cli("analyze", str(sweep), "--targets", "2", "--loss", "raw")
    assert f"run {run.name} recorded done, but its metrics.parquet is cut short" in \
        analysis.stderr
    assert _launch(sweep, "sweep.batch_sizes=[8,16]", "sweep.targets=[0.0001]").exit_code == 0
    assert pq.read_table(run / paths.METRICS).num_rows == 20  # run again, whole
    assert store.read_status(run)["attempts"] == 2


def test_a_task_that_blocks_in_the_pre_launch_check_stops_the_launcher(tmp_path, monkeypatch):
    import blocking_task

    monkeypatch.syspath_prepend(str(HELPERS))
    monkeypatch.delenv("GNSWEEP_LAUNCH", raising=False)
    try:
        result = _launch(tmp_path / "sweep", "task=custom",
                         "task._target_=blocking_task.make_first_loss_blocks",
                         "sweep.stall_seconds=1")
    finally:
        blocking_task.RELEASE.set()  # the check's thread goes on and ends
    assert result.exit_code == 2
    line = _error_line(result)
    assert "the pre-launch check" in line and "no answer after 1 s" in line
    assert not (tmp_path / "sweep").exists()


SECRET = "s3cretZQ"


@pytest.mark.parametrize("override", [f"+task.api_key=[APIs{SECRET}",
                                      f"+task.password=p@ss:w0rd,{SECRET}",
                                      f"logger.tracking_uri=[PW{SECRET}]",
                                      f"+task.api_key=[{SECRET}]"])
def test_secrets_never_reach_an_error_line_and_must_be_strings(tmp_path, override):
    task = ["task=custom", "task._target_=blocking_task.make_custom"]  # takes any option
    result = _cli("launch", "--dry-run", "--sweep-dir", str(tmp_path), "sweep=tiny",
                  *(["logger=mlflow"] if override.startswith("logger") else task), override)
    assert result.exit_code == 2
    line = _error_line(result)
    assert SECRET not in result.output + result.stderr and "w0rd" not in line


def test_masking_keeps_the_words_around_a_secrets_name():
    result = _cli("launch", "--dry-run", "sweep=tiny", "task=linreg", "+task.password=x")
    assert result.exit_code == 2
    assert "task.password: not an option of task linreg" in _error_line(result)
    assert redact.text('{"password": "hunter2"}') == '{"password": "***"}'
    assert redact.text("token=a,b c") == "token=*** c"


@pytest.mark.parametrize("name", ["attempts.jsonl", "checkpoints", "metrics.parts",
                                  ".claims.lock"])
def test_a_link_where_gnsweep_writes_is_refused_before_a_run_is_claimed(tmp_path, name):
    sweep, victim = tmp_path / "sweep", tmp_path / "victim"
    victim.mkdir()
    (spec,) = prepare(sweep, compose(ONE_RUN))
    run = paths.run_dir(sweep, spec.run_id)
    link = (sweep if name.startswith(".") else run) / name
    link.unlink(missing_ok=True)
    link.symlink_to(victim)
    result = _launch(sweep)
    assert result.exit_code == 2
    line = _error_line(result)
    assert str(link) in line and "symbolic link" in line
    assert not (run / CLAIM).exists()
    assert list(victim.iterdir()) == []
    status = store.read_status(run)
    assert status.state is store.RunState.PENDING and status.attempts == 0


def test_a_run_refused_as_it_starts_releases_its_claim(tmp_path):
    (spec,) = prepare(tmp_path, compose(ONE_RUN))
    run = paths.run_dir(tmp_path, spec.run_id)
    claim, _ = take_run(tmp_path, spec.run_id, 0)
    assert claim is not None
    (run / "attempts.jsonl").symlink_to(tmp_path / "victim")
    with pytest.raises(StoreError, match="symbolic link"):
        run_taken(open_folder(tmp_path), spec.run_id, claim)
    assert not (run / CLAIM).exists()


def test_two_launchers_with_different_grids_leave_the_union(tmp_path, monkeypatch):
    import gnsweep.sweep as sweep_module

    prepare_folder(tmp_path, compose([*ONE_RUN, "sweep.batch_sizes=[8]"]))
    check = sweep_module._check_relaunch
    other: list[threading.Thread] = []

    def interleaved(sweep_dir, config):
        merged = check(sweep_dir, config)
        if not other:  # the first launcher has read config.yaml: the second one runs now
            other.append(threading.Thread(target=prepare_folder, args=(
                tmp_path, compose([*ONE_RUN, "sweep.batch_sizes=[8,32]"]))))
            other[0].start()
            other[0].join(2)  # under the lock it waits for the first launcher to write
        return merged

    monkeypatch.setattr(sweep_module, "_check_relaunch", interleaved)
    prepare_folder(tmp_path, compose([*ONE_RUN, "sweep.batch_sizes=[8,16]"]))
    other[0].join()
    written = yaml.safe_load((tmp_path / paths.SWEEP_CONFIG).read_text())
    assert written["sweep"]["batch_sizes"] == [8, 16, 32]


def test_an_empty_seed_list_is_refused():
    result = _cli("launch", "--dry-run", "sweep=tiny", "sweep.seeds=[]")
    assert result.exit_code == 2
    assert "sweep.seeds: an empty list runs nothing" in _error_line(result)


def test_a_run_id_that_is_a_path_is_named_as_such(tmp_path):
    prepare(tmp_path, compose(ONE_RUN))
    path, record = _record(tmp_path)
    record["run_id"] = f"../{record['run_id']}"
    path.write_text(json.dumps(record))
    result = _launch(tmp_path)
    assert result.exit_code == 2
    line = _error_line(result)
    assert "is not a valid run id" in line and "lies in folder" not in line
    assert _cli("status", str(tmp_path)).exit_code == 2  # every reader checks the same
