"""The noise scale of a model sharded by FSDP (`fully_shard`) under torchrun, 2 CPU processes:
each rank's micro-step gradients against the sharded global gradient, checked against linreg's
closed-form B_simple at fixed parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.distributed
def test_fsdp_accumulation_reads_linreg_closed_form_b_simple():
    """At fixed parameters, pooled over 100 steps of 2 ranks x 2 micro-steps of 16 examples
    (b_small 16, b_big 64), with the gradient sync off or on during accumulation, through
    `FsdpNoiseScale`, `NoiseScaleMonitor` (auto) and `measure_noise_scale` (one backward a rank:
    b_small 32): within 12% of the closed form. A shard's norm alone, or micro-step norms on the
    wrong scale, would be off by 2x or more."""
    script = str(Path(__file__).with_name("fsdp_linreg.py"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", script, "100"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["monitor_method"] == "fsdp"
    for route in ("fsdp_nosync", "fsdp_sync", "monitor", "measure"):
        assert out[route] == pytest.approx(out["truth"], rel=0.12), route
    # |G|^2 itself (not only the ratio) is on the scale of the global mean gradient.
    assert out["fsdp_g2"] == pytest.approx(out["g2"], rel=0.15)
    assert "cannot measure a model sharded by FSDP" in out["per_example_refused"]
