"""Shared by the executor tests: the tiny sweep every executor runs, and how to compare them."""

import math
import signal
from pathlib import Path

from gnsweep import paths, store
from gnsweep.compose import compose
from gnsweep.sweep import launch
from gnsweep.sweep_analysis import analyze_sweep

# Five batch sizes, not the tiny sweep's three: a hyperbola fitted to three points has one residual
# degree of freedom, so its standard errors (the yardstick below) are themselves too noisy to
# compare two executors by, now that steps-to-target carry no smoothing lag to mask that noise.
TINY = ["sweep=tiny", "sweep.batch_sizes=[8,16,32,64,128]"]
RUN_FILES = {"config.json", "status.json", "metrics.parquet", "attempts.jsonl"}


def run_sweep(sweep_dir: Path, *overrides: str):
    return launch(compose([*TINY, *overrides]), sweep_dir, show_progress=False)


def assert_same_fits_up_to_noise(a: Path, b: Path) -> None:
    """Two sweeps of the same grid on different executors see different examples (DDP ranks
    draw their own), so their fits agree only up to training noise: S_min, E_min and B_crit
    within three combined standard errors, at every target both could fit."""
    fa = analyze_sweep(a, write=False).fits.set_index("target")
    fb = analyze_sweep(b, write=False).fits.set_index("target")
    compared = 0
    for target in fa.index.intersection(fb.index):
        ra, rb = fa.loc[target], fb.loc[target]
        if ra["refused"] or rb["refused"]:
            continue
        for name in ("s_min", "e_min", "b_crit"):
            se = math.hypot(ra[f"{name}_se"], rb[f"{name}_se"])
            assert abs(ra[name] - rb[name]) <= 3 * se, (target, name, ra[name], rb[name], se)
        compared += 1
    assert compared >= 1


def assert_all_finished_once(sweep_dir: Path) -> None:
    for run_id in store.run_ids(sweep_dir):
        path = paths.run_dir(sweep_dir, run_id)
        assert store.read_status(path)["state"] in store.FINISHED, run_id
        # Rank 0 alone writes: a run folder holds exactly these files.
        assert {p.name for p in path.iterdir()} == RUN_FILES, run_id
        assert (path / "attempts.jsonl").read_text().count('"event": "start"') == 1


def terminal_signals() -> None:
    """`preexec_fn` for a launcher the tests Ctrl-C: SIGINT at its default, as under a terminal.
    A shell that starts a command in the background without job control (`make test &` in a
    script) sets SIGINT to ignored, children inherit that, and Python then installs no
    KeyboardInterrupt handler: the launcher would never see the Ctrl-C the test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
