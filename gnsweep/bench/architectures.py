"""Tiny models of the architectures people train, with i.i.d. data and a batch-mean loss, for the
noise-scale checks against brute force (tests/measure/test_architectures.py) and for `make bench`.

Each builder returns an `Architecture`: the model (random init, seeded), `sample(n, generator)`
drawing a batch of n independent examples, and `loss(model, batch)` the batch-mean loss (a
task's `loss`, as `measure_noise_scale(..., task_loss=...)` takes it). Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, LENGTH = 16, 12


@dataclass
class Architecture:
    name: str
    model: nn.Module
    sample: Callable[[int, torch.Generator], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]


def _classification(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _regression(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _teacher_images(seed: int) -> Callable[[int, torch.Generator], Any]:
    """8x8 images of noise; targets: 3 smooth functions of them (a random teacher) plus a
    little noise."""
    teacher = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(seed)) / 8

    def sample(n: int, generator: torch.Generator) -> Any:
        x = torch.randn(n, 1, 8, 8, generator=generator)
        y = torch.tanh((x.unsqueeze(1) * teacher).sum((2, 3, 4)) * 2)
        return x, y + 0.1 * torch.randn(y.shape, generator=generator)

    return sample


def mlp(seed: int = 0) -> Architecture:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))
    teacher = torch.randn(10, 4, generator=torch.Generator().manual_seed(seed + 1))

    def sample(n: int, generator: torch.Generator) -> Any:
        x = torch.randn(n, 10, generator=generator)
        y = torch.multinomial((x @ teacher).softmax(1), 1, generator=generator).squeeze(1)
        return x, y

    return Architecture("mlp", model, sample, _classification)


def _cnn(norm: Callable[[int], nn.Module], name: str, seed: int) -> Architecture:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), norm(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, padding=1), norm(8), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 3))
    return Architecture(name, model, _teacher_images(seed + 1), _regression)


def cnn_batchnorm(seed: int = 0) -> Architecture:
    """A CNN with `nn.BatchNorm2d`: its examples interact through the batch statistics."""
    return _cnn(nn.BatchNorm2d, "cnn_batchnorm", seed)


def cnn_groupnorm(seed: int = 0) -> Architecture:
    return _cnn(lambda c: nn.GroupNorm(2, c), "cnn_groupnorm", seed)


def _markov_sample(seed: int) -> Callable[[int, torch.Generator], Any]:
    """Sequences of a random Markov chain over VOCAB tokens (inputs and next-token targets)."""
    logits = 2.0 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))
    transition = logits.softmax(1)

    def sample(n: int, generator: torch.Generator) -> Any:
        tokens = torch.empty(n, LENGTH + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(VOCAB, (n,), generator=generator)
        for t in range(LENGTH):
            tokens[:, t + 1] = torch.multinomial(transition[tokens[:, t]], 1,
                                                 generator=generator).squeeze(1)
        return tokens

    return sample


class LstmLm(nn.Module):
    """Embedding, one `nn.LSTM` layer, a linear head: the paper's language models in small."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        return self.head(hidden)


def _lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    if not isinstance(logits, torch.Tensor):
        logits = logits.logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def lstm_lm(seed: int = 0) -> Architecture:
    torch.manual_seed(seed)
    return Architecture("lstm_lm", LstmLm(), _markov_sample(seed + 1), _lm_loss)


