"""`make paper`: every registered family's sweep launched, analysed and compared; resumable.

Run on digits and linreg with the tiny sweep (`PAPER_ARGS="--tasks digits linreg --sweep
tiny"`): the rule and the script are the ones `make paper` runs, only the grid is small.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from locations import ROOT

from gnsweep import paths, store, tasks

FAMILIES = ["digits", "linreg"]
"""The families the tiny sweep suits (its targets are losses of 0.5 to 0.2)."""


def _script():
    spec = importlib.util.spec_from_file_location("paper", ROOT / "scripts" / "paper.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paper_refuses_an_unknown_task(capsys):
    assert _script().main(["--tasks", "nope"]) == 2
    assert "task nope is not one of" in capsys.readouterr().err


def test_paper_plans_every_registered_task(capsys, tmp_path):
    assert _script().main(["--paper-dir", str(tmp_path), "--dry-run"]) == 0
    planned = [line.split(":")[0] for line in capsys.readouterr().out.splitlines()]
    # Every listed task is planned, or named with why it cannot run (no default sweep).
    assert sorted(planned) == sorted(tasks.task_names())


def _make_paper(paper: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # BIN: this interpreter's folder; STAMP empty: the package is already installed here.
    return subprocess.run(
        ["make", "-C", str(ROOT), "paper", f"PAPER_DIR={paper}",
         f"BIN={Path(sys.executable).parent}", "STAMP=",
         f"PAPER_ARGS=--tasks {' '.join(FAMILIES)} --sweep tiny --workers 2"],
        env=env, capture_output=True, text=True, check=False)


def _mtimes(paper: Path, pattern: str) -> dict[str, float]:
    return {str(p.relative_to(paper)): p.stat().st_mtime for p in paper.glob(pattern)}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_paper_compares_every_family_and_resumes(tmp_path, _tiny_sweep_once):
    paper = tmp_path / "paper"
    # digits' tiny sweep is the session's (conftest: `gnsweep launch sweep=tiny --workers 2`,
    # the launch `make paper` makes for digits): its launch finds every run done, linreg's
    # trains them all.
    shutil.copytree(_tiny_sweep_once, paper / FAMILIES[0])
    first = _make_paper(paper)
    assert first.returncode == 0, first.stdout + first.stderr
    families = FAMILIES
    table = store.read_table(paper / "compare" / "compare.parquet").to_pandas()
    assert sorted(set(table["task"])) == sorted(families)
    assert (paper / "compare" / "bcrit_vs_noise_scale.png").is_file()
    for task in families:
        assert (paper / task / "fits.parquet").is_file()

    # Lose one run of the first family; the relaunch trains that run alone and re-analyses only
    # its sweep.
    metrics = _mtimes(paper, "*/runs/*/metrics.parquet")
    fits = _mtimes(paper, "*/fits.parquet")
    lost = sorted(k for k in metrics if k.startswith(f"{families[0]}/"))[0]
    (paper / lost).unlink()
    (paper / lost).with_name(paths.STATUS).unlink()
    second = _make_paper(paper)
    assert second.returncode == 0, second.stdout + second.stderr
    after = _mtimes(paper, "*/runs/*/metrics.parquet")
    assert set(after) == set(metrics)
    assert [k for k in after if after[k] != metrics[k]] == [lost]
    fits_after = _mtimes(paper, "*/fits.parquet")
    changed = sorted(k for k in fits if fits_after[k] != fits[k])
    assert changed == [f"{families[0]}/fits.parquet"]
    assert len(store.read_json(paper / "timings.json")) == 2
