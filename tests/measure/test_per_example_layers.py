"""Per-example gradients on the layers people use, against brute force (one backward per
example, eq. A.2 with b_small = 1 on every example's own gradient): `nn.MultiheadAttention`
measured whole (`gnsweep.measure.per_example.attention`) with batch_first true and false, masks,
weights asked for, separate key/value sizes, `bias_k`/`bias_v`; PyTorch's `nn.TransformerEncoder`
and a `nn.TransformerDecoderLayer` with a causal mask; a nanoGPT-style model whose positions are
`wpe(torch.arange(T))` and whose output layer is tied to the token embedding
(`gnsweep.measure.per_example.positions`). Each is proven per example (the monitor says what it
measured how, and needs no micro-batches), not only right. And B_simple_P (`b_simple_precond`) NaN
while it is not determined, with one line saying why, on the monitor's and the callbacks' paths."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.integrations._common import metrics
from gnsweep.measure import NoiseScaleMonitor, common, measure_noise_scale
from tests.measure.test_coverage import _brute_force, _ce, _mse

B, T, C = 6, 5, 8


@pytest.fixture(autouse=True)
def _said_afresh(monkeypatch) -> None:
    """Facts said once per process (`say_once`) are said again in each test."""
    monkeypatch.setattr(common, "_SAID", set())


def _padding(x: torch.Tensor) -> torch.Tensor:
    """A key-padding mask that is each example's own (from its inputs), the first position
    never padded."""
    padding = x[..., 0] > 0.8
    padding[:, 0] = False
    return padding


class _Attention(nn.Module):
    """nn.MultiheadAttention between batch-first linear layers, called as `case` says."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.inp = nn.Linear(4, C)
        first = case != "sequence_first"
        if case == "kdim":
            self.att = nn.MultiheadAttention(C, 2, kdim=6, vdim=3, batch_first=True)
            self.key, self.value = nn.Linear(4, 6), nn.Linear(4, 3)
        else:
            self.att = nn.MultiheadAttention(C, 2, batch_first=first,
                                             add_bias_kv=case == "bias_kv")
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        padding = _padding(x)
        if self.case == "sequence_first":  # (L, N, E) in and out
            y, _ = self.att(*(h.transpose(0, 1),) * 3, key_padding_mask=padding,
                            attn_mask=causal, need_weights=False)
            y = y.transpose(0, 1)
        elif self.case == "kdim":  # separate q/k/v weights, a cross-attention
            y, _ = self.att(h, self.key(x), self.value(x), key_padding_mask=padding)
        elif self.case == "causal":  # the is_causal hint with its mask, weights not asked
            y, _ = self.att(h, h, h, attn_mask=causal, is_causal=True, need_weights=False)
        elif self.case == "weights":  # need_weights (default), a boolean mask per head
            mask = (x[:, :, None, 0] * x[:, None, :, 1] > 0.5).repeat_interleave(2, 0)
            mask[..., 0] = False  # every query sees at least one key
            y, _ = self.att(h, h, h, attn_mask=mask)
        else:  # bias_kv
            y, _ = self.att(h, h, h, key_padding_mask=padding)
        return self.head(y.mean(1))


class _Encoder(nn.Module):
    """PyTorch's own transformer encoder (no dropout), padding masked; batch-first, or
    sequence-first as PyTorch's default (its linear layers and norms then see (T, B, C))."""

    def __init__(self, first: bool = True) -> None:
        super().__init__()
        self.first = first
        self.inp = nn.Linear(4, C)
        layer = nn.TransformerEncoderLayer(C, 2, 16, dropout=0.0, batch_first=first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = _padding(x)
        h = self.inp(x) if self.first else self.inp(x).transpose(0, 1)
        y = self.encoder(h, src_key_padding_mask=padding)
        return self.head(y.mean(1 if self.first else 0))


class _Decoder(nn.Module):
    """A nn.TransformerDecoderLayer with a causal mask on its self-attention, and
    cross-attention to a memory."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mem = nn.Linear(4, C), nn.Linear(4, C)
        self.decoder = nn.TransformerDecoderLayer(C, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        y = self.decoder(self.inp(x), torch.tanh(self.mem(x.flip(1))), tgt_mask=causal,
                         tgt_is_causal=True)
        return self.head(y.mean(1))


class _LayerNorm(nn.Module):
    """nanoGPT's LayerNorm (a module of its own around F.layer_norm)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.bias = nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class _NanoGpt(nn.Module):
    """nanoGPT in small: `pos = wpe(torch.arange(t)); x = wte(idx) + pos`, one causal block,
    `lm_head.weight = wte.weight` (tied)."""

    def __init__(self, vocab: int = 11, context: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, C), nn.Embedding(context, C)
        self.ln_1, self.ln_2, self.ln_f = _LayerNorm(C), _LayerNorm(C), _LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.lm_head = nn.Linear(C, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.heads = heads

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, C))
        x = x + self.proj(F.gelu(self.fc(self.ln_2(x))))
        return self.lm_head(self.ln_f(x))


