"""Per-example coverage proven at run time (`gnsweep.measure.per_example.coverage`), against brute
force (one backward per example): the three patterns that gave a wrong B_simple in silence (a layer
whose weight is read functionally, as nn.MultiheadAttention reads `out_proj.weight`; an
embedding reused as the output layer `x @ emb.weight.t()`; a sequence-first layer with T == B)
are measured right or refused with their true cause, on `measure_noise_scale`, the monitor in a
plain loop (auto and explicit `per_example`) and the sweep's timed auto.

Brute force gives every example's own gradient `g_i`; eq. A.2 with b_small = 1 and b_big = B
on them is the per-example estimate. Parameters moved to micro-batches are measured with
micro-batches of one example here (`microbatches=B`), so the mixed estimator is that same
number to rounding.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.measure import NoiseScaleMonitor, common, measure_noise_scale
from gnsweep.measure.per_example import coverage as coverage_module

B = T = 6


@pytest.fixture(autouse=True)
def _said_afresh(monkeypatch) -> None:
    """Facts said once per process (`say_once`) are said again in each test."""
    monkeypatch.setattr(common, "_SAID", set())


class _Attention(nn.Module):
    """`nn.MultiheadAttention` between two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        y, _ = self.att(h, h, h, need_weights=False)
        return self.head(y.mean(1))


class _Encoder(nn.Module):
    """PyTorch's own transformer: `nn.TransformerEncoder` (MultiheadAttention inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.inp(x)).mean(1))


class _FunctionalRead(nn.Module):
    """A layer whose weight is read functionally, its own forward never called: known to no
    static rule, caught by the sum check."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(torch.tanh(F.linear(h, self.proj.weight, self.proj.bias)).mean(1))


class _TiedLM(nn.Module):
    """Output layer tied functionally to the token embedding, `h @ emb.weight.t()`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(self.emb(idx))) @ self.emb.weight.t()


class _SequenceFirst(nn.Module):
    """Batch-first input made sequence-first inside: (T, B, C) layers, T == B here."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.transpose(0, 1)))
        return self.head(torch.tanh(self.mix(h)).cumsum(0).mean(0))


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _case(name: str, seed: int = 0) -> tuple[nn.Module, object, list]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "tied":
        batches = [(torch.randint(0, 11, (B, T), generator=g),
                    torch.randint(0, 11, (B, T), generator=g)) for _ in range(3)]
        return _TiedLM(), _ce, batches
    model = {"attention": _Attention, "encoder": _Encoder, "functional": _FunctionalRead,
             "sequence_first": _SequenceFirst}[name]()
    batches = [(torch.randn(B, T, 4, generator=g), torch.randn(B, 3, generator=g))
               for _ in range(3)]
    return model, _mse, batches


