"""The monitor built of sources (`gnsweep.measure.source`): what each source offers, which
sources each method holds, a reading's pair against eq. A.2 worked by hand, and the
checkpointed state's keys, which runs saved before must still find."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.ddp import DdpHook, RankGrads
from gnsweep.measure.fsdp import FsdpGrads
from gnsweep.measure.microbatch import Increments
from gnsweep.measure.per_example import PerExample
from gnsweep.measure.source import Source, StepNorms

# What a monitor's state_dict() has always held (checkpoints of earlier runs carry these).
STATE_KEYS = {"method", "steps", "timing", "choice", "estimate", "hessian_every", "ema",
              "schedule", "ema_precond", "precond_since", "since_examples", "since_steps",
              "warned", "ddp_pending"}


class _WithGru(nn.Module):
    """A Linear (per-example norms) and a GRU (none: measured with micro-batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.gru = nn.GRU(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(self.linear(x))[0].sum(dim=(1, 2))


@pytest.mark.parametrize("kind", [PerExample, Increments, DdpHook, RankGrads, FsdpGrads])
def test_every_source_has_what_the_monitor_asks(kind):
    asked = {name for name in vars(Source) if not name.startswith("_")}
    assert asked == {"splits", "preconditions", "accumulate", "read", "reset", "state_dict",
                     "load_state_dict", "close", "describe"}
    assert all(hasattr(kind, name) for name in asked), sorted(
        n for n in asked if not hasattr(kind, n))


def test_each_method_holds_its_sources():
    mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    per_example = NoiseScaleMonitor(mlp, "per_example")
    assert [type(s) for s in per_example.sources] == [PerExample]
    assert not per_example.needs_microbatches and "b_small = 1" in \
        per_example.sources[0].describe()
    per_example.close()
    micro = NoiseScaleMonitor(mlp, "microbatch")
    assert [type(s) for s in micro.sources] == [Increments] and micro.needs_microbatches
    assert "b_small = B / k" in micro.sources[0].describe()
    micro.close()
    # Per-example norms for the Linear, micro-batches for the GRU's parameters: two sources.
    model = _WithGru()
    both = NoiseScaleMonitor(model, "per_example")
    kinds = [type(s) for s in both.sources]
    assert kinds == [PerExample, Increments], kinds
    held = [p for s in both.sources for p in s.params]  # each parameter once, in one source
    assert sorted(map(id, held)) == sorted(map(id, model.parameters()))
    assert "GRU" in both.why_microbatches
    both.close()
    off = NoiseScaleMonitor(mlp, "none")
    assert off.sources == [] and not off.in_use.handles


def test_a_micro_batch_reading_is_eq_a2_worked_by_hand():
    """Two micro-batches of 1 and 3 examples with known gradients (the increments of `.grad`
    holding the batch mean), under a loss scale of 2: b_small = 2 / (1/1 + 1/3) = 1.5,
    |G_small|^2 the mean of (B / n_j)^2 |increment_j|^2, |G_big|^2 that of the sum, both over
    the loss scale squared."""
    p = nn.Parameter(torch.zeros(2))
    source = Increments([p])
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    p.grad = first.clone()
    source.accumulate(1)
    p.grad = first + second
    source.accumulate(4)
    reading = source.read(StepNorms(4, True, small_scale=4.0, big_scale=4.0))
    assert reading.complete and len(reading.parts) == 1
    sq_small, sq_big, b_small, b_big = reading.parts[0]
    assert b_small == pytest.approx(1.5) and b_big == 4.0
    assert sq_small == pytest.approx(((4 / 1) ** 2 * 5.0 + (4 / 3) ** 2 * 1.25) / 2 / 4)
    assert sq_big == pytest.approx((1.5 ** 2 + 1.0 ** 2) / 4)
    # A step in one piece: no pair, the step incomplete, and why (said once by the monitor).
    source.reset()
    p.grad = first.clone()
    source.accumulate(4)
    alone = source.read(StepNorms(4, True, 1.0, 1.0, why=lambda: "for a reason", hint="split"))
    assert not alone.complete and not alone.parts
    assert alone.warning is not None and "for a reason" in alone.warning[1]
    with pytest.raises(ValueError, match="needs >= 2 micro-batches"):
        source.read(StepNorms(4, True, 1.0, 1.0, required=True))
    assert source.read(StepNorms(4, False, 1.0, 1.0)).parts == []  # not measured: nothing


@pytest.mark.parametrize("method", ["per_example", "microbatch", "none", "auto"])
def test_the_checkpointed_state_keeps_its_keys_and_loads_back(method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    monitor = NoiseScaleMonitor(model, method, timed_auto=True)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    for _ in range(3):
        k = 2 if monitor.needs_microbatches else 1
        for xs, ys in zip(x.chunk(k), y.chunk(k), strict=True):
            (nn.functional.mse_loss(model(xs), ys) / k).backward()
            monitor.accumulate()
        monitor.step()
        model.zero_grad()
    state = monitor.state_dict()
    assert set(state) == STATE_KEYS and state["ddp_pending"] is None
    again = NoiseScaleMonitor(model, method, timed_auto=True)
    again.load_state_dict(state)
    assert again.state_dict() == state
    if method != "none":
        assert math.isfinite(again.b_simple) and again.b_simple == monitor.b_simple
    monitor.close()
    again.close()
