"""Per-example gradient norms of sequence layers against brute force (each example's own
backward): linear layers over positions in both forms with and without a trained bias or
weight, position embeddings looked up once and broadcast over the batch (with repeated and
padding positions), LayerNorm / RMSNorm with each of their parameters frozen in turn."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.per_example import gram_is_cheaper

T = 5


class _Sequence(nn.Module):
    """Tokens and broadcast positions, norms, and linear layers over positions: `wide` takes
    the Gram form (few positions, wide), `narrow` the explicit one."""

    def __init__(self, positions: list[int], bias: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(9, 6)
        self.positions = nn.Embedding(8, 6, padding_idx=7)
        self.register_buffer("index", torch.tensor([positions]))  # (1, T): one row for all
        self.norm = nn.LayerNorm(6, bias=bias)
        self.wide = nn.Linear(6, 40, bias=bias)
        self.narrow = nn.Linear(40, 3, bias=bias)
        self.rms = nn.RMSNorm((T, 3))  # normalised over positions and features

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.tokens(tokens) + self.positions(self.index))
        return self.rms(self.narrow(torch.tanh(self.wide(h)))).mean(1)


def _brute_force(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    total = 0.0
    for i in range(len(x)):
        grads = torch.autograd.grad(((model(x[i:i + 1]) - y[i:i + 1]) ** 2).mean(), params)
        total += sum(float((g.double() ** 2).sum()) for g in grads)
    return total / len(x)


@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 4], [3, 1, 3, 7, 1]],
                         ids=["distinct", "repeated_and_padding"])
@pytest.mark.parametrize("frozen", ["none", "weights", "biases"])
@pytest.mark.parametrize("bias", [True, False])
def test_sequence_layers_match_brute_force(positions: list[int], frozen: str,
                                           bias: bool) -> None:
    assert gram_is_cheaper(T, 6, 40) and not gram_is_cheaper(T, 40, 3)  # both forms run
    torch.manual_seed(0)
    model = _Sequence(positions, bias)
    for name, p in model.named_parameters():
        if name.endswith("." + frozen[:-1]) and not name.startswith(("tokens", "positions")):
            p.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 9, (6, T), generator=g)
    y = torch.randn(6, 3, generator=g)
    expected = _brute_force(model, x, y)
    monitor = NoiseScaleMonitor(model, "per_example")
    assert not monitor.needs_microbatches  # every layer has per-example norms
    ((model(x) - y) ** 2).mean().backward()
    estimate = monitor.step()
    monitor.close()
    assert estimate is not None
    assert estimate.sq_norm_small == pytest.approx(expected, rel=1e-5)
