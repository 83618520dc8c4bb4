"""The examples in docs/integrations.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "integrations.md").read_text(),
                      re.S)


@pytest.mark.parametrize("index, needs", [(0, "lightning"), (1, "transformers"),
                                          (2, "tensorboard")])
def test_integrations_doc_example_runs(index, needs, tmp_path, monkeypatch):
    pytest.importorskip(needs)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the examples write out/ and runs/ relative to the cwd
    code = _examples()[index]
    exec(compile(code, f"docs/integrations.md#{index}", "exec"), {"__name__": "docs"})
