"""A target met before a run's smoothing window holds 64 samples is not counted (outcome early).

Curves made by hand whose crossings are known exactly: straight lines, which the centred
local-linear smoother reproduces exactly wherever its window lies inside one line. At B = 8 the
smallest window (64 samples) is 8 updates; before it the smoothed value is the local line through
the run's first rows extrapolated to its edge, and a run that blew up reads far below every loss
it logged there."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gnsweep.analysis.front import best_per_batch, censored_points
from gnsweep.analysis.pipeline import analyze_tables
from gnsweep.analysis.smoothing import settled_at_or_below
from gnsweep.analysis.steps import EARLY, centred_loss, curves_from_frames, steps_to_target

TARGET = 0.3


def steady(x: np.ndarray) -> np.ndarray:
    """From 2.3 down 0.025 an update: crosses 0.3 at exactly 80 updates."""
    return 2.3 - 0.025 * x


def blown_up(x: np.ndarray) -> np.ndarray:
    """Flat at 2.3, a blow-up to 60 and 200 at 6 and 7 updates, then from 500 at 8 straight down
    5 an update: crosses 0.3 at exactly 8 + 499.7 / 5 = 107.94 updates."""
    out = np.where(x >= 8, 500 - 5 * (x - 8), 2.3)
    out[x == 6], out[x == 7] = 60.0, 200.0
    return out


def frames(curves: dict[str, tuple[float, np.ndarray]], batch: int = 8):
    """runs and metrics tables: run id -> (learning rate, raw losses at steps 1..n)."""
    runs, rows = [], []
    for run_id, (lr, loss) in curves.items():
        runs.append({"run_id": run_id, "batch_size": batch, "learning_rate": lr, "seed": 0,
                     "state": "done"})
        rows += [{"run_id": run_id, "step": s + 1, "loss": v} for s, v in enumerate(loss)]
    return pd.DataFrame(runs), pd.DataFrame(rows)


def test_a_blown_up_run_is_read_from_where_its_window_is_whole():
    x = np.arange(109.0)  # losses logged at steps 1..109: after 0..108 updates (down to 0)
    runs, metrics = frames({"steady": (0.1, steady(x[:91])), "blown": (6.4, blown_up(x))})
    curves = curves_from_frames(runs, metrics)
    smooth = centred_loss(curves)
    # The trap: at the run's start the smoothed loss of the blown-up run is far below its
    # lowest logged loss (2.3), below the target, though its true curve is nowhere near it.
    start = smooth[curves.offsets[1]]
    assert start < TARGET < 2.3
    steps = steps_to_target(curves, None, [TARGET]).set_index("run_id")
    assert steps.loc["steady", "steps"] == pytest.approx(80.0, rel=1e-9)
    # Its first crossing where the window is whole: the straight fall's, exactly.
    assert steps.loc["blown", "steps"] == pytest.approx(8 + 499.7 / 5, rel=1e-9)
    assert (steps["outcome"] == "reached").all()
    # So the front at B = 8 is the steady run's 80 updates, not one update of the blow-up.
    best = best_per_batch(steps.reset_index())
    assert best.iloc[0]["learning_rate"] == 0.1 and best.iloc[0]["steps"] == pytest.approx(80.0)


def test_a_target_met_before_the_window_is_whole_is_not_counted_and_said_once():
    x = np.arange(91.0)
    easy = np.full(len(x), 0.2)  # below the target from the start: when it got there is unknown
    runs, metrics = frames({"steady": (0.1, steady(x)), "easy": (0.4, easy)})
    steps = steps_to_target(metrics, runs, [TARGET]).set_index("run_id")
    assert steps.loc["easy", "outcome"] == EARLY and not steps.loc["easy", "reached"]
    assert np.isnan(steps.loc["easy", "steps"])
    assert steps.loc["steady", "steps"] == pytest.approx(80.0, rel=1e-9)
    # Neither a point nor a bound: a batch size whose only reach is early is not censored.
    runs_alone, metrics_alone = frames({"easy": (0.4, easy)})
    alone = steps_to_target(metrics_alone, runs_alone, [TARGET])
    assert censored_points(alone).empty
    result = analyze_tables(runs, metrics, [TARGET])
    lines = [w for w in result.warnings if "before training on 64 samples" in w]
    assert len(lines) == 1 and "easy at 0.3" in lines[0] and "not counted" in lines[0]
    front = result.front[result.front["target"] == TARGET]
    assert front["learning_rate"].tolist() == [0.1]


def test_from_64_samples_a_step_nothing_changes():
    # One update is the smallest window: a target met by then counts as one step, as before.
    x = np.arange(40.0)
    runs, metrics = frames({"easy": (0.4, np.full(len(x), 0.2))}, batch=64)
    row = steps_to_target(metrics, runs, [TARGET]).iloc[0]
    assert row["outcome"] == "reached" and row["steps"] == 1.0
    # The raw loss has no window: one batch at every row, read from the first.
    runs, metrics = frames({"easy": (0.4, np.full(len(x), 0.2))})
    raw = steps_to_target(metrics, runs, [TARGET], loss="raw")
    assert raw.iloc[0]["outcome"] == "reached" and raw.iloc[0]["steps"] == 1.0


def test_the_loop_stops_only_where_the_analysis_counts_the_target():
    # The training loop's stop rule asks the same question: a window cut by the start is no
    # settled crossing (the run would stop with its target uncounted).
    x = np.arange(30.0)
    assert not settled_at_or_below(x, blown_up(x), TARGET, 0.2, 8.0)
    assert settled_at_or_below(np.arange(200.0), steady(np.arange(200.0)), TARGET, 0.2, 8.0)
