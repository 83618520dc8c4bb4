"""Per-example gradient norms of layers beyond the basic kinds: transformers' `Conv1D` (a linear
layer with its weight transposed) and parameters shared by several layers (tied weights, e.g.
GPT-2's token embedding and output layer).

A shared parameter's per-example gradient is the sum of its uses' gradients, so its squared
norm is the norm of that sum, cross terms included, not the sum of each use's norm. Each use
gives example i's gradient as a sum over positions of outer products, `g_i = sum_t u_it v_it^T`
(a linear layer: `u` the output gradient, `v` the input; an embedding: `u` the one-hot token,
`v` the output gradient; a bias: `u` the output gradient, `v` = 1), and

    |sum_uses g_i|^2 = sum_{uses p, q} sum_{t, s} (u_pit . u_qis)(v_pit . v_qis)

(the Gram form, `T^2` per pair of uses), or the explicit per-example gradient summed over the
uses (`rows x cols` per example), whichever is cheaper.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gnsweep.measure.common import Gate, fp32


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D`: `y = x W + b` with W of shape (in, out), without importing
    transformers."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and weight.shape[1] == getattr(module, "nf", None))


_STOCK = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.RMSNorm)


def own_forward(module: nn.Module) -> bool:
    """Whether a subclass of a torch layer computes its output its own way: it overrides
    `forward` (or a convolution's `_conv_forward`), as weight standardisation, a scaled weight,
    LoRA or padding inside the forward do. Per-example norms from the layer's input and output
    gradient assume the stock computation, so for such a layer they would be wrong."""
    for kind in _STOCK:
        if isinstance(module, kind):
            cls = type(module)
            if cls.forward is not kind.forward:
                return True
            stock = getattr(kind, "_conv_forward", None)
            return stock is not None and getattr(cls, "_conv_forward", None) is not stock
    return False


def linear_like(module: nn.Module) -> bool:
    """`nn.Linear` or a `Conv1D`: the same per-example norms (a transposed weight has the same
    norm)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


@dataclass
class _Use:
    """One use of a parameter: example i's gradient is `sum_t u[i, t] v[i, t]^T`; `u` dense
    (n, T, rows) or, with `index`, one-hot rows given by index (n, T)."""

    v: torch.Tensor
    u: torch.Tensor | None = None
    index: torch.Tensor | None = None
    rows: int = 0


def _kind_ok(module: nn.Module) -> bool:
    if own_forward(module):
        return False
    if isinstance(module, nn.Embedding):
        return not module.scale_grad_by_freq and not module.sparse
    own = {name for name, _ in module.named_parameters(recurse=False)}
    return linear_like(module) and own <= {"weight", "bias"} and not own_forward(module)


class Tied:
    """Per-example norms of the parameters that several layers share (linear, `Conv1D` and
    embedding layers): every use's factors are kept during the backward pass and combined, cross
    terms included, when the step is measured."""

    def __init__(self, gate: Gate, model: nn.Module, wanted: set[int]) -> None:
        """Takes the layers whose parameters are shared with another layer, when every layer of
        such a group is a kind it knows and all their parameters are measured."""
        self.gate = gate
        self.modules: set[int] = set()
        self.covered: set[int] = set()
        self.handles: list[Any] = []
        owners: defaultdict[int, list[nn.Module]] = defaultdict(list)
        for module in model.modules():
            for p in module.parameters(recurse=False):
                owners[id(p)].append(module)
        counts = Counter({pid: len(ms) for pid, ms in owners.items()})
        for module in model.modules():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if id(module) in self.modules or not any(counts[id(p)] > 1 for p in params):
                continue
            group = _group(module, owners)
            group_params = {id(p) for m in group for p in m.parameters(recurse=False)
                            if p.requires_grad}
            if all(_kind_ok(m) for m in group) and group_params <= wanted:
                self.modules.update(id(m) for m in group)
                self.covered |= group_params
                self.handles += [m.register_forward_hook(self._forward) for m in group]
        sizes = {id(p): p.numel() for m in model.modules() for p in m.parameters(recurse=False)}
        self.weighable = all(sizes[pid] <= WEIGHED_NUMEL for pid in self.covered)
        """P-norms (an adaptive optimizer's preconditioner) are given for every covered
        parameter (`totals`): each is at most `WEIGHED_NUMEL` elements."""
        self.reset()

    def reset(self) -> None:
        self.uses: defaultdict[int, list[_Use]] = defaultdict(list)

    def _forward(self, module: nn.Module, inputs: tuple, output: Any) -> None:
        if not (self.gate.capturing and torch.is_grad_enabled()):
            return
        if not isinstance(output, torch.Tensor) or not output.requires_grad or not inputs:
            return
        a = inputs[0].detach()
        output.register_hook(lambda d: self._backward(module, a, d.detach()))

    @torch.no_grad()
    def _backward(self, module: nn.Module, a: torch.Tensor, d: torch.Tensor) -> None:
        with fp32(d.device.type):  # statistics in fp32
            self._capture(module, a, d)

    def _capture(self, module: nn.Module, a: torch.Tensor, d: torch.Tensor) -> None:
        n = d.shape[0]
        d = d.float()
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if isinstance(module, nn.Embedding):
            index = a.reshape(n, -1)
            v = d.reshape(n, index.shape[1], -1)
            if module.padding_idx is not None:
                v = v * (index != module.padding_idx).unsqueeze(-1)
            assert weight is not None
            self.uses[id(weight)].append(_Use(v, index=index, rows=module.num_embeddings))
            return
        x = a.float().reshape(n, -1, a.shape[-1])
        d = d.reshape(n, -1, d.shape[-1])
        if weight is not None and weight.requires_grad:
            # nn.Linear's weight is (out, in): rows follow d; Conv1D's is (in, out): rows follow x.
            u, v = (d, x) if isinstance(module, nn.Linear) else (x, d)
            self.uses[id(weight)].append(_Use(v, u=u))
        if bias is not None and bias.requires_grad:
            self.uses[id(bias)].append(_Use(d.new_ones(n, d.shape[1], 1), u=d))

    def totals(self, weights: dict[int, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`total`, the same in the P-norm `sum_i |g_i|_P^2`), P by parameter id in `weights`
        (flat), both from the explicit per-example gradients (the P-norm has no Gram form);
        None before any use was captured."""
        if not self.uses:
            return None
        device = next(iter(self.uses.values()))[0].v.device
        with torch.no_grad(), fp32(device.type):
            plain, weighted = [], []
            for pid, uses in self.uses.items():
                a, b = _explicit(uses, weights[pid])
                assert b is not None
                plain.append(a)
                weighted.append(b)
            return torch.stack(plain).sum(), torch.stack(weighted).sum()

    def total(self) -> torch.Tensor | None:
        """Sum over examples and shared parameters of the squared per-example gradient norm
        (of the captured loss); None before any use was captured."""
        if not self.uses:
            return None
        device = next(iter(self.uses.values()))[0].v.device
        with torch.no_grad(), fp32(device.type):
            parts = [_explicit(uses)[0] if _explicit_cheaper(uses) else _gram(uses)
                     for uses in self.uses.values()]
            return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def _group(module: nn.Module, owners: dict[int, list[nn.Module]]) -> list[nn.Module]:
    """Every layer connected to `module` through shared parameters."""
    seen, todo = {id(module): module}, [module]
    while todo:
        for p in todo.pop().parameters(recurse=False):
            for other in owners[id(p)]:
                if id(other) not in seen:
                    seen[id(other)] = other
                    todo.append(other)
    return list(seen.values())


def _explicit_cheaper(uses: list[_Use]) -> bool:
    rows = max(use.rows if use.u is None else use.u.shape[2] for use in uses)
    cols, t = uses[0].v.shape[2], sum(use.v.shape[1] for use in uses)
    return rows * cols < t * t * (cols + 1)


EXPLICIT_BYTES = 64 << 20
"""Most bytes of per-example gradients `_explicit` builds at once: a language model's tied
embedding has one per example of vocabulary x width (154 MB for GPT-2's 50257 x 768 in fp32), so
the batch goes through in chunks of examples."""


WEIGHED_NUMEL = 1 << 16
"""Most elements of a tied parameter whose P-norms (`Tied.totals`) the per-example hooks give:
they need its explicit per-example gradients at every measured step (a batch of 128 of a
65,536-element weight is 32 MB in fp32, built in chunks), where the Gram form of the plain norms
needs none. A language model's tied embedding (GPT-2's 50257 x 768 is 590x that) is left to the
micro-batch split, which costs a few flat copies of the gradients a step."""


def _explicit(uses: list[_Use], weight: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sum_i |g_i|^2` from the per-example gradients summed over the uses, (n, rows, cols),
    built a chunk of examples at a time (`EXPLICIT_BYTES`); a dense use's product first makes
    a chunk's gradients (no zero fill); with `weight` (P of the parameter, any shape of its
    numel) also `sum_i |g_i|_P^2`, else None."""
    dense = sorted(uses, key=lambda use: use.index is not None)
    first = dense[0]
    n, cols = first.v.shape[0], first.v.shape[2]
    rows = first.rows if first.u is None else first.u.shape[2]
    chunk = max(1, EXPLICIT_BYTES // (rows * cols * first.v.element_size()))
    total = weighted = None
    w = None if weight is None else weight.reshape(rows, cols).float()
    for start in range(0, n, chunk):
        part, p_part = _explicit_sq([_slice(use, start, start + chunk) for use in dense], w)
        total = part if total is None else total + part
        if p_part is not None:
            weighted = p_part if weighted is None else weighted + p_part
    assert total is not None
    return total, weighted


def _slice(use: _Use, start: int, stop: int) -> _Use:
    """The use's examples start:stop."""
    return _Use(use.v[start:stop], None if use.u is None else use.u[start:stop],
                None if use.index is None else use.index[start:stop], use.rows)


def _explicit_sq(dense: list[_Use], weight: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sum_i |g_i|^2` of these examples' gradients, dense uses first, and with `weight`
    (rows, cols) their P-norms."""
    first = dense[0]
    n, cols = first.v.shape[0], first.v.shape[2]
    if first.u is not None:
        grad = torch.bmm(first.u.transpose(1, 2), first.v)
        rest = dense[1:]
    else:
        grad = first.v.new_zeros(n, first.rows, cols)
        rest = dense
    for use in rest:
        if use.index is not None:
            grad.scatter_add_(1, use.index.unsqueeze(-1).expand(-1, -1, cols), use.v)
        else:
            assert use.u is not None
            grad.baddbmm_(use.u.transpose(1, 2), use.v)
    flat = grad.view(-1)
    if weight is None:
        return torch.dot(flat, flat), None
    return torch.dot(flat, flat), torch.dot((grad * weight).view(-1), flat)


def _gram(uses: list[_Use]) -> torch.Tensor:
    terms = []
    for i, p in enumerate(uses):
        for q in uses[i:]:
            term = torch.dot(_u_gram(p, q).reshape(-1),
                             torch.bmm(p.v, q.v.transpose(1, 2)).view(-1))
            terms.append(term if q is p else 2 * term)
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


def _u_gram(p: _Use, q: _Use) -> torch.Tensor:
    """(n, T_p, T_q) dot products of the two uses' row factors."""
    if p.index is not None and q.index is not None:
        return (p.index.unsqueeze(2) == q.index.unsqueeze(1)).float()
    if p.index is not None:
        assert q.u is not None
        return _gather(q.u, p.index).transpose(1, 2)
    if q.index is not None:
        assert p.u is not None
        return _gather(p.u, q.index)
    assert p.u is not None and q.u is not None
    return torch.bmm(p.u, q.u.transpose(1, 2))


def _gather(u: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """u (n, T_u, rows) at the rows index (n, T_i): (n, T_u, T_i)."""
    return u.gather(2, index.unsqueeze(1).expand(-1, u.shape[1], -1))


def along_batch(module: nn.Module, a: torch.Tensor, output: torch.Tensor, batch: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's input and output with the batch's `batch` examples along dim 0, or None when
    they are not there.

    An embedding looked up once for the whole batch (GPT-2's positions, shape (1, T)) and
    broadcast against it gets the gradient summed over the examples: its output is expanded to
    the batch (a view, equal values), so that its hook receives each example's own gradient.
    `batch` 0 or 1: unknown or one example, nothing to check."""
    if batch <= 1 or output.shape[0] == batch:
        return a, output
    if isinstance(module, nn.Embedding) and output.shape[0] == 1 and a.shape[0] == 1:
        return (a.expand(batch, *a.shape[1:]), output.expand(batch, *output.shape[1:]))
    return None
