"""CI's fit regression: launch the tiny deterministic sweep, check it against the committed
baseline (tests/baseline/tiny.json). Regenerate that file only with an intended change."""


import pytest
from locations import ROOT
from typer.testing import CliRunner

from gnsweep.cli import app

BASELINE = ROOT / "tests" / "baseline" / "tiny.json"
runner = CliRunner()


@pytest.mark.slow
def test_tiny_sweep_matches_the_committed_baseline(tiny_sweep, tmp_path):
    # The sweep ran with one thread per process (conftest.py): deterministic for one torch
    # version on CPU; threaded reductions would change the last bits (rarely, a step count).
    sweep = tiny_sweep
    result = runner.invoke(app, ["analyze", str(sweep)])
    assert result.exit_code == 0, result.output
    junit = tmp_path / "fits.xml"
    result = runner.invoke(app, ["check", str(sweep), "--baseline", str(BASELINE), "--junit",
                                 str(junit)])
    assert result.exit_code == 0, result.output
    assert 'failures="0"' in junit.read_text()
