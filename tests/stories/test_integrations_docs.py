"""The examples in docs/integrations.md run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from locations import ROOT


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "integrations.md").read_text(),
                      re.S)


@pytest.mark.parametrize("index, needs", [(0, "lightning"), (1, "transformers"),
                                          (3, "tensorboard")])
def test_integrations_doc_example_runs(index, needs, tmp_path, monkeypatch):
    pytest.importorskip(needs)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the examples write out/ and runs/ relative to the cwd
    code = _examples()[index]
    exec(compile(code, f"docs/integrations.md#{index}", "exec"), {"__name__": "docs"})


@pytest.mark.distributed
def test_integrations_doc_fsdp_example_runs_under_torchrun(tmp_path):
    """The FSDP example (index 2) as the file it says, under torchrun with 2 CPU processes."""
    code = _examples()[2]
    assert "FsdpNoiseScale" in code
    script = tmp_path / "fsdp_noise.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(script)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    value = float(done.stdout.split("B_simple")[-1])
    assert value > 0
