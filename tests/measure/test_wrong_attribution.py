"""A step measured under a wrong attribution never counts: a block built from nn.Linear on
sequence-first activations (T, B, C), as Opacus' DPMultiheadAttention is, with as many
positions as examples (T == B, so shapes alone take positions for examples). The layout check
finds it on the first measured step; that step's per-example reading is dropped, in the
monitor (plain and timed, as the callbacks build it) and in `measure_noise_scale`, whose
estimate is then brute force's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from gnsweep.measure.monitor import NoiseScaleMonitor
from gnsweep.measure.offline import measure_noise_scale
from tests.measure.test_coverage import _brute_force, _mse

B = T = 8
C = 6


class _SequenceFirstAttention(nn.Module):
    """Attention from nn.Linear layers on (T, B, C), its output projection too."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, C)
        self.q, self.k, self.v, self.o = (nn.Linear(C, C) for _ in range(4))
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 4)
        h = self.inp(x).transpose(0, 1)  # (T, B, C)
        q, k, v = self.q(h), self.k(h), self.v(h)
        weights = torch.softmax(torch.einsum("tbc,sbc->bts", q, k) / C ** 0.5, -1)
        return self.head(self.o(torch.einsum("bts,sbc->tbc", weights, v)).mean(0))


def _case(batches: int) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _SequenceFirstAttention(), [(torch.randn(B, T, 4, generator=g),
                                        torch.randn(B, 3, generator=g)) for _ in range(batches)]


@pytest.mark.parametrize("timed", [False, True])
def test_the_first_step_measured_wrongly_is_dropped_in_the_monitor(timed: bool) -> None:
    model, batches = _case(1)
    monitor = NoiseScaleMonitor(model, "auto", ema_steps=math.inf, timed_auto=timed)
    x, y = batches[0]
    _mse(model(x), y).backward()
    assert monitor.step() is None  # its per-example reading took positions for examples
    assert monitor.unattributed or monitor.needs_microbatches
    monitor.close()


@pytest.mark.parametrize("count", [1, 3])
def test_measure_noise_scale_counts_no_wrongly_attributed_step(count: int) -> None:
    model, batches = _case(count)
    g2, trace = _brute_force(model, _mse, batches)
    estimate = measure_noise_scale(model, _mse, batches, method="auto", microbatches=B)
    assert estimate.g2 == pytest.approx(g2, rel=1e-4)
    assert estimate.trace_sigma == pytest.approx(trace, rel=1e-4)
