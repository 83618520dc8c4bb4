"""Per-example gradient norms of convolutions and sequence Linear layers against brute force
(each example's own backward), on shapes that take each of the two forms: the Gram ("ghost")
form where positions are few and channels many, the explicit per-example gradient elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.per_example import CONV_CHUNK, gram_is_cheaper


class _Pool(nn.Module):
    """Mean over positions: (B, C, ...) -> (B, C)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).mean(2)


def _cases() -> dict[str, tuple[nn.Module, torch.Tensor, list[bool]]]:
    """name -> (model, inputs, for each weight layer whether the Gram form is expected)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    return {
        # Few positions (4), wide channels: 4 * (96 + 32) < 96 * 32.
        "conv1d_gram": (nn.Sequential(nn.Conv1d(32, 32, 3, padding=1), nn.Tanh(), _Pool(),
                                      nn.Linear(32, 2)),
                        torch.randn(5, 32, 4, generator=g), [True, False]),
        # Many positions, narrow: explicit; stride, dilation, reflect padding, groups.
        "conv1d_explicit": (nn.Sequential(
            nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=2, padding_mode="reflect",
                      groups=2), nn.Tanh(), nn.Conv1d(6, 3, 5, padding="same"), _Pool(),
            nn.Linear(3, 2)), torch.randn(5, 4, 40, generator=g), [False, False, False]),
        "conv2d_gram": (nn.Sequential(nn.Conv2d(24, 24, 3, padding=1), nn.Tanh(), _Pool(),
                                      nn.Linear(24, 2)),
                        torch.randn(5, 24, 2, 2, generator=g), [True, False]),
        "conv2d_explicit": (nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=(2, 1), dilation=(1, 2), padding=(1, 2)), nn.ReLU(),
            nn.Conv2d(8, 4, (2, 3), padding="same", padding_mode="circular", bias=False),
            _Pool(), nn.Linear(4, 2)), torch.randn(5, 3, 9, 8, generator=g),
            [False, False, False]),
        # More examples than one call of the explicit form takes: a full chunk and a partial.
        "conv1d_explicit_chunks": (nn.Sequential(
            nn.Conv1d(2, 4, 3, padding=1, padding_mode="replicate"), nn.Tanh(), _Pool(),
            nn.Linear(4, 2)), torch.randn(CONV_CHUNK + 6, 2, 12, generator=g), [False, False]),
        "sequence_linear": (nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 3),
                                          nn.Flatten(), nn.Linear(12, 2)),
                            torch.randn(6, 4, 30, generator=g), [True, False, False]),
    }


def _expected_form(model: nn.Module, x: torch.Tensor) -> list[bool]:
    """The form `gram_is_cheaper` picks for each weight layer at its shapes."""
    forms: list[bool] = []

    def record(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            taps = module.weight[0, 0].numel()
            channels = module.in_channels // module.groups
            forms.append(gram_is_cheaper(output[0, 0].numel(), taps * channels,
                                         module.out_channels // module.groups))
        elif isinstance(module, nn.Linear):
            positions = inputs[0][0].numel() // module.in_features
            forms.append(positions > 1 and gram_is_cheaper(positions, module.in_features,
                                                           module.out_features))

    handles = [m.register_forward_hook(record) for m in model.modules()
               if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return forms


@pytest.mark.parametrize("name", list(_cases()))
def test_per_example_norms_match_brute_force(name: str) -> None:
    model, x, gram = _cases()[name]
    assert _expected_form(model, x) == gram  # the case exercises the form it is named for
    assert ("chunks" in name) == (len(x) > CONV_CHUNK)
    y = torch.randn(model(x).shape, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    expected = 0.0
    for i in range(len(x)):  # each example's own loss, its own backward
        grads = torch.autograd.grad(loss(model(x[i:i + 1]), y[i:i + 1]), params)
        expected += sum(float((gr.double() ** 2).sum()) for gr in grads) / len(x)
    monitor = NoiseScaleMonitor(model, "per_example")
    assert not monitor.needs_microbatches  # every layer has per-example norms
    model.zero_grad()
    loss(model(x), y).backward()
    estimate = monitor.step()
    monitor.close()
    assert estimate is not None
    assert estimate.sq_norm_small == pytest.approx(expected, rel=1e-5)
