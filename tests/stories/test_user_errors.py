"""Operating-system errors are user errors: a folder that cannot be created or written, a full
disk, a read-only file system. Every command says which path and why in one line, exit 2, no
traceback. Real file systems: a path under a regular file (refused even to root), a tiny tmpfs
filled up and a read-only tmpfs (mounted when this process may mount, else skipped).

Also the small rough edges of issue 14: `python -m gnsweep.bench --help`, numbers in error
messages, and the launch summary of a shared sweep folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from locations import ROOT
from typer.testing import CliRunner

from gnsweep.cli import app
from gnsweep.executors.rounds import Summary

STEPS = ROOT / "docs" / "examples" / "steps.csv"


def _fails_cleanly(args: list[str], path: Path, reason: str) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("gnsweep: error:")]
    assert len(lines) == 1, result.output
    assert str(path) in lines[0] and reason in lines[0], lines[0]
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture
def blocked(tmp_path) -> Path:
    """A regular file: no folder can be made below it, whoever asks (tests run as root)."""
    path = tmp_path / "a-file"
    path.write_text("")
    return path


def test_every_writing_command_names_the_path_it_cannot_create(blocked, tiny_sweep, tmp_path):
    line = _fails_cleanly(["analyze", "--table", STEPS, "--out", blocked / "out"],
                          blocked / "out", "Not a directory")
    assert "choose another path" in line
    _fails_cleanly(["launch", "sweep=tiny", "--sweep-dir", blocked / "sweep", "-q"],
                   blocked / "sweep", "Not a directory")
    _fails_cleanly(["analyze", tiny_sweep, "--out", blocked / "tables"],
                   blocked / "tables", "Not a directory")
    # A file to be written below a file: the file in the way is named.
    _fails_cleanly(["baseline", tiny_sweep, "-o", blocked / "b.json"],
                   blocked, "File exists; a file is in the way")
    base = tmp_path / "base.json"
    assert CliRunner().invoke(app, ["baseline", str(tiny_sweep), "-o", str(base)]).exit_code == 0
    _fails_cleanly(["check", tiny_sweep, "--baseline", base, "--junit", blocked / "j.xml"],
                   blocked, "File exists")


def test_plot_and_report_name_what_is_in_their_way(tiny_sweep, tmp_path):
    sweep = tmp_path / "sweep"
    shutil.copytree(tiny_sweep, sweep)
    (sweep / "figures").write_text("")  # a file where the figures folder goes
    _fails_cleanly(["plot", sweep], sweep / "figures", "")
    (sweep / "figures").unlink()
    (sweep / "report.html").mkdir()  # a folder where the report goes
    _fails_cleanly(["report", sweep], sweep / "report.html", "Is a directory")


@contextlib.contextmanager
def _tmpfs(where: Path, options: str):
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not root'})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_is_one_line(tmp_path, tiny_sweep):
    with _tmpfs(tmp_path / "tiny-disk", "size=64k") as disk:
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as filler:
            while True:  # fill it up: what is left is smaller than any table
                filler.write(b"\0" * 4096)
                filler.flush()
        out = disk / "tables"
        line = _fails_cleanly(["analyze", tiny_sweep, "--out", out], out,
                              "No space left on device; free some space")
        assert "Detail" not in line  # the reason, not the library's wording
        assert not list(out.rglob("*.tmp"))  # nothing half-written left behind


@pytest.mark.process
def test_a_read_only_file_system_is_one_line(tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        line = _fails_cleanly(["analyze", "--table", STEPS, "--out", ro / "out"], ro / "out",
                              "Read-only file system")
        assert "writable file system" in line


def test_errors_show_numbers_as_numbers(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("batch_size,target,steps\n8,0.5,100\n16,0.5,\n")
    line = _fails_cleanly(["analyze", "--table", table, "--out", tmp_path / "o"], table,
                          "column 'steps': nan is missing or not finite (row(s) 3)")
    assert "np.float64" not in line


@pytest.mark.process
def test_bench_help_prints_help_and_runs_nothing():
    out = subprocess.run([sys.executable, "-m", "gnsweep.bench", "--help"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m gnsweep.bench")
    assert "noise-scale measurement cost" not in out.stdout  # the benchmark did not run
    noise = subprocess.run([sys.executable, "-m", "gnsweep.bench", "noise", "--help"],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": ROOT})
    assert noise.returncode == 0 and "--no-ddp" in noise.stdout


def test_the_summary_tells_this_launch_from_another():
    summary = Summary()
    for run_id, state in [("a", "done"), ("b", "done"), ("c", "diverged"), ("d", "failed"),
                          ("e", "done"), ("f", "diverged")]:
        summary.add(run_id, state)
    summary.elsewhere += ["e", "f"]  # finished by another launch while this one waited
    assert summary.describe() == ("2 done, 1 diverged, 1 failed this launch; "
                                  "2 more finished by another launch")
    assert Summary().describe() == "0 done, 0 diverged, 0 failed this launch"


@pytest.mark.slow
def test_two_launches_on_one_folder_split_the_summary(tmp_path):
    """Two real launches share a folder: each run runs once, and what each says it ran adds up
    to the grid, what one says another finished being what the other ran."""
    import re

    args = [sys.executable, "-m", "gnsweep", "launch", "-q", "--sweep-dir", str(tmp_path / "s"),
            "sweep=tiny", "sweep.batch_sizes=[8,16,32]", "sweep.learning_rates=[0.05,0.1]",
            "sweep.targets=[0.001]", "sweep.max_steps=300", "executor.workers=1"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    said = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        match = re.search(r"(\d+) done, 0 diverged, 0 failed this launch"
                          r"(?:; (\d+) more finished by another launch)?", out)
        assert match, out
        said.append((int(match[1]), int(match[2] or 0)))
    (ran_a, other_a), (ran_b, other_b) = said
    assert ran_a + ran_b == 6
    assert other_a <= ran_b and other_b <= ran_a


def test_torchrun_and_slurm_summaries_tell_runs_of_another_launch(tmp_path, monkeypatch):
    """Their launcher follows runs through status files: the launch id each attempt records
    says who ran it."""
    from gnsweep import paths, store
    from gnsweep.compose import compose
    from gnsweep.executors import LAUNCH_ENV, log_event
    from gnsweep.executors.rounds import Watcher
    from gnsweep.sweep import prepare

    specs = prepare(tmp_path, compose(["sweep=tiny", "sweep.batch_sizes=[8,32]",
                                       "sweep.learning_rates=[0.3]"]))
    ours, theirs = (paths.run_dir(tmp_path, s.run_id) for s in specs)
    for path, launch in ((ours, "mine"), (theirs, "another")):
        monkeypatch.setenv(LAUNCH_ENV, launch)
        log_event(path, "start", attempt=1)
        store.write_status(path, "done", attempts=1)
        # A run recorded done has its metrics (without them it would need a rerun).
        store.write_table(path / paths.METRICS, store.metrics_table(
            {f.name: [1] if f.name in ("step", "examples") else [0.5]
             for f in store.METRICS_SCHEMA}))
        log_event(path, "end", attempt=1, state="done")
    monkeypatch.setenv(LAUNCH_ENV, "mine")
    summary = Watcher(tmp_path, [s.run_id for s in specs], 1, None).summary()
    assert summary.elsewhere == [theirs.name]
    assert summary.describe() == ("1 done, 0 diverged, 0 failed this launch; "
                                  "1 more finished by another launch")