class _PositionsOtherwise(nn.Module):
    """Positions looked up without a batch dimension and not broadcast over the examples:
    `pos.unsqueeze(0)` gives a new leading dimension, which an expanded output would change."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, C)
        self.pos = nn.Embedding(T, C)
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.arange(x.shape[1])).unsqueeze(0)
        return self.head(torch.tanh(self.inp(x) + pos).mean(1))


def _case(name: str, batch: int = B, length: int = T) -> tuple[nn.Module, object, list]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "nanogpt":
        return _NanoGpt(), _ce, [(torch.randint(0, 11, (batch, length), generator=g),
                                  torch.randint(0, 11, (batch, length), generator=g))
                                 for _ in range(2)]
    model = {"encoder": _Encoder, "decoder": _Decoder,
             "encoder_sequence_first": lambda: _Encoder(first=False),
             "positions_otherwise": _PositionsOtherwise}.get(name)
    built = model() if model is not None else _Attention(name)
    return built, _mse, [(torch.randn(batch, length, 4, generator=g),
                          torch.randn(batch, 3, generator=g)) for _ in range(2)]


def _per_example(name: str, model: nn.Module, loss_fn, batches: list) -> None:
    """B_simple and its parts within 1e-4 of brute force, with every parameter measured per
    example (no micro-batches), and the monitor saying how."""
    monitor = NoiseScaleMonitor(model, "per_example")
    x, y = batches[0]
    loss_fn(model(x), y).backward()
    monitor.step()
    model.zero_grad(set_to_none=True)
    described = monitor.sources[0].describe()
    monitor.close()
    assert not monitor.needs_microbatches and len(monitor.sources) == 1, described
    route = "looked up once for the batch" if name == "nanogpt" else \
        "nn.MultiheadAttention whole"
    assert route in described
    g2, trace = _brute_force(model, loss_fn, batches)
    estimate = measure_noise_scale(model, loss_fn, batches, method="per_example")
    assert estimate.g2 == pytest.approx(g2, rel=1e-4)
    assert estimate.trace_sigma == pytest.approx(trace, rel=1e-4)
    assert estimate.b_simple == pytest.approx(trace / g2, rel=1e-4)


@pytest.mark.parametrize("name", ["sequence_first", "kdim", "causal", "weights", "bias_kv"])
def test_multihead_attention_is_measured_whole_per_example(name: str) -> None:
    """Before: its parameters went to micro-batches (out_proj is read inside
    F.multi_head_attention_forward). Now per example, in each way it is called."""
    _per_example(name, *_case(name))


@pytest.mark.parametrize("name", ["encoder", "encoder_sequence_first", "decoder"])
def test_pytorch_transformers_are_measured_per_example(name: str) -> None:
    """The sequence-first encoder (batch_first=False, PyTorch's default; T = 5 != B = 6): its
    linear layers and norms see the examples along dim 1; before, the whole model went to
    micro-batches."""
    _per_example(name, *_case(name))


@pytest.mark.parametrize("batch,length", [(6, 5), (6, 6)])
def test_nanogpt_positions_and_tied_head_per_example(batch: int, length: int) -> None:
    """`wpe(torch.arange(T))`: before, the whole model went to micro-batches (T != B) or was
    refused (explicit per_example); with T == B shapes alone took positions for examples."""
    _per_example("nanogpt", *_case("nanogpt", batch, length))


def test_positions_used_otherwise_go_to_micro_batches_alone(caplog) -> None:
    """A lookup without a batch dimension that the model does not broadcast over the
    examples: found by the check before any expanded output is used, its weight measured with
    micro-batches (one example each here: the mixed estimator is brute force's), said with the
    reason; the rest stays per example."""
    model, loss_fn, batches = _case("positions_otherwise")
    g2, trace = _brute_force(model, loss_fn, batches)
    with caplog.at_level(logging.WARNING, logger="gnsweep.measure"):
        estimate = measure_noise_scale(model, loss_fn, batches, method="per_example",
                                       microbatches=B)
    assert estimate.g2 == pytest.approx(g2, rel=1e-4)
    assert estimate.trace_sigma == pytest.approx(trace, rel=1e-4)
    assert "no per-example norms for pos (pos is looked up without a batch dimension and the " \
        "model does not compute the same" in caplog.text


@pytest.mark.parametrize("need_weights", [False, True])
def test_attention_dropout_is_measured_per_example(need_weights: bool) -> None:
    """Attention dropout while training (PyTorch's transformer layers' default): its masks are
    drawn again from the random state before the module's forward, so the per-example
    gradients are those of the step that trained. Ground truth: every example's own gradient
    from that same batched forward (the examples are independent in it, each with its own
    masks), one backward of each example's loss."""
    torch.manual_seed(0)
    model = _Dropped(need_weights)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, T, 4, generator=g), torch.randn(B, 3, generator=g)
    monitor = NoiseScaleMonitor(model, "per_example", ema_steps=math.inf)
    torch.manual_seed(5)
    _mse(model(x), y).backward()
    monitor.step()
    monitor.close()
    assert not monitor.needs_microbatches and monitor.estimate is not None
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(5)  # the same masks: the same batched forward
    out = model(x)
    rows = []
    for i in range(B):
        grads = torch.autograd.grad(((out[i] - y[i]) ** 2).mean(), params, retain_graph=True)
        rows.append(torch.cat([grad.reshape(-1) for grad in grads]).double())
    per = torch.stack(rows)
    small = float(per.square().sum(1).mean())
    big = float(per.mean(0).square().sum())
    assert monitor.estimate.g2 == pytest.approx((B * big - small) / (B - 1), rel=1e-4)
    assert monitor.estimate.trace_sigma == pytest.approx((small - big) / (1 - 1 / B), rel=1e-4)


class _Dropped(nn.Module):
    """nn.MultiheadAttention with attention dropout (and dropout around it), padding masked."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.inp = nn.Linear(4, C)
        self.att = nn.MultiheadAttention(C, 2, dropout=0.3, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.inp(x)))
        y, _ = self.att(h, h, h, key_padding_mask=_padding(x), need_weights=self.need_weights)
        return self.head(y.mean(1))


def test_b_simple_precond_is_nan_while_not_determined(caplog) -> None:
    """At the optimum of a linear regression (G = 0) the window's G^T P G estimate is negative
    on the first steps: b_simple_precond is NaN there, said once with why (never a negative
    batch size), and the ratio of the EMAs once both are positive; the callbacks log it the
    same way (NaN, one line)."""
    torch.manual_seed(0)
    w = torch.randn(1, 4)
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = NoiseScaleMonitor(model, "per_example", ema_steps=math.inf, optimizer=optimizer)
    g = torch.Generator().manual_seed(3)
    seen = []
    with caplog.at_level(logging.WARNING, logger="gnsweep.measure"):
        for _ in range(8):
            x = torch.randn(16, 4, generator=g)
            y = x @ w.t() + 0.1 * torch.randn(16, 1, generator=g)
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            estimate = monitor.step()
            assert estimate is not None
            seen.append((estimate.g2_precond, estimate.trace_sigma_precond,
                         estimate.b_simple_precond))
    monitor.close()
    assert any(g2 <= 0 for g2, _, _ in seen) and any(g2 > 0 for g2, _, _ in seen)
    for step, (g2, trace, b) in enumerate(seen):
        if g2 <= 0 or step == 0:
            assert math.isnan(b)
        else:
            assert b == pytest.approx(trace / g2, rel=1e-9)
    said = [r.getMessage() for r in caplog.records if "b_simple_precond is NaN" in r.getMessage()]
    assert len(said) == 1 and "G^T P G is -" in said[0]
    assert monitor.estimate is not None
    negative = replace(monitor.estimate, g2_precond=-1e-3, b_simple_precond=math.nan)
    with caplog.at_level(logging.WARNING, logger="gnsweep.integrations"):
        caplog.clear()
        said_keys: set[str] = set()
        for _ in range(2):
            logged = metrics(negative, with_b_noise=False, said=said_keys)
            assert math.isnan(logged["b_simple_precond"])
    lines = [r.getMessage() for r in caplog.records if "b_simple_precond" in r.getMessage()]
    assert len(lines) == 1 and "logged as NaN while the window's estimate of G^T P G" in lines[0]
