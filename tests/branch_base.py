"""A base run with kept checkpoints, made in-process for the branch tests: a sweep of one run
whose state is saved (`TrainState.state_dict()`) into `<run>/checkpoints/` after given steps."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from gnsweep import store
from gnsweep.config import Config, compose
from gnsweep.sweep import prepare
from gnsweep.training import StopRequested, build_run, run


def make_base_run(sweep_dir: Path, overrides: list[str], keep_steps: list[int]) -> Path:
    """Train the one run of `overrides` (one batch size, one learning rate) into `sweep_dir`,
    keeping its state after each of `keep_steps`; returns the run's folder."""
    config: Config = compose(overrides)
    (spec,) = prepare(sweep_dir, config)
    out = store.run_dir(sweep_dir, spec.run_id)
    saved = None
    for step in sorted(keep_steps):
        # Stopped at the step, saved, and continued in a run built anew from what was saved
        # (a stopped run's monitor is closed: the resume path builds a fresh one).
        state = build_run(config, spec)
        if saved is not None:
            state.load_state_dict(torch.load(saved, weights_only=True))
        with contextlib.suppress(StopRequested):
            run(state, should_stop=lambda state=state, step=step: state.step >= step)
        saved = out / "checkpoints" / f"{state.examples:012d}.pt"
        saved.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state.state_dict(), saved)
    state = build_run(config, spec)
    if saved is not None:
        state.load_state_dict(torch.load(saved, weights_only=True))
    result = run(state, out)
    store.write_status(out, result.state, reason=result.reason)
    return out
