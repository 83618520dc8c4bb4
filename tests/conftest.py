import os
import shutil

import pytest

# Headless figures, and one torch thread per process: tests run beside each other on 2 cores,
# and one thread keeps the tiny sweep deterministic (the committed fit baseline relies on it).
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def _tiny_sweep_once(tmp_path_factory):
    """`gnsweep launch sweep=tiny` through the CLI, once per test session."""
    from typer.testing import CliRunner

    from gnsweep.cli import app

    out = tmp_path_factory.mktemp("tiny-source") / "tiny"
    result = CliRunner().invoke(app, ["launch", "sweep=tiny", "--sweep-dir", str(out),
                                      "--workers", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def tiny_sweep(_tiny_sweep_once, tmp_path_factory):
    """A module's own copy of the launched tiny sweep (modules analyze, plot and relaunch it)."""
    out = tmp_path_factory.mktemp("tiny") / "tiny"
    shutil.copytree(_tiny_sweep_once, out)
    return out