def _brute_force(model: nn.Module, loss_fn, batches: list) -> tuple[float, float]:
    """(|G|^2, tr Sigma) of eq. A.2 from every example's own gradient, pooled over batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    small = big = 0.0
    for x, y in batches:
        rows = []
        for i in range(len(x)):
            grads = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)
            rows.append(torch.cat([g.reshape(-1) for g in grads]).double())
        g = torch.stack(rows)
        small += float(g.square().sum(1).mean()) / len(batches)
        big += float(g.mean(0).square().sum()) / len(batches)
    n = len(batches[0][0])
    return (n * big - small) / (n - 1), (small - big) / (1 - 1 / n)


@pytest.mark.parametrize("name", ["attention", "encoder", "functional", "tied"])
@pytest.mark.parametrize("method", ["auto", "per_example"])
def test_parameters_the_hooks_miss_are_measured_with_micro_batches(name: str, method: str,
                                                                   caplog) -> None:
    """Before: B_simple -24x (attention), 0.93x (tied) of brute force, in silence. Now the
    parameters the hooks cannot see whole are measured with micro-batches (of one example
    here), the rest per-example: brute force's numbers, and one line naming them.
    nn.MultiheadAttention is measured whole per example (`gnsweep.measure.per_example.attention`):
    no micro-batches, nothing to say."""
    model, loss_fn, batches = _case(name)
    g2, trace = _brute_force(model, loss_fn, batches)
    with caplog.at_level(logging.WARNING, logger="gnsweep.measure"):
        estimate = measure_noise_scale(model, loss_fn, batches, method=method, microbatches=B)
    assert estimate.g2 == pytest.approx(g2, rel=1e-4)
    assert estimate.trace_sigma == pytest.approx(trace, rel=1e-4)
    assert estimate.b_simple == pytest.approx(trace / g2, rel=1e-4)
    said = {"attention": None, "encoder": None,
            "functional": "proj.weight: its layer's forward did not run",
            "tied": "emb.weight: what its layer's hooks saw differs from its .grad"}[name]
    if said is None:
        assert "micro-batches" not in caplog.text
    else:
        assert said in caplog.text


def test_sequence_first_with_as_many_positions_as_examples() -> None:
    """Before: 0.48x of brute force. auto measures with micro-batches; an explicit per_example
    is refused with the true cause (not positions wpe(torch.arange(T)))."""
    model, loss_fn, batches = _case("sequence_first")
    g2, trace = _brute_force(model, loss_fn, batches)
    estimate = measure_noise_scale(model, loss_fn, batches, microbatches=B)
    assert estimate.b_simple == pytest.approx(trace / g2, rel=1e-4)
    with pytest.raises(ValueError, match=r"cannot attribute the gradient of inp .*sequence-first"):
        measure_noise_scale(model, loss_fn, batches, method="per_example")


def test_sequence_first_with_other_lengths_is_measured_per_example() -> None:
    """T != B: the examples along dim 1 are taken as such (before, refused with the layout's
    reason): brute force's numbers, every parameter per example."""
    model, loss_fn, _ = _case("sequence_first")
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 7, 4, generator=g), torch.randn(4, 3, generator=g))
               for _ in range(2)]
    g2, trace = _brute_force(model, loss_fn, batches)
    monitor = NoiseScaleMonitor(model, "per_example")
    loss_fn(model(batches[0][0]), batches[0][1]).backward()
    monitor.step()
    monitor.close()
    model.zero_grad(set_to_none=True)
    assert not monitor.needs_microbatches and not monitor.unattributed
    estimate = measure_noise_scale(model, loss_fn, batches, method="per_example")
    assert estimate.g2 == pytest.approx(g2, rel=1e-4)
    assert estimate.trace_sigma == pytest.approx(trace, rel=1e-4)


def _loop_step(monitor: NoiseScaleMonitor, model: nn.Module, loss_fn, batch, pieces: int
               ) -> None:
    model.zero_grad(set_to_none=True)
    x, y = batch
    for xs, ys in zip(x.chunk(pieces), y.chunk(pieces), strict=True):
        (loss_fn(model(xs), ys) * (len(xs) / len(x))).backward()
        monitor.accumulate()
    monitor.step()


@pytest.mark.parametrize("method", ["auto", "per_example"])
def test_a_plain_loop_discards_the_step_that_found_it_then_measures_right(method: str) -> None:
    """The user's loop with accumulation (one example a micro-batch): the first measured step
    finds the tied use and is not measured; every later one is brute force's."""
    model, loss_fn, batches = _case("tied")
    monitor = NoiseScaleMonitor(model, method, ema_steps=math.inf)
    for batch in batches:
        _loop_step(monitor, model, loss_fn, batch, B)
    monitor.close()
    assert monitor.needs_microbatches and monitor.method == "per_example"
    # The first measured step, discarded, is stood for by the next (it weighs two steps).
    g2, trace = _brute_force(model, loss_fn, [batches[1], *batches[1:]])
    assert monitor.b_simple == pytest.approx(trace / g2, rel=1e-4)


def test_one_backward_a_step_logs_nan_naming_the_parameter(caplog) -> None:
    """Without micro-batches the parameters the hooks miss cannot be measured: NaN, said with
    the parameter's name and the reason, never a number from part of the model."""
    model, loss_fn, batches = _case("functional")
    monitor = NoiseScaleMonitor(model, ema_steps=math.inf)
    with caplog.at_level(logging.WARNING, logger="gnsweep.measure"):
        for batch in batches:
            _loop_step(monitor, model, loss_fn, batch, 1)
    monitor.close()
    assert math.isnan(monitor.b_simple)
    assert "proj.weight: its layer's forward did not run" in caplog.text
    assert "not measured (NaN)" in caplog.text


