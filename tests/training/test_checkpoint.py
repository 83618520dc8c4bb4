"""Checkpoints in a run's folder: a run stopped and trained again from its folder logs the rows
of a run never interrupted (every number but the wall time, bit for bit), with its rows readable
on disk while it trains; a checkpoint that cannot be written (a full disk), one truncated or
corrupt, and one of another grid point are each said in one line and never break the run."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from gnsweep import paths, store
from gnsweep.config import Config, NoiseConfig, SweepConfig, TaskConfig, TrainConfig
from gnsweep.paths import CHECKPOINTS
from gnsweep.runs import RunSpec
from gnsweep.training import StopRequested, build_run, run, train
from gnsweep.training.checkpoint import kept, load_into, taken_for
from gnsweep.training.loop import make_checkpointer

STEPS = 40
SPEC = RunSpec(batch_size=16, learning_rate=0.05)


def _config(**train: object) -> Config:
    # Adam carries optimizer state, B_noise every 3 steps its own clock, eval every 2 steps the
    # exact loss: a part left out of a checkpoint changes a later row.
    return Config(task=TaskConfig(name="linreg", options={"dim": 8}),
                  sweep=SweepConfig(batch_sizes=[16], learning_rates=[0.05, 0.1], targets=[1e-9],
                                    max_steps=STEPS, eval_every=2),
                  noise=NoiseConfig(hessian_every=3),
                  train=TrainConfig(**{"optimizer": "adam", "checkpoint_every": 5, **train}))  # type: ignore[arg-type]


def _folder(root: Path, spec: RunSpec = SPEC) -> Path:
    path = root / "runs" / spec.run_id
    path.mkdir(parents=True)
    return path


def _rows(path: Path) -> dict[str, np.ndarray]:
    table = store.read_table(path / paths.METRICS).to_pandas()
    return {c: table[c].to_numpy() for c in table.columns if c != "wall_time"}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> dict[str, np.ndarray]:
    """The rows of the run never interrupted."""
    torch.set_num_threads(1)
    path = _folder(tmp_path_factory.mktemp("whole"))
    train(_config(), SPEC, path)
    return _rows(path)


def _assert_same_rows(path: Path, whole: dict[str, np.ndarray]) -> None:
    rows = _rows(path)
    assert list(rows["step"]) == list(range(1, STEPS + 1))  # contiguous, none twice
    for name, values in whole.items():
        assert np.array_equal(rows[name], values, equal_nan=True), name


def _stop_at(path: Path, step: int, config: Config | None = None) -> None:
    """Train until `step` steps are logged on disk... and stopped there (StopRequested)."""
    seen = {"step": 0}

    def on_row(row: dict[str, float]) -> None:
        seen["step"] = int(row["step"])

    with pytest.raises(StopRequested):
        train(config or _config(), SPEC, path, should_stop=lambda: seen["step"] >= step,
              on_row=on_row)


def test_a_stopped_run_trained_again_from_its_folder_logs_the_same_rows(tmp_path, whole):
    path = _folder(tmp_path)
    _stop_at(path, 17)
    # Stopped between two steps: its state saved there, its rows on disk, readable as they are.
    assert [step for _, p in kept(path) for step in [int(p.stem)]] == [17]
    live = store.read_metrics(path)
    assert live is not None and live.column("step").to_pylist() == list(range(1, 18))
    assert not (path / paths.METRICS).exists()
    train(_config(), SPEC, path)
    _assert_same_rows(path, whole)
    # Ended: the rows compacted, the checkpoints gone (none was asked to be kept).
    assert not (path / paths.METRIC_PARTS).exists() and not (path / CHECKPOINTS).exists()


def test_a_truncated_checkpoint_is_said_and_the_previous_valid_one_used(tmp_path, whole,
                                                                         capfd):
    # The checkpoint at 80 examples (step 5) is kept; the latest, at the stop, is cut short.
    path = _folder(tmp_path)
    config = _config(keep_checkpoints_at=[80])
    _stop_at(path, 12, config)
    assert [p.stem for _, p in kept(path)] == ["000000000005", "000000000012"]
    latest = path / CHECKPOINTS / "000000000012.pt"
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])
    capfd.readouterr()
    train(config, SPEC, path)
    err = capfd.readouterr().err
    assert err.count("truncated") == 1 and "000000000012.pt" in err
    _assert_same_rows(path, whole)
    assert [p.stem for _, p in kept(path)] == ["000000000005"]  # kept after the run


def test_a_corrupt_only_checkpoint_is_said_and_the_run_starts_again(tmp_path, whole, capfd):
    path = _folder(tmp_path)
    _stop_at(path, 12)
    latest = path / CHECKPOINTS / "000000000012.pt"
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    latest.write_bytes(bytes(data))
    capfd.readouterr()
    train(_config(), SPEC, path)
    assert capfd.readouterr().err.count("does not match its checksum") == 1
    _assert_same_rows(path, whole)


def test_another_grid_points_checkpoint_is_refused(tmp_path, capfd):
    other = RunSpec(batch_size=16, learning_rate=0.1)
    source, target = _folder(tmp_path / "a"), _folder(tmp_path / "b", other)
    _stop_at(source, 12)
    # Copied in as it is (another run's id), and with its sidecar saying this run's id.
    shutil.copytree(source / CHECKPOINTS, target / CHECKPOINTS)
    sidecar = target / CHECKPOINTS / "000000000012.json"
    renamed = sidecar.read_text().replace(SPEC.run_id, other.run_id)
    capfd.readouterr()
    train(_config(), other, target)
    assert "belongs to run" in capfd.readouterr().err
    alone = _folder(tmp_path / "c", other)
    train(_config(), other, alone)
    assert np.array_equal(_rows(target)["loss"], _rows(alone)["loss"])  # from step 0
    store.clear_metrics(target)
    shutil.rmtree(target / CHECKPOINTS, ignore_errors=True)
    shutil.copytree(source / CHECKPOINTS, target / CHECKPOINTS)
    sidecar.write_text(renamed)
    train(_config(), other, target)
    assert "another configuration" in capfd.readouterr().err
    assert np.array_equal(_rows(target)["loss"], _rows(alone)["loss"])


@contextlib.contextmanager
def _small_disk(root: Path):
    """A 512 KiB tmpfs at `root`: a disk that fills up for real (root only)."""
    root.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(root)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root and mount to make a small disk that fills up")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def _fill(folder: Path) -> Path:
    ballast = folder / f"ballast-{uuid.uuid4().hex}"
    with contextlib.suppress(OSError), ballast.open("wb") as out:
        while True:
            out.write(b"\0" * 4096)
            out.flush()
    return ballast


@pytest.mark.process
def test_a_full_disk_during_a_save_is_said_once_and_the_run_goes_on(tmp_path, whole, capfd):
    with _small_disk(tmp_path / "disk") as disk:
        path = _folder(disk)
        ballast: list[Path] = []
        seen = {"step": 0}

        def on_row(row: dict[str, float]) -> None:
            seen["step"] = int(row["step"])
            if row["step"] == 6:
                ballast.append(_fill(disk))  # the checkpoint at step 5 is on disk, no room after

        capfd.readouterr()
        # The saves at steps 10 and 15 and the one at the stop (17) find the disk full.
        with pytest.raises(StopRequested):
            train(_config(), SPEC, path, on_row=on_row, should_stop=lambda: seen["step"] >= 17)
        err = capfd.readouterr().err
        assert err.count("No space left on device") == 1, err
        assert [p.stem for _, p in kept(path)] == ["000000000005"]
        ballast[0].unlink()
        train(_config(), SPEC, path)  # from the previous checkpoint, step 5
        _assert_same_rows(path, whole)


def test_a_task_with_state_of_its_own_takes_no_checkpoints(tmp_path, capfd):
    # Cartpole's environments live in the task, outside the run's state: resuming would not
    # continue the same run, so its runs are never checkpointed (said once) and start again.
    config = _config()
    state = build_run(config, SPEC)
    state.task.resumable = False  # type: ignore[attr-defined]
    path = _folder(tmp_path)
    checkpoints = make_checkpointer(config, path)
    checkpoints.resume(state)
    with pytest.raises(StopRequested):
        run(state, path, should_stop=lambda: state.step >= 12, checkpoints=checkpoints)
    assert not (path / CHECKPOINTS).exists()
    assert capfd.readouterr().err.count("keeps state outside the run's") == 1


def test_the_checkpoint_bench_runs_and_measures_a_save(capsys):
    from gnsweep.bench.checkpoint import main

    result = main(["--rounds", "1", "--runs", "1", "--steps", "12", "--every", "4"])
    assert result["checkpoint_bytes"] > 0 and result["save_ms"] > 0
    assert result["default_ratio"] > 0 and result["every_ratio"] > 0
    assert '"subject": "checkpoint"' in capsys.readouterr().out


def test_log_spaced_checkpoints_are_kept_past_the_runs_end(tmp_path, whole):
    # keep_checkpoints=log: one checkpoint at the first step boundary past each power of two of
    # examples (16 a step: steps 1, 2, 4, 8, 16, 32), kept after the run for branching.
    path = _folder(tmp_path)
    config = _config(checkpoint_every=0, keep_checkpoints="log")
    train(config, SPEC, path)
    assert [examples for examples, _ in kept(path)] == [16, 32, 64, 128, 256, 512]
    _assert_same_rows(path, whole)  # saving changes nothing the run logs
    # A branch: one of them loaded into a fresh run goes on as the run went on from there.
    state = build_run(config, SPEC)
    load_into(state, dict(kept(path))[128])
    assert state.step == 8 and not state.rows["step"]
    run(state)
    for name, values in whole.items():
        assert np.array_equal(np.asarray(state.rows[name]), values[8:], equal_nan=True), name


def test_a_checkpoint_kept_between_boundaries_is_found_for_the_point_asked(tmp_path):
    # 16 examples a step: keep_checkpoints_at=[70, 150] are taken at the first boundaries past
    # them, 80 and 160 examples; a branch at 70 takes the one taken for 70, not "none at or
    # before 70", and a point nobody asked for still takes the kept one at or before it.
    from gnsweep.branching import branch_checkpoint, kept_checkpoints

    path = _folder(tmp_path)
    train(_config(checkpoint_every=0, keep_checkpoints_at=[70, 150]), SPEC, path)
    assert {point: examples for point, (examples, _) in taken_for(path).items()} == \
        {70: 80, 150: 160}
    kept_by_examples, asked = kept_checkpoints(path)
    assert branch_checkpoint(path, 70, kept_by_examples, asked)[0] == 80
    assert branch_checkpoint(path, 150, kept_by_examples, asked)[0] == 160
    assert branch_checkpoint(path, 100, kept_by_examples, asked)[0] == 80


def test_a_stopped_state_is_not_run_again_with_its_monitor_closed(tmp_path):
    # After a stop the monitor's hooks are gone: running the same state on would log its last
    # estimate again and again. Refused; the run goes on from its checkpoint instead.
    path = _folder(tmp_path)
    config = _config()
    state = build_run(config, SPEC)
    checkpoints = make_checkpointer(config, path)
    with pytest.raises(StopRequested):
        run(state, path, should_stop=lambda: state.step >= 3, checkpoints=checkpoints)
    with pytest.raises(ValueError, match="already ended"):
        run(state, path, checkpoints=checkpoints)
    with pytest.raises(ValueError, match="closed NoiseScaleMonitor"):
        state.monitor.step()
