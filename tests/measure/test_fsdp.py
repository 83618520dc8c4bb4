"""The noise scale of a model sharded by FSDP (`fully_shard`) under torchrun, 2 CPU processes:
each rank's micro-step gradients against the sharded global gradient, checked against linreg's
closed-form B_simple at fixed parameters and against plain autograd on an unsharded copy. One
torchrun run (tests/helpers/fsdp_linreg.py) serves every test here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from locations import HELPERS

# Its tests share one module-scoped torchrun job: on one xdist worker it runs once, not twice.
pytestmark = pytest.mark.xdist_group("fsdp")


@pytest.fixture(scope="session")
def fsdp_run() -> dict[str, Any]:
    script = str(HELPERS / "fsdp_linreg.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", script, "100"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.distributed
def test_fsdp_accumulation_reads_linreg_closed_form_b_simple(fsdp_run):
    """At fixed parameters, pooled over 100 steps of 2 ranks x 2 micro-steps of 16 examples
    (b_small 16, b_big 64), with the gradient sync off or on during accumulation, through
    `FsdpNoiseScale`, `NoiseScaleMonitor` (auto) and `measure_noise_scale` (one backward a rank:
    b_small 32), with bf16 parameters, and on a 1-rank mesh (b_small 16, b_big 32): within 12%
    of the closed form. A shard's norm alone, or micro-step norms on the wrong scale, would be
    off by 2x or more."""
    out = fsdp_run
    assert out["monitor_method"] == "fsdp"
    for route in ("fsdp_nosync", "fsdp_sync", "monitor", "measure", "bf16", "one_rank"):
        assert out[route] == pytest.approx(out["truth"], rel=0.12), route
    # |G|^2 itself (not only the ratio) is on the scale of the global mean gradient.
    assert out["fsdp_g2"] == pytest.approx(out["g2"], rel=0.15)


@pytest.mark.distributed
def test_fsdp_refuses_what_it_cannot_measure(fsdp_run):
    """Other methods on a sharded model, one backward a step on one rank (one batch size), and
    two backward passes without micro_step() between them: refused, saying why."""
    assert "cannot measure a model sharded by FSDP" in fsdp_run["per_example_refused"]
    assert "one batch size only" in fsdp_run["one_backward_refused"]
    assert "two backward passes in one micro-step" in fsdp_run["unclosed_refused"]


@pytest.mark.distributed
def test_fsdp_norms_of_a_model_sharded_layer_by_layer_match_plain_autograd(fsdp_run):
    """An MLP sharded per layer and as a whole, micro-steps of 10 and 22 examples: the micro-step
    norms (each micro-batch's mean gradient), their harmonic-mean size and the global gradient's
    norm equal plain autograd's on an unsharded copy."""
    assert fsdp_run["nested"] == pytest.approx(fsdp_run["brute"], rel=1e-5)
