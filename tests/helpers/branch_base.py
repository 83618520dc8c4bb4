"""A base run that keeps checkpoints, for the branch tests: the one run of a sweep, trained in
this process by `training.train` into its run folder with `train.keep_checkpoints_at`."""

from __future__ import annotations

from pathlib import Path

from gnsweep import paths, store
from gnsweep.compose import compose
from gnsweep.sweep import prepare
from gnsweep.training import train


def make_base_run(sweep_dir: Path, overrides: list[str], keep_at: list[int]) -> Path:
    """Train the one run of `overrides` (one batch size, one learning rate) into `sweep_dir`,
    keeping its checkpoints at `keep_at` examples; returns the run's folder."""
    keep = ",".join(str(n) for n in keep_at)
    config = compose([*overrides, f"train.keep_checkpoints_at=[{keep}]"])
    (spec,) = prepare(sweep_dir, config)
    out = paths.run_dir(sweep_dir, spec.run_id)
    result = train(config, spec, out)
    store.write_status(out, result.state, reason=result.reason)
    return out
