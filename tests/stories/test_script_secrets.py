"""Credentials in a script's command (docs/storage.md): masked in every file of the sweep and
every line printed, `--flag VALUE` as well as `--flag=VALUE` and URI passwords, as many as
the command holds; the command itself always runs with the real values, on a relaunch and on
a later `gnsweep plan`-style run of the folder's config too. Masking touches values from the
user only, never gnsweep's own words."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from locations import ROOT
from typer.testing import CliRunner

from gnsweep import paths, redact, store
from gnsweep.cli import app
from gnsweep.config import ConfigError

PY = sys.executable
SECRETS = ("TOKEN-aa11", "PASSW-bb22", "APIKEY-cc33", "URIPW-dd44", "HUB-ee55")
COMMAND = (f"{PY} train.py --token={SECRETS[0]} --password={SECRETS[1]} --api-key {SECRETS[2]} "
           f"--db postgres://alice:{SECRETS[3]}@db.local/x --hub_token '{SECRETS[4]}' "
           "--max_tokens 100 --bs={batch_size}")
TRAIN = f"""
import sys
# The real values, or the run fails: masking must never reach the command.
if sys.argv[1:10] != {["--token=" + SECRETS[0], "--password=" + SECRETS[1], "--api-key",
                      SECRETS[2], "--db", f"postgres://alice:{SECRETS[3]}@db.local/x",
                      "--hub_token", SECRETS[4], "--max_tokens"]!r}:
    sys.exit("the command did not get its real credentials")
for step in range(1, 40):
    print(f"step {{step}} loss {{1 / step}}")
"""


def _launch(tmp_path: Path, *grid: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [PY, "-m", "gnsweep", "launch", "--sweep-dir", str(tmp_path / "sweep"), "task=script",
         f"task.command={COMMAND}", r"task.log_pattern=step (?P<step>\d+) loss (?P<loss>\S+)",
         "sweep.learning_rates=[0.1]", "sweep.targets=[0.1]", "executor.workers=1", *grid],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)


def _leaks(tmp_path: Path, printed: str) -> list[str]:
    found = [f"printed: {s}" for s in SECRETS if s in printed]
    for path in (tmp_path / "sweep").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path}: {s}" for s in SECRETS if s.encode() in data]
    return found


@pytest.mark.slow
def test_credentials_in_a_command_are_masked_everywhere_and_real_where_it_runs(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("GNSWEEP_SECRET_DIR", str(tmp_path / "kept"))
    (tmp_path / "train.py").write_text(TRAIN)
    first = _launch(tmp_path, "sweep.batch_sizes=[8]")
    assert first.returncode == 0, first.stderr
    # A relaunch with a larger grid accepts its own run files (five credentials masked).
    again = _launch(tmp_path, "sweep.batch_sizes=[8,16]")
    assert again.returncode == 0, again.stderr
    sweep = tmp_path / "sweep"
    header = (sweep / "runs" / "b00016_lr0.1_s0" / "stdout.log").read_text().splitlines()[0]
    assert "--api-key *** --db postgres://alice:***@db.local/x --hub_token ***" in header
    assert "--max_tokens 100" in header  # not a credential
    shown = CliRunner().invoke(app, ["status", str(sweep)])
    printed = first.stdout + first.stderr + again.stdout + again.stderr + shown.output
    assert _leaks(tmp_path, printed) == []
    kept = list((tmp_path / "kept").iterdir())
    assert len(kept) == 1 and kept[0].stat().st_mode & 0o077 == 0

    # A later run of the folder's own config (as `gnsweep plan DIR` runs its next grid):
    # config.yaml holds the command masked, the real one comes from what the launch kept.
    from gnsweep.folder import read_config
    from gnsweep.sweep import run_specs

    for name in (paths.STATUS, paths.METRICS, paths.METRIC_PARTS, "stdout.log"):
        path = sweep / "runs" / "b00008_lr0.1_s0" / name
        if path.is_dir():
            import shutil

            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    config = read_config(sweep)
    assert redact.MASK in config.task.options["command"]
    monkeypatch.delenv(redact.SECRETS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    run_specs(config, sweep, ["b00008_lr0.1_s0"], show_progress=False)
    status = store.read_status(sweep / "runs" / "b00008_lr0.1_s0")
    assert status["state"] == "done", status
    assert _leaks(tmp_path, "") == []
    # On a machine (or user) that does not keep them: refused in one line, nothing run.
    monkeypatch.setenv("GNSWEEP_SECRET_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.delenv(redact.SECRETS_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"task.options.command holds a credential masked"):
        run_specs(config, sweep, ["b00008_lr0.1_s0"], show_progress=False)


def test_a_command_with_several_credentials_masks_each_and_only_them():
    shown = redact.value("command", COMMAND)
    assert not any(s in shown for s in SECRETS)
    assert "--max_tokens 100" in shown and "--bs={batch_size}" in shown
    assert redact.value("command", shown) == shown  # masking the masked changes nothing
    real = {"task": {"options": {"command": COMMAND}}}
    masked = {"task": {"options": {"command": shown}}}
    assert redact.restore(masked, redact.secrets(real)) == real


def test_gnsweeps_own_words_are_never_masked(tmp_path):
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "***" not in result.output, result.output
    assert redact.text("or Hydra overrides (key=value) for a new plan") == \
        "or Hydra overrides (key=value) for a new plan"
    assert redact.text("+task.api_key=hunter22") == "+task.api_key=***"  # a user's value
