"""A script shaped like PyTorch's word-language-model example (tests/helpers/script_wordlm.py: a
batch counter that restarts every epoch, clipping at 0.25, plain SGD, the loss averaged over
the log interval) swept as a user would, with real processes: the epochs read as one run's
steps, a failure that would repeat said once, the recipe shown as the user gave it, and a
recommendation at the end; the live view seen in a real browser."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from locations import HELPERS, ROOT
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app

PY = sys.executable
COMMAND = (f"{PY} {HELPERS / 'script_wordlm.py'} --batch_size {{batch_size}} --lr "
           "{learning_rate} --seed {seed} --save {run_dir}/model.npy --epochs 40")
PATTERN = (r"epoch +(?P<epoch>\d+) \| +(?P<step>\d+)/ *(?P<total>\d+) batches"
           r".*loss +(?P<loss>[\d.]+)")
RECIPE = ["task.step_offset=1", "task.optimizer=sgd", "task.grad_clip=0.25",
          "task.schedule=constant", "task.examples_per_sample=8", "task.unit=tokens"]
runner = CliRunner()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS),
                                                         os.environ.get("PYTHONPATH", "")])}


@dataclass
class Launched:
    returncode: int
    stderr: str


def _launch(sweep_dir: Path, *overrides: str, command: str = COMMAND,
            pattern: str = PATTERN) -> Launched:
    """`gnsweep launch` through the CLI in this process, from the sweep's parent folder (its
    workers are forked from it, the scripts are their own processes): no interpreter and torch
    import for the launcher itself."""
    sweep_dir.parent.mkdir(parents=True, exist_ok=True)
    # The scripts' environment: restored after the test (conftest._process_state_restored).
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    with contextlib.chdir(sweep_dir.parent):
        result = runner.invoke(app, ["launch", "--sweep-dir", str(sweep_dir), "-q",
                                     "task=script", f"task.command={command}",
                                     f"task.log_pattern={pattern}", *overrides])
    return Launched(result.exit_code, result.stderr + result.stdout)


def _batches(batch_size: int, tokens: int = 20000, bptt: int = 8) -> int:
    """The script's batches an epoch: its columns of tokens cut in bptt-token pieces."""
    return (tokens // batch_size) // bptt


@pytest.mark.slow
def test_an_epoch_counter_sweeps_to_a_recommendation_with_the_recipe_shown(tmp_path):
    sweep_dir = tmp_path / "wordlm"
    done = _launch(sweep_dir, *RECIPE, "sweep.batch_sizes=[2,8,64]",
                   "sweep.learning_rates=[3,10,30]", "sweep.max_steps=400",
                   "executor.workers=2")
    assert done.returncode == 0, done.stderr[-3000:]
    for run_id in store.run_ids(sweep_dir):
        status = store.read_status(paths.run_dir(sweep_dir, run_id))
        assert status["state"] == "done" and status["attempts"] == 1, (run_id, status)
    # B=64: 39 batches an epoch, logged at batches 10, 20, 30 (counted from 0): global steps
    # 11, 21, 31, then 39 + 11, ... across every epoch.
    table = store.read_metrics(paths.run_dir(sweep_dir, "b00064_lr10_s0"))
    assert table is not None
    per_epoch = _batches(64)
    steps = table.column("step").to_pylist()
    expected = [e * per_epoch + b + 1 for e in range(40) for b in (10, 20, 30)]
    assert steps == [s for s in expected if s <= steps[-1]] and steps[-1] >= 400 - 10
    assert table.column("examples").to_pylist()[0] == 11 * 64 * 8

    analysed = runner.invoke(app, ["analyze", str(sweep_dir)])
    assert analysed.exit_code == 0, analysed.output
    assert "recommendation: " in analysed.output and "learning rate" in analysed.output
    assert "does not apply here (gradients clipped at 0.25" in analysed.output

    reported = runner.invoke(app, ["report", str(sweep_dir)])
    assert reported.exit_code == 0, reported.output
    page = (sweep_dir / "report.html").read_text()
    assert "script_wordlm.py --batch_size {batch_size}" in page  # the command, as given
    assert "sgd, clip 0.25, schedule: constant" in page
    assert "assumes plain SGD without clipping" in page
    config = (sweep_dir / "config.yaml").read_text()
    assert "\ntrain:" not in config and "grad_clip: 0.25" in config


@pytest.mark.slow
def test_failures_that_would_repeat_are_tried_once_and_said_whole(tmp_path):
    # Without an epoch group the counter restarts inside one attempt: failed once, fix named.
    no_epoch = tmp_path / "noepoch"
    done = _launch(no_epoch, "sweep.batch_sizes=[64]", "sweep.learning_rates=[10]",
                   "sweep.max_retries=2", "sweep.max_steps=200",
                   pattern=r"\| +(?P<step>\d+)/ *\d+ batches.*loss +(?P<loss>[\d.]+)")
    assert done.returncode == 1
    (run_id,) = store.run_ids(no_epoch)
    status = store.read_status(paths.run_dir(no_epoch, run_id))
    assert status["state"] == "failed" and status["attempts"] == 1
    assert status["reason"] == "will_repeat"
    assert "steps go backwards (step 10 after step 30)" in status["error"]
    assert "needs an epoch group in task.log_pattern" in status["error"]
    shown = runner.invoke(app, ["status", str(no_epoch), "--all"])
    assert shown.exit_code == 0
    # The whole reason, wrapped over lines: every word of it is there, in order.
    assert " ".join(shown.output.split()).count(" ".join(status["error"].split())) == 1


@pytest.mark.process
@pytest.mark.parametrize(("args", "repeats", "said"), [
    (["--no-such-flag"], True, "exit status 2: script_wordlm.py: error: unrecognized arguments"),
    (["--tokens", "-1"], False, "exit status 1: "),  # a crash (numpy refuses): retried
])
def test_a_bad_input_exit_repeats_and_a_crash_may_not(tmp_path, args, repeats, said):
    from gnsweep.config import Config
    from gnsweep.errors import ScriptFailed
    from gnsweep.runs import RunSpec
    from gnsweep.training.script_runner import run_script

    command = " ".join([COMMAND.replace(" --epochs 40", " --epochs 1"), *args])
    config = Config.from_dict({"task": {"name": "script", "command": command,
                                        "log_pattern": PATTERN, "cwd": str(tmp_path)},
                               "sweep": {"batch_sizes": [64], "learning_rates": [10.0]}})
    run_dir = tmp_path / "sweep" / "runs" / "b00064_lr10_s0"
    run_dir.mkdir(parents=True)
    with pytest.raises(ScriptFailed) as failed:
        run_script(config, RunSpec(64, 10.0), run_dir)
    assert failed.value.repeats is repeats and said in str(failed.value)


def _chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium"
                                         if os.path.exists("/usr/bin/chromium") else None)
    if not found:
        subprocess.run(["bash", str(ROOT / "scripts" / "install-chromium.sh")], check=True)
        found = "/usr/bin/chromium"
    return found


