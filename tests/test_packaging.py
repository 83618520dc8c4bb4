"""A wheel carries conf/ inside the package, so `pip install gnsweep` works outside a checkout."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_every_conf_file(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("gnsweep-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"gnsweep/conf/{p.relative_to(ROOT / 'conf').as_posix()}"
                for p in (ROOT / "conf").rglob("*.yaml")}
    assert expected and expected <= names
    assert "gnsweep/cli.py" in names
