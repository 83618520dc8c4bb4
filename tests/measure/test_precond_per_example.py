"""B_simple_P from per-example hooks under Adam, with no micro-batches: against brute force
(one backward per example, P read from Adam's state as `gnsweep.measure.preconditioner` defines it,
eq. A.2 in the P-norm)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.per_example.tied import WEIGHED_NUMEL


class OwnRMSNorm(nn.Module):
    """A norm layer of one's own (measured by its own forward, `measure.per_example.functional`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


class Shifted(nn.Module):
    """A broadcast parameter (1, 1, C) beside a child layer (measured through its view expanded
    along the batch, `measure.per_example.broadcast`)."""

    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.mix = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x + self.shift)


class TinyLM(nn.Module):
    """Token and position embeddings (positions looked up once for the batch), a broadcast
    parameter, linear layers over positions, a LayerNorm and a custom RMSNorm."""

    def __init__(self, vocab: int = 11, dim: int = 8, t: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(t, dim)
        self.norm = nn.LayerNorm(dim)
        self.block = Shifted(dim, 2 * dim)
        self.own = OwnRMSNorm(2 * dim)
        self.head = nn.Linear(2 * dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        return self.head(self.own(torch.tanh(self.block(self.norm(h)))))


class TiedLM(nn.Module):
    """A token embedding reused as the output layer (`measure.per_example.tied.Tied`), with a
    bias."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.tok(x))))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(4, 4, 3, stride=2, groups=2), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * 3 * 3, 3))


def _classify(n: int, g: torch.Generator, shape: tuple[int, ...]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, *shape, generator=g), torch.randint(0, 3, (n,), generator=g)


def _tokens(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 11, (n, 7), generator=g)
    return x[:, :-1], x[:, 1:]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _adam_p(optimizer: torch.optim.Adam, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Adam's P = 1 / (sqrt(v / (1 - beta2^t)) + eps), from its state."""
    group = optimizer.param_groups[0]
    out = []
    for p in params:
        state = optimizer.state[p]
        v_hat = state["exp_avg_sq"] / (1 - group["betas"][1] ** float(state["step"]))
        out.append(1.0 / (v_hat.sqrt() + group["eps"]))
    return out


def _brute_b_simple_p(model: nn.Module, optimizer: torch.optim.Adam, x: torch.Tensor,
                      y: torch.Tensor) -> tuple[float, float, float]:
    """(mean_i |g_i|_P^2, |G|_P^2, B_simple_P): eq. A.2 in the P-norm with b_small = 1,
    b_big = B, each example's own gradient from its own backward (on a copy of the model, out
    of the monitor's hooks), in float64."""
    weights = [w.double() for w in _adam_p(optimizer, list(model.parameters()))]
    model = copy.deepcopy(model)
    params = list(model.parameters())
    grads = []
    for i in range(x.shape[0]):
        g = torch.autograd.grad(_loss(model, x[i:i + 1], y[i:i + 1]), params)
        grads.append([t.double() for t in g])
    n = len(grads)
    mean = [sum(g[j] for g in grads) / n for j in range(len(params))]
    small = sum(float((w * g[j] ** 2).sum()) for g in grads
                for j, w in enumerate(weights)) / n
    big = sum(float((w * m ** 2).sum()) for w, m in zip(weights, mean, strict=True))
    trace = (small - big) / (1 - 1 / n)
    g2 = (n * big - small) / (n - 1)
    return small, big, trace / g2


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., tuple]]] = {
    "mlp": (_mlp, lambda n, g: _classify(n, g, (5,))),
    "cnn": (_cnn, lambda n, g: _classify(n, g, (2, 7, 7))),
    "lm": (TinyLM, _tokens),
    "tied_lm": (TiedLM, _tokens),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("method", ["per_example", "auto"])
def test_adam_b_simple_p_from_per_example_hooks_matches_brute_force(case: str, method: str
                                                                    ) -> None:
    """Under Adam the per-example hooks give B_simple_P themselves: no step is split into
    micro-batches, and the pair of the first step with P (the second) gives brute force's
    B_simple_P to 1e-4."""
    make, data = CASES[case]
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = NoiseScaleMonitor(model, method, optimizer=optimizer, ema_fraction=0.2)
    g = torch.Generator().manual_seed(1)
    batch = 12
    for step in range(2):
        x, y = data(batch, g)
        assert monitor.microbatches(4, batch) == 1  # no split, ever
        if step == 1:
            expected = _brute_b_simple_p(model, optimizer, x, y)
            optimizer.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        estimate = monitor.step()
        optimizer.step()
        optimizer.zero_grad()
    assert monitor.method == "per_example"
    assert estimate is not None
    pair = monitor.preconditioned.ema.estimate()
    small, big, b_simple_p = expected
    assert (pair.b_small, pair.b_big) == (1.0, batch)
    assert pair.sq_norm_small == pytest.approx(small, rel=1e-4)
    assert pair.sq_norm_big == pytest.approx(big, rel=1e-4)
    # This step's B_simple_P (the window's ratio is NaN while its G^T P G is undetermined)
    assert pair.trace_sigma_step / pair.g2_step == pytest.approx(b_simple_p, rel=1e-4)
    assert math.isfinite(estimate.b_simple)
    monitor.close()


def test_a_large_tied_weight_still_splits_for_b_simple_p() -> None:
    """A weight tied across layers larger than `WEIGHED_NUMEL` has no P-weighted per-example
    norm (it would need its explicit per-example gradients): the measured steps are split into
    micro-batches for B_simple_P, as before."""
    torch.manual_seed(0)
    vocab = 1 + WEIGHED_NUMEL // 8
    emb = nn.Embedding(vocab, 8)
    head = nn.Linear(8, vocab, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.Tanh(), head)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = NoiseScaleMonitor(model, "per_example", optimizer=optimizer)
    assert monitor.wants_microbatches
    assert monitor.microbatches(4, 12) == 4
    monitor.close()
