"""Global steps from a step counter that restarts every epoch (gnsweep.training.epochs), and the
script's row reader using them (training.script.RowLog): the truth is the count of steps a
script with known epoch lengths took."""

from __future__ import annotations

from pathlib import Path

import pytest

from gnsweep import store
from gnsweep.errors import ScriptFailed
from gnsweep.training.epochs import EpochError, EpochSteps


def test_a_total_places_every_epoch_exactly():
    epochs = EpochSteps()
    # 535 steps an epoch, logged every 200 (the last logged is 400, not 535).
    got = [epochs.step(e, s, 535) for e in (1, 2, 3) for s in (200, 400)]
    assert got == [200, 400, 735, 935, 1270, 1470]
    assert not epochs.notes


def test_without_a_total_an_epoch_starts_after_the_last_logged_step():
    every = EpochSteps()
    assert [every.step(e, s) for e in (1, 2) for s in (1, 2, 3)] == [1, 2, 3, 4, 5, 6]
    assert not every.notes  # every step logged: exact
    sparse = EpochSteps()
    assert [sparse.step(e, s) for e in (1, 2) for s in (10, 20)] == [10, 20, 30, 40]
    (note,) = sparse.notes  # every 10th step logged: the offset may be short, and it is said
    assert "epoch 2 is taken to start after step 20 of epoch 1" in note and "total" in note


def test_epochs_start_where_the_run_starts_and_resume_from_what_was_learned():
    epochs = EpochSteps()
    assert epochs.step(0, 5, 10) == 5  # a script counting epochs from 0
    assert epochs.step(1, 5, 10) == 15
    assert epochs.step(0, 5, 10) == 5  # a resume back in epoch 0: the same steps again
    with pytest.raises(EpochError, match="must not change"):
        epochs.step(2, 1, 11)
    gap = EpochSteps()
    gap.step(1, 3)
    with pytest.raises(EpochError, match="epoch 3 follows epoch 1"):
        gap.step(3, 1)


def _row_log(tmp_path: Path, **task):
    from gnsweep.config import Config
    from gnsweep.runs import RunSpec
    from gnsweep.tasks.script import ScriptOptions
    from gnsweep.training.script_rows import RowLog

    config = Config.from_dict({"task": {"name": "script", "command": "python t.py", **task},
                               "sweep": {"batch_sizes": [4], "learning_rates": [0.1],
                                         "targets": [0.01]}})
    path = tmp_path / "runs" / "b00004_lr0.1_s0"
    path.mkdir(parents=True, exist_ok=True)
    return RowLog(config, RunSpec(4, 0.1), path, store.clear_metrics(path, 0),
                  ScriptOptions(**config.task.options))


PATTERN = r"epoch (?P<epoch>\d+) \| (?P<step>\d+)/(?P<total>\d+) .* loss (?P<loss>\S+)"


def test_a_restarting_counter_without_an_epoch_fails_naming_the_fix(tmp_path):
    rows = _row_log(tmp_path, log_pattern=r"\| (?P<step>\d+)/\d+ .* loss (?P<loss>\S+)")
    for step in (10, 20):
        rows.add(f"stdout line {step}", {"step": str(step), "loss": "1.0"})
    with pytest.raises(ScriptFailed, match=r"stdout line 30: steps go backwards \(step 10 after "
                       r"step 20\).* needs an epoch group in task.log_pattern"):
        rows.add("stdout line 30", {"step": "10", "loss": "0.9"})


def test_epoch_rows_become_global_steps_and_examples(tmp_path):
    rows = _row_log(tmp_path, log_pattern=PATTERN, step_offset=1, examples_per_sample=8)
    # main.py's batch counter starts at 0: batch 10 of epoch 2 is its 11th step there.
    for epoch in (1, 2):
        for batch in (10, 20):
            rows.add("x", {"epoch": str(epoch), "step": str(batch), "total": "25",
                           "loss": "1.0"})
    assert list(rows.rows["step"]) == [11, 21, 36, 46]
    assert list(rows.rows["examples"]) == [s * 4 * 8 for s in (11, 21, 36, 46)]


def test_a_log_file_epoch_column_is_mapped_and_read(tmp_path):
    from gnsweep.training.script_rows import TableLog

    path = tmp_path / "log.csv"
    path.write_text("ep,it,train_loss\n1,1,0.5\n1,2,0.4\n2,1,0.3\n")
    log = TableLog(path, "csv", {"epoch": "ep", "step": "it", "loss": "train_loss"},
                   skip_existing=False)
    rows = _row_log(tmp_path, log_file="{run_dir}/log.csv",
                    columns={"epoch": "ep", "step": "it", "loss": "train_loss"})
    for where, raw, _ in log.rows():
        rows.add(where, raw)
    assert list(rows.rows["step"]) == [1, 2, 3]


def test_a_resumed_attempt_in_a_later_epoch_keeps_the_earlier_epochs_offsets(tmp_path):
    from gnsweep.tasks.script import ScriptOptions, pattern_columns
    from gnsweep.training.script_runner import recovered

    run = tmp_path / "run"
    run.mkdir()
    # The first attempt printed epochs 1 and 2 (10 steps each, every step logged).
    lines = [f"epoch {e} | {s}/10 x loss 1.0" for e in (1, 2) for s in range(1, 11)]
    (run / "stdout.log").write_text("\n".join(lines) + "\n")
    options = ScriptOptions(command="python t.py", log_pattern=PATTERN.replace(
        r"(?P<total>\d+)", r"\d+"))
    epochs = EpochSteps()
    found = recovered(options, {}, str(tmp_path), run, pattern_columns(options.log_pattern),
                      15, epochs)
    assert [raw["step"] for _, raw in found] == [str(s) for s in range(6, 11)]  # steps 16-20
    # The next attempt resumes from its checkpoint at the start of epoch 2.
    assert epochs.step(2, 1) == 11
