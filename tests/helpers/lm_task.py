"""A nanoGPT-style tiny causal language model as a user would write it (`task=custom
task._target_=lm_task.make`), for the tests that check gnsweep is right by default on a
language model.

The model is nanoGPT's in miniature: token and position embeddings (`wpe(torch.arange(T))`, a
(T, C) tensor looked up once and broadcast over the batch, so that module hooks see its gradient
summed over the examples), pre-norm blocks of causal self-attention and an MLP, and a language
head tied to the token embedding. The data are sequences of a fixed random Markov chain (each
token has `branching` likely successors), so the loss falls from log(vocab) towards the chain's
entropy within a few hundred steps. B is counted in tokens: `examples(batch)` is the predicted
tokens, `unit = "tokens"`, and `eval_loss` is the loss on fixed held-out sequences.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in nanoGPT
        for module in self.modules():  # nanoGPT's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # shape (t,)
        x = self.wte(idx) + self.wpe(pos)  # (b, t, c) + (t, c): broadcast over the batch
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class MarkovLM:
    """Sequences of a fixed random Markov chain; B in predicted tokens."""

    unit = "tokens"

    def __init__(self, seed: int, vocab: int = 16, context: int = 16, width: int = 32,
                 depth: int = 2, heads: int = 2, branching: int = 3) -> None:
        self.seed, self.vocab, self.context = seed, vocab, context
        self.width, self.depth, self.heads = width, depth, heads
        # The chain is the same for every run (seed 0): `branching` likely successors a token.
        generator = torch.Generator().manual_seed(0)
        logits = torch.full((vocab, vocab), -4.0)
        for token in range(vocab):
            successors = torch.randperm(vocab, generator=generator)[:branching]
            logits[token, successors] = torch.randn(branching, generator=generator)
        self.transition = logits.softmax(-1)
        self.held_out = self._sequences(256, torch.Generator().manual_seed(1))

    def _sequences(self, n: int, generator: torch.Generator) -> torch.Tensor:
        tokens = torch.empty(n, self.context + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (n,), generator=generator)
        for t in range(1, self.context + 1):
            tokens[:, t] = torch.multinomial(self.transition[tokens[:, t - 1]], 1,
                                             generator=generator).squeeze(1)
        return tokens

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return GPT(self.vocab, self.context, self.width, self.depth, self.heads)

    def sample(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        return self._sequences(batch_size, generator)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.vocab), batch[:, 1:].reshape(-1))

    def examples(self, batch: torch.Tensor) -> int:
        """Predicted tokens: `context` a sequence."""
        return batch.shape[0] * (batch.shape[1] - 1)

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss(model, self.held_out))

    def entropy(self) -> float:
        """The chain's entropy rate under its stationary distribution: the loss floor, nats."""
        p = self.transition
        stationary = torch.ones(self.vocab) / self.vocab
        for _ in range(200):
            stationary = stationary @ p
        return float(-(stationary[:, None] * p * p.clamp_min(1e-30).log()).sum())


def make(seed: int, vocab: int = 16, context: int = 16, width: int = 32, depth: int = 2,
         heads: int = 2, branching: int = 3) -> MarkovLM:
    return MarkovLM(seed, vocab=vocab, context=context, width=width, depth=depth, heads=heads,
                    branching=branching)


LOG_VOCAB = math.log(16)
"""The loss of a uniform guess over the default vocabulary."""
