"""A worker's notices, once per launch, change gnsweep's logger only where a worker serves."""

from __future__ import annotations

import logging

from gnsweep.compose import compose
from gnsweep.notices import kept_logging, once_per_launch
from gnsweep.sweep import prepare

log = logging.getLogger("gnsweep.tracking")


def test_notices_go_to_stderr_once_and_the_logger_is_handed_back(tmp_path, caplog, capfd):
    gnsweep = logging.getLogger("gnsweep")
    before = list(gnsweep.handlers)
    with caplog.at_level(logging.WARNING, logger="gnsweep.tracking"):
        with kept_logging():
            once_per_launch(tmp_path, "L")
            once_per_launch(tmp_path, "L")  # again: its handler replaced, not a second one
            log.warning("said in the worker")
            log.warning("said in the worker")
        assert capfd.readouterr().err.count("said in the worker") == 1
        assert not caplog.records  # the worker's own handler, not propagated
        log.warning("said after")
    assert [r.getMessage() for r in caplog.records] == ["said after"]
    assert gnsweep.propagate and gnsweep.handlers == before


def test_a_worker_served_in_process_hands_the_callers_logging_back(tmp_path, caplog,
                                                                   monkeypatch):
    from gnsweep.executors import LAUNCH_ENV, worker

    prepare(tmp_path, compose(["sweep=tiny", "sweep.batch_sizes=[8]",
                               "sweep.learning_rates=[0.3]"]))
    runs_file = tmp_path / "todo"
    runs_file.write_text("")  # nothing to train: only the worker's set-up and end
    monkeypatch.setenv(LAUNCH_ENV, "a-launch")  # as its launcher hands down
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert worker.main([str(tmp_path), "--runs-file", str(runs_file)]) == 0
    with caplog.at_level(logging.WARNING, logger="gnsweep.tracking"):
        log.warning("said after the worker")
    assert [r.getMessage() for r in caplog.records] == ["said after the worker"]