@pytest.mark.slow
@pytest.mark.browser
def test_the_live_view_shows_progress_and_curves_in_a_browser(tmp_path):
    sweep_dir = tmp_path / "live"
    # The scripts pace their lines while this file exists: the sweep runs on until the browser
    # has seen its live view, however long that takes, and then ends at once.
    paced = tmp_path / "paced"
    paced.touch()
    launcher = subprocess.Popen(
        [PY, "-m", "gnsweep", "launch", "--sweep-dir", str(sweep_dir), "-q", "task=script",
         f"task.command={COMMAND} --sleep 0.3 --sleep-while {paced}",
         f"task.log_pattern={PATTERN}", *RECIPE,
         "sweep.batch_sizes=[16,64]", "sweep.learning_rates=[10]", "sweep.max_steps=600",
         "executor.workers=1"], cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (sweep_dir / "config.yaml").exists():
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.1)
        watcher = subprocess.Popen([PY, "-m", "gnsweep", "report", str(sweep_dir), "--watch",
                                    "--every", "0.5"], cwd=tmp_path, env=_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        page = sweep_dir / "report.html"
        live = ""
        while time.monotonic() < deadline:
            text = page.read_text() if page.exists() else ""
            if "data-over=0" in text and "id=live-curves" in text:
                live = text
                break
            time.sleep(0.1)
        assert live, "no live page with curves while the sweep ran"
        assert "http-equiv=refresh" in live
        snapshot = tmp_path / "live.html"
        snapshot.write_text(live)
        # A budget shorter than the page's reload period (1 s): the DOM of one load.
        dom = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                              "--disable-quic", "--no-first-run",
                              "--disable-background-networking", "--disable-component-update",
                              "--disable-sync", f"--user-data-dir={tmp_path / 'chrome'}",
                              "--virtual-time-budget=500", "--dump-dom", snapshot.as_uri()],
                             capture_output=True, text=True, timeout=120)
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert 'id="progress"' in dom.stdout and "2 runs:" in dom.stdout
        assert 'data-images-loaded="' in dom.stdout
        loaded = int(dom.stdout.split('data-images-loaded="')[1].split('"')[0])
        assert loaded >= 1  # the curves figure decoded in the browser
        paced.unlink()
        out, err = watcher.communicate(timeout=240)
        assert watcher.returncode == 0, err[-2000:]
        assert "the sweep is over" in out
        final = page.read_text()
        assert "data-over=1" in final and "http-equiv=refresh" not in final
    finally:
        launcher.kill() if launcher.poll() is None else None
        launcher.wait()
