"""Per-example gradients of layers gnsweep has no formula for, by their own forward
(`gnsweep.measure.per_example.functional`), and of parameters broadcast over the batch, through
their expanded views (`gnsweep.measure.per_example.broadcast`): a Llama-style block with a custom
RMSNorm, SwiGLU, a layer-scale module and a learned position embedding, and a ConvNeXt-style model
with LayerNorm2d, measured per-example whole (no micro-batches); a ViT-like model (class token,
position embedding, nn.TransformerEncoder); against brute force (one backward per example)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.measure import NoiseScaleMonitor, common, measure_noise_scale
from tests.measure.test_coverage import _brute_force, _ce, _mse


@pytest.fixture(autouse=True)
def _said_afresh(monkeypatch) -> None:
    """Facts said once per process (`say_once`) are said again in each test."""
    monkeypatch.setattr(common, "_SAID", set())


class _RMSNorm(nn.Module):
    """Llama's RMSNorm, as model code writes it (not torch's nn.RMSNorm)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _LayerScale(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(0.1 + 0.05 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class _LayerNorm2d(nn.LayerNorm):
    """ConvNeXt's channels-first LayerNorm: a LayerNorm computing its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight,
                            self.bias, self.eps).permute(0, 3, 1, 2)


class _Llama(nn.Module):
    """One Llama-style block: a learned position embedding broadcast over the batch, RMSNorm,
    causal attention by F.scaled_dot_product_attention, layer-scale, SwiGLU, a final RMSNorm
    and an untied head."""

    def __init__(self, vocab: int = 11, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos_embed = nn.Parameter(0.1 * torch.randn(1, 8, width))  # sliced to T, broadcast
        self.norm1, self.norm2, self.norm = (_RMSNorm(width) for _ in range(3))
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.scale = _LayerScale(width)
        self.gate = nn.Linear(width, 2 * width, bias=False)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)
        self.heads = heads

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos_embed[:, :idx.shape[1]]
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(c, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.scale(self.out(y.transpose(1, 2).reshape(b, t, c)))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(self.norm(x))


class _ConvNeXt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = _LayerNorm2d(8)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.stem(x))
        return self.head((h + self.depthwise(F.gelu(h))).mean((2, 3)))


def _case(name: str) -> tuple[nn.Module, object, list]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "llama":
        return _Llama(), _ce, [(torch.randint(0, 11, (6, 7), generator=g),
                                torch.randint(0, 11, (6, 7), generator=g)) for _ in range(2)]
    return _ConvNeXt(), _mse, [(torch.randn(6, 3, 8, 8, generator=g),
                                torch.randn(6, 3, generator=g)) for _ in range(2)]


@pytest.mark.parametrize("name", ["llama", "convnext"])
def test_custom_layers_are_measured_per_example_by_their_own_forward(name: str) -> None:
    """Before, the custom layers fell back to micro-batches for the whole model; now every
    parameter is per-example, and B_simple is brute force's to 1e-5."""
    model, loss_fn, batches = _case(name)
    monitor = NoiseScaleMonitor(model, "per_example")
    assert not monitor.needs_microbatches and monitor._per_example.functional
    monitor.close()
    g2, trace = _brute_force(model, loss_fn, batches)
    estimate = measure_noise_scale(model, loss_fn, batches, method="per_example")
    assert estimate.g2 == pytest.approx(g2, rel=1e-5)
    assert estimate.trace_sigma == pytest.approx(trace, rel=1e-5)


class _Noisy(nn.Module):
    """A custom layer with dropout inside: its forward cannot be run one example at a time
    under vmap, so its parameter is measured with micro-batches, said with the reason."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, training=True) * self.weight


def test_a_custom_layer_its_route_cannot_run_goes_to_micro_batches(caplog) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _Noisy(), nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    monitor = NoiseScaleMonitor(model, ema_steps=math.inf)
    with caplog.at_level("WARNING", logger="gnsweep.measure"):
        _mse(model(x), y).backward()
        monitor.step()
    monitor.close()
    assert monitor.needs_microbatches and monitor.estimate is None
    assert "1.weight: _Noisy's own forward cannot be run one example at a time" in caplog.text


class _ViT(nn.Module):
    """A ViT in small: patches, a class token and position embedding held as parameters of
    shape (1, ...) and broadcast over the batch, PyTorch's own transformer encoder."""

    def __init__(self, width: int = 16, patches: int = 4) -> None:
        super().__init__()
        self.patch = nn.Linear(12, width)
        self.cls_token = nn.Parameter(0.1 * torch.randn(1, 1, width))
        self.pos_embed = nn.Parameter(0.1 * torch.randn(1, patches + 1, width))
        layer = nn.TransformerEncoderLayer(width, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        return self.head(self.norm(self.encoder(h))[:, 0])


class _Projected(nn.Module):
    """A (1, C) parameter used along another dimension (`h @ w.t()`): not broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.w = nn.Parameter(torch.randn(1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x)) @ self.w.t()


@pytest.mark.parametrize("name", ["vit", "projected"])
def test_broadcast_parameters_through_their_expanded_views(name: str, caplog) -> None:
    """The ViT's class token and position embedding are per-example (nn.MultiheadAttention
    too, whole); a (1, C) parameter the model uses otherwise is found by the check and measured with
    micro-batches, said with the reason. Both agree with brute force."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        model: nn.Module = _ViT()
        batches = [(torch.randn(6, 4, 12, generator=g), torch.randn(6, 3, generator=g))
                   for _ in range(2)]
    else:
        model = _Projected()
        batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g))
                   for _ in range(2)]
    g2, trace = _brute_force(model, _mse, batches)
    with caplog.at_level("WARNING", logger="gnsweep.measure"):
        estimate = measure_noise_scale(model, _mse, batches, method="per_example",
                                       microbatches=6)
    assert estimate.g2 == pytest.approx(g2, rel=1e-4)
    assert estimate.trace_sigma == pytest.approx(trace, rel=1e-4)
    if name == "vit":
        assert "cls_token" not in caplog.text and "pos_embed" not in caplog.text
    else:
        assert "w: the model does not compute the same with it expanded along the batch" in \
            caplog.text


def test_the_sweeps_choice_says_what_was_measured_how() -> None:
    """The sweep's monitor (timed auto) keeps, in the reason status.json records, which layers
    were measured by their own forward and which parameters through their expanded views."""
    model, loss_fn, batches = _case("llama")
    monitor = NoiseScaleMonitor(model, timed_auto=True)
    x, y = batches[0]
    loss_fn(model(x), y).backward()
    monitor.step()
    monitor.close()
    assert monitor.choice is not None and monitor.choice["method"] == "per_example"
    reason = monitor.choice["reason"]
    assert "by their own forward: norm1, norm2, norm, scale" in reason
    assert "through their views expanded along the batch: pos_embed" in reason