def test_timed_auto_of_the_sweeps_moves_to_micro_batches() -> None:
    """The sweep's monitor (timed auto): the first measured step finds the tied use, and the
    choice is micro-batches, which the parameters the hooks miss need anyway."""
    model, loss_fn, batches = _case("tied")
    monitor = NoiseScaleMonitor(model, ema_steps=math.inf, timed_auto=True)
    _loop_step(monitor, model, loss_fn, batches[0], 1)
    assert monitor.choice is not None and monitor.choice["method"] == "microbatch"
    assert monitor.estimate is None
    for batch in batches[1:]:
        _loop_step(monitor, model, loss_fn, batch, B)
    monitor.close()
    g2, trace = _brute_force(model, loss_fn, [batches[1], *batches[1:]])
    assert monitor.b_simple == pytest.approx(trace / g2, rel=1e-4)


class _LateReuse(_TiedLM):
    """Ties its output layer only from the fifth forward on: a path taken late in training."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 11)
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.mid(self.emb(idx)))
        return h @ self.emb.weight.t() if self.calls >= 5 else self.head(h)


def test_checks_run_at_the_first_measured_steps_then_from_time_to_time(monkeypatch) -> None:
    """The hooks of the check are armed on the first two measured steps and every
    CHECK_EVERY-th, idle in between; a reuse that starts late is caught at the next check."""
    monkeypatch.setattr(coverage_module, "CHECK_EVERY", 4)
    _, loss_fn, batches = _case("tied")
    torch.manual_seed(0)
    model = _LateReuse()
    monitor = NoiseScaleMonitor(model, ema_steps=math.inf)
    coverage = monitor._per_example.coverage
    armed = []
    for step in range(8):
        armed.append(coverage.armed)
        _loop_step(monitor, model, loss_fn, batches[step % 3], 1)
        if monitor.needs_microbatches:
            break
    # Measured steps 0, 1 checked, 2, 3 not, 4 checked: the reuse (from the fifth) is found.
    assert armed == [True, True, False, False, True]
    assert monitor.needs_microbatches


def test_a_scaled_loss_and_low_precision_are_no_false_alarm() -> None:
    """fp16's loss scale (`step(loss_scale=...)`) and bf16 autocast leave a covered model
    covered: the check compares like with like."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    monitor = NoiseScaleMonitor(model, "per_example")
    (_mse(model(x), y) * 1024.0).backward()
    monitor.step(loss_scale=1024.0)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _mse(model(x).float(), y)
    loss.backward()
    monitor.step()
    monitor.close()
    assert not monitor.needs_microbatches and math.isfinite(monitor.b_simple)


@pytest.mark.parametrize("name", ["batch_norm", "functional", "sequence_first"])
def test_one_backward_a_step_is_one_behaviour_whatever_the_cause(name: str, caplog) -> None:
    """A model that needs micro-batches, in a loop of one backward a step, method auto: NaN
    and the same warning, naming the cause (batch statistics, a parameter the hooks miss,
    positions taken for examples), never an error for one cause and NaN for another."""
    if name == "batch_norm":
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
        batches = [(torch.randn(B, 4), torch.randn(B, 3)) for _ in range(3)]
        loss_fn = _mse
    else:
        model, loss_fn, batches = _case(name)
    monitor = NoiseScaleMonitor(model, ema_steps=math.inf)
    with caplog.at_level(logging.WARNING, logger="gnsweep.measure"):
        for batch in batches:
            _loop_step(monitor, model, loss_fn, batch, 1)
    monitor.close()
    assert math.isnan(monitor.b_simple)
    cause = {"batch_norm": "BatchNorm1d normalises with statistics of the batch",
             "functional": "no per-example norms for proj (proj.weight",
             "sequence_first": "sequence-first"}[name]
    line = next(r.getMessage() for r in caplog.records
                if "needs >= 2 micro-batches a measured step" in r.getMessage())
    assert cause in line and "B_simple is not measured (NaN)" in line
