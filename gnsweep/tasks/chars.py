"""A small character-level transformer language model on text that ships with Python: the
standard library's `pydoc_data.topics` (the help() pages, about 465k characters, 103 distinct),
cross-entropy in nats per character.

Batch sizes and B_crit are counted in tokens: `sample(B, generator)` draws B windows of
`context + 1` characters at uniform random offsets of the training text (a tensor of shape
(B, context + 1)); each window predicts its `context` next characters, so `examples(batch)` is
`B * context` predicted tokens. A sweep's `batch_sizes` are therefore windows per step, and the
loop's examples column (and B_crit) is in tokens. The last `holdout` fraction of the text is kept
for `eval_loss` (fixed windows, the same for every run).

The model is a pre-norm GPT built only from `nn.Embedding`, `nn.Linear` and `nn.LayerNorm`
(attention through `F.scaled_dot_product_attention`). Its positions are looked up once for the
whole batch (`position(torch.arange(T))`, broadcast over it), so per-example norms cannot
attribute their gradient: `noise.method=auto` measures it with micro-batches (docs/noise.md).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.tasks.options import CharsOptions

DESCRIPTION = ("Character-level transformer LM on the standard library's pydoc_data.topics "
               "(465k characters), nats per character; B counted in tokens.")


Options = CharsOptions
"""The task's settings (schema in gnsweep.tasks.options, importable without torch)."""


@functools.cache
def text() -> str:
    """The corpus: every pydoc topic page, in sorted key order (the same on every machine with
    the same Python)."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, w = h.shape
        q, k, v = self.qkv(self.norm1(h)).split(w, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(att.transpose(1, 2).reshape(b, t, w))
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class CharLM(nn.Module):
    def __init__(self, vocab: int, options: Options) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, options.width)
        self.position = nn.Embedding(options.context, options.width)
        self.blocks = nn.ModuleList(Block(options.width, options.heads)
                                    for _ in range(options.depth))
        self.norm = nn.LayerNorm(options.width)
        self.head = nn.Linear(options.width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Chars:
    def __init__(self, options: Options, seed: int) -> None:
        corpus = text()
        self.alphabet = sorted(set(corpus))
        index = {c: i for i, c in enumerate(self.alphabet)}
        tokens = torch.tensor([index[c] for c in corpus], dtype=torch.long)
        n_eval = round(options.holdout * len(tokens))
        self.train = tokens[:len(tokens) - n_eval]
        self.options, self.seed = options, seed
        self._eval = None
        if options.eval_windows:
            held = tokens[len(tokens) - n_eval:]
            starts = torch.randint(len(held) - options.context,
                                   (options.eval_windows,),
                                   generator=torch.Generator().manual_seed(0))
            self._eval = self._windows(held, starts)

    def _windows(self, tokens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.options.context + 1)
        return tokens[starts[:, None] + offsets]

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return CharLM(len(self.alphabet), self.options)

    def sample(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        starts = torch.randint(len(self.train) - self.options.context, (batch_size,),
                               generator=generator)
        return self._windows(self.train, starts)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def eval_loss(self, model: nn.Module) -> float:
        if self._eval is None:
            return float("nan")
        with torch.no_grad():
            return float(self.loss(model, self._eval))

    def examples(self, batch: torch.Tensor) -> int:
        """Predicted tokens: every window predicts `context` characters."""
        return batch.shape[0] * (batch.shape[1] - 1)


def make(options: Options, seed: int) -> Chars:
    return Chars(options, seed)
