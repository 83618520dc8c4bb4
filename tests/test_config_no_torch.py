"""Loading a sweep's config and analysing it need no torch: a subprocess whose import system
refuses `torch` loads a real sweep folder's config through the public reader."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gnsweep import paths, store
from gnsweep.compose import compose
from gnsweep.config import ConfigError
from gnsweep.folder import read_config
from gnsweep.sweep import prepare

BLOCK_TORCH = textwrap.dedent("""
    import sys

    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, BlockTorch())
    """)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.process
def test_the_hook_really_blocks_torch():
    result = _run("import torch")
    assert result.returncode != 0 and "blocked in this test" in result.stderr


@pytest.mark.process
def test_config_load_works_where_torch_cannot_be_imported(tmp_path):
    config = compose(["task=linreg", "sweep=tiny", "task.dim=4", "noise.hessian_every=7"])
    prepare(tmp_path, config)
    result = _run(f"""
        from pathlib import Path
        from gnsweep.folder import read_config
        import gnsweep.tasks, gnsweep.store, gnsweep.errors
        config = read_config(Path({str(tmp_path)!r}))
        print(config.task.name, config.task.options["dim"], config.noise.hessian_every,
              config.sweep.batch_sizes)
        assert "torch" not in sys.modules
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["linreg", "4", "7", "[8,", "32,", "128]"]
    assert read_config(tmp_path) == config


def test_config_load_names_a_missing_or_broken_file(tmp_path):
    with pytest.raises(store.StoreError, match=r"config\.yaml: missing"):
        read_config(tmp_path)
    (tmp_path / paths.SWEEP_CONFIG).write_text("sweep: {max_steps: -3}\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: sweep\.max_steps: -3"):
        read_config(tmp_path)


@pytest.mark.process
def test_pure_modules_import_neither_torch_nor_matplotlib():
    result = _run("""
        import gnsweep.analysis.pipeline, gnsweep.commands.analyze, gnsweep.analysis.results
        import gnsweep.report.console, gnsweep.report.views, gnsweep.report.answers
        import gnsweep.config, gnsweep.report.html, gnsweep.noise, gnsweep.runs, gnsweep.store
        import gnsweep.tasks
        print(sorted(m for m in ("torch", "matplotlib") if m in sys.modules))
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