def gpt2(seed: int = 0) -> Architecture:
    """GPT-2 from `transformers.GPT2Config` (random init, no download): `Conv1D` layers and an
    embedding tied to the output layer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    # bos/eos inside the small vocabulary (GPT-2's 50256 draws a warning; neither is used).
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=24, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(config)
    return Architecture("gpt2", model, _markov_sample(seed + 1), _lm_loss)


class RMSNorm(nn.Module):
    """Llama's RMSNorm as model code writes it (not torch's `nn.RMSNorm`): a layer of one's
    own, measured per-example by its own forward (`gnsweep.measure.per_example.functional`)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaLm(nn.Module):
    """A Llama-style block in small: custom RMSNorm, causal attention by
    `F.scaled_dot_product_attention`, SwiGLU, and a learned position embedding held as a
    parameter of shape (1, T, C) broadcast over the batch (ViT's `pos_embed`, which per-example
    norms cannot split: its gradient arrives summed over the examples)."""

    def __init__(self, width: int = 24, heads: int = 2, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, LENGTH, width))
        self.blocks = nn.ModuleList(_LlamaBlock(width, heads) for _ in range(depth))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos_embed[:, :tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class _LlamaBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.gate = nn.Linear(width, 2 * width, bias=False)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(c, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def llama(seed: int = 0) -> Architecture:
    torch.manual_seed(seed)
    return Architecture("llama", LlamaLm(), _markov_sample(seed + 1), _lm_loss)


BUILDERS: dict[str, Callable[[int], Architecture]] = {
    "mlp": mlp, "cnn_batchnorm": cnn_batchnorm, "cnn_groupnorm": cnn_groupnorm,
    "lstm_lm": lstm_lm, "gpt2": gpt2, "llama": llama}


def slightly_trained(arch: Architecture, steps: int = 30, batch_size: int = 32,
                     lr: float = 0.05, seed: int = 0) -> Architecture:
    """`arch` after a few SGD steps (away from the initialisation, not converged)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(arch.model.parameters(), lr=lr)
    arch.model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        arch.loss(arch.model, arch.sample(batch_size, generator)).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return arch


def brute_force_b_simple(arch: Architecture, batches: list[Any]) -> float:
    """B_simple from independent batch gradients, each by plain autograd (no hooks), at fixed
    parameters: with G_j the gradients of the `batches` (B examples each), tr(Sigma) = B *
    (their sample variance, summed over coordinates) and |G|^2 = |mean G_j|^2 - (that
    variance) / (number of batches) (eq. A.1, both unbiased).

    The brute-force definition of the noise scale at batch size B, for any model: examples that
    interact within a batch (batch statistics) are measured as they train. Compared with a
    method on the same batches, the dominant sampling error (the mean gradient's fluctuation
    along G) is shared, so agreement is tight with few batches."""
    params = [p for p in arch.model.parameters() if p.requires_grad]
    grads, sizes = [], set()
    for batch in batches:
        loss = arch.loss(arch.model, batch)
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
                     .double())
        sizes.add(int((batch[0] if isinstance(batch, (tuple, list)) else batch).shape[0]))
    if len(sizes) != 1 or len(grads) < 2:
        raise ValueError("brute force needs >= 2 batches of one size")
    stacked = torch.stack(grads)
    variance = float(stacked.var(0, unbiased=True).sum())
    g2 = float(stacked.mean(0).square().sum()) - variance / len(grads)
    return sizes.pop() * variance / g2


def step_seconds(arch: Architecture, batch_size: int, method: str | None, steps: int = 20,
                 microbatches: int = 4, seed: int = 0) -> float:
    """Median seconds of one SGD step on `arch`: plain (`method` None), or measured with
    `NoiseScaleMonitor(method)` (micro-batches, `accumulate()` after each, where the monitor
    needs them). For `make bench`'s overhead ratios; the model trains while timed."""
    import statistics
    import time

    from gnsweep.measure import NoiseScaleMonitor

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(arch.model.parameters(), lr=1e-3)
    monitor = NoiseScaleMonitor(arch.model, method) if method is not None else None
    k = microbatches if monitor is not None and monitor.needs_microbatches else 1
    times = []
    try:
        for _ in range(steps + 2):
            batch = arch.sample(batch_size, generator)
            start = time.perf_counter()
            optimizer.zero_grad()
            pieces = [batch] if k == 1 else _split(batch, k)
            for piece in pieces:
                (arch.loss(arch.model, piece) / len(pieces)).backward()
                if monitor is not None:
                    monitor.accumulate()
            if monitor is not None:
                monitor.step()
            optimizer.step()
            times.append(time.perf_counter() - start)
    finally:
        if monitor is not None:
            monitor.close()
    return statistics.median(times[2:])


def _split(batch: Any, k: int) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(k))
    return [type(batch)(parts) for parts in zip(*(t.chunk(k) for t in batch), strict=True)]
