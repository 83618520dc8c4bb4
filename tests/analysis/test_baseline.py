"""`gnsweep baseline` and `gnsweep check`: record fits, pass when unchanged, fail when moved."""

import json
import math
import xml.etree.ElementTree as ET

import pandas as pd
import pytest
from typer.testing import CliRunner

from gnsweep.analysis.baseline import compare, make_baseline
from gnsweep.cli import app

runner = CliRunner()


def fits_table(b_crit=64.0, b_crit_se=4.0, target=0.5, refused=""):
    s_min = 100.0
    return pd.DataFrame([{"target": target, "s_min": s_min, "s_min_se": 5.0,
                          "e_min": b_crit * s_min, "e_min_se": 300.0, "b_crit": b_crit,
                          "b_crit_se": b_crit_se, "refused": refused}])


def by_figure(cases):
    return {(c.target, c.figure): c for c in cases}


def test_relative_and_standard_error_tolerances():
    base = make_baseline(fits_table(), rtol=0.05, k_se=0.0)
    assert all(c.ok for c in compare(base, fits_table()))
    moved = by_figure(compare(base, fits_table(b_crit=70.0)))
    # B_crit 64 -> 70 is +9.4%: beyond rtol 5%; E_min moves with it; S_min does not.
    assert not moved[0.5, "b_crit"].ok and not moved[0.5, "e_min"].ok
    assert moved[0.5, "s_min"].ok
    # Within 2 combined standard errors: |70 - 64| = 6 < 2 * hypot(4, 4) = 11.3.
    assert by_figure(compare(base, fits_table(b_crit=70.0), k_se=2.0))[0.5, "b_crit"].ok
    assert not by_figure(compare(base, fits_table(b_crit=90.0), k_se=2.0))[0.5, "b_crit"].ok


def test_lost_fits_fail_and_new_targets_do_not():
    base = make_baseline(fits_table())
    lost = compare(base, fits_table(b_crit=math.nan, refused="only 2 batch size(s)"))
    assert not any(c.ok for c in lost) and "only 2" in lost[0].message
    missing = compare(base, fits_table(target=0.3))
    assert [c.ok for c in missing if c.target == 0.5] == [False] * 3
    assert [c.ok for c in missing if c.target == 0.3] == [True]


@pytest.fixture()
def table(tmp_path):
    text = "batch_size,target,steps\n" + "".join(
        f"{b},0.5,{100 + 6400 / b:.3f}\n{b},0.2,{300 + 38400 / b:.3f}\n"
        for b in (8, 16, 32, 64, 128, 256))
    path = tmp_path / "steps.csv"
    path.write_text(text)
    return path


def analyze(table, out):
    result = runner.invoke(app, ["analyze", "--table", str(table), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_check_passes_then_fails_with_junit(tmp_path, table):
    out = analyze(table, tmp_path / "a")
    base = tmp_path / "base.json"
    result = runner.invoke(app, ["baseline", str(out), "-o", str(base)])
    assert result.exit_code == 0, result.output
    record = json.loads(base.read_text())
    assert [t["b_crit"] for t in record["targets"]] == pytest.approx([64.0, 128.0], rel=1e-4)

    junit = tmp_path / "ok.xml"
    result = runner.invoke(app, ["check", str(out), "--baseline", str(base), "--junit",
                                 str(junit)])
    assert result.exit_code == 0, result.output
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("tests") == "6" and suite.get("failures") == "0"

    # The small batches now need 20% more steps: S_min and E_min both move.
    rows = pd.read_csv(table)
    rows.loc[rows["batch_size"] <= 16, "steps"] *= 1.2
    rows.to_csv(table, index=False)
    out = analyze(table, tmp_path / "b")
    junit = tmp_path / "fail.xml"
    result = runner.invoke(app, ["check", str(out), "--baseline", str(base), "--junit",
                                 str(junit)])
    assert result.exit_code == 1
    assert "FAIL target 0.5" in result.stdout and "regressed" in result.stderr
    suite = ET.parse(junit).getroot().find("testsuite")
    failures = suite.findall("testcase/failure")
    assert len(failures) == int(suite.get("failures")) >= 2
    assert "->" in failures[0].get("message")
    # A looser relative tolerance lets the same change pass.
    result = runner.invoke(app, ["check", str(out), "--baseline", str(base), "--rtol", "5"])
    assert result.exit_code == 0, result.output


def test_bad_baseline_files_exit_2(tmp_path, table):
    out = analyze(table, tmp_path / "a")
    for content in ("{not json", json.dumps({"version": 99, "targets": []})):
        base = tmp_path / "base.json"
        base.write_text(content)
        result = runner.invoke(app, ["check", str(out), "--baseline", str(base)])
        assert result.exit_code == 2 and "base.json" in result.stderr, result.output
    result = runner.invoke(app, ["check", str(tmp_path / "nothing"), "--baseline", str(base)])
    assert result.exit_code == 2
