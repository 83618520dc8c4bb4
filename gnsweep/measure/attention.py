"""Per-example gradients of `nn.MultiheadAttention` (so of `nn.TransformerEncoderLayer` and
`nn.TransformerDecoderLayer`), the whole module taken as one leaf: its forward reads
`in_proj_weight` / `in_proj_bias` (or `q/k/v_proj_weight`) and `out_proj.weight` / `.bias`
inside `F.multi_head_attention_forward`, where no layer hook sees them.

On a measured step the module's call is kept (query, key, value, `key_padding_mask`,
`attn_mask`, `is_causal`, `need_weights`), and when its output's gradient `d` arrives each
example's parameter gradient is computed again for that example alone: `torch.func.vmap` of
`torch.func.grad` of `<attend(x_i), d_i>`, where `attend` is the module's computation written out
for one example (in-projections, the masks as `F.multi_head_attention_forward` merges them,
`bias_k` / `bias_v`, `add_zero_attn`, softmax attention by plain products, which vmap batches,
and the out-projection). Opacus replaces the module by one built of `nn.Linear` layers
(`DPMultiheadAttention`); here the user's module stays, and the sum of the examples' gradients
is checked against `.grad` at run time (`gnsweep.measure.coverage`), so a computation that
differs from the module's (a new torch release) is caught, not trusted.

Not on this route, measured with micro-batches instead, said with the reason: attention
dropout while training (`dropout > 0`: the masks the module drew cannot be drawn again for one
example), an unbatched call, examples not along the module's batch dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.measure.common import Gate, fp32

CHUNK_BYTES = 64 << 20
"""Most bytes of examples' own gradients held at once (each is the module's parameter size)."""

ROUTED = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight",
          "bias_k", "bias_v", "out_proj.weight", "out_proj.bias")
"""The parameters of `nn.MultiheadAttention` this route measures (all of them)."""


def parameters(module: nn.MultiheadAttention) -> list[tuple[str, nn.Parameter]]:
    """The module's trained parameters by their names inside it (`out_proj.weight`...)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _masks(module: nn.MultiheadAttention, key_padding_mask: torch.Tensor | None,
           attn_mask: torch.Tensor | None, is_causal: bool, need_weights: bool,
           length: int, source: int, dtype: torch.dtype
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The additive masks as `F.multi_head_attention_forward` applies them, in `dtype`: the
    key-padding mask (N, S) and the attention mask ((L, S) for all, or (N * heads, L, S));
    `is_causal` with neither a padding mask nor weights asked for is the causal mask itself
    (the module then hands sdpa `is_causal=True` and drops `attn_mask`)."""
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = torch.ones(length, source, dtype=torch.bool,
                               device=module.out_proj.weight.device).triu(1)

    def additive(mask: torch.Tensor | None) -> torch.Tensor | None:
        if mask is None:
            return None
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                mask, float("-inf"))
        return mask.to(dtype)

    return additive(key_padding_mask), additive(attn_mask)


def _attend(module: nn.MultiheadAttention, values: dict[str, torch.Tensor], query: torch.Tensor,
            key: torch.Tensor, value: torch.Tensor, padding: torch.Tensor | None,
            mask: torch.Tensor | None, d: torch.Tensor) -> torch.Tensor:
    """`<out, d>` of one example (no batch dimension: query (L, E), key (S, kdim), value
    (S, vdim), padding (S,) additive, mask (L, S) or (heads, L, S) additive, d (L, E)), the
    module's parameters set to `values`: its gradient in `values` is that example's."""
    e, heads = module.embed_dim, module.num_heads
    if "in_proj_weight" in values or module.in_proj_weight is not None:
        w = values.get("in_proj_weight", module.in_proj_weight)
        wq, wk, wv = w[:e], w[e:2 * e], w[2 * e:]
    else:
        wq = values.get("q_proj_weight", module.q_proj_weight)
        wk = values.get("k_proj_weight", module.k_proj_weight)
        wv = values.get("v_proj_weight", module.v_proj_weight)
    b = values.get("in_proj_bias", module.in_proj_bias)
    bq, bk, bv = (None, None, None) if b is None else (b[:e], b[e:2 * e], b[2 * e:])
    q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
    bias_k = values.get("bias_k", module.bias_k)
    bias_v = values.get("bias_v", module.bias_v)
    if bias_k is not None and bias_v is not None:
        k = torch.cat([k, bias_k.reshape(1, e)])
        v = torch.cat([v, bias_v.reshape(1, e)])
        mask = F.pad(mask, (0, 1)) if mask is not None else None
        padding = F.pad(padding, (0, 1)) if padding is not None else None
    if module.add_zero_attn:
        k = torch.cat([k, k.new_zeros(1, e)])
        v = torch.cat([v, v.new_zeros(1, e)])
        mask = F.pad(mask, (0, 1)) if mask is not None else None
        padding = F.pad(padding, (0, 1)) if padding is not None else None
    hd = e // heads
    q = q.reshape(-1, heads, hd).transpose(0, 1)  # (H, L, hd)
    k = k.reshape(-1, heads, hd).transpose(0, 1)  # (H, S, hd)
    v = v.reshape(-1, heads, hd).transpose(0, 1)
    scores = torch.matmul(q * (1.0 / math.sqrt(hd)), k.transpose(1, 2))  # (H, L, S)
    if mask is not None:
        scores = scores + mask
    if padding is not None:
        scores = scores + padding
    attended = torch.matmul(torch.softmax(scores, -1), v)  # (H, L, hd)
    merged = attended.transpose(0, 1).reshape(-1, e)
    out = F.linear(merged, values.get("out_proj.weight", module.out_proj.weight),
                   values.get("out_proj.bias", module.out_proj.bias))
    return (out * d).sum()


class Call:
    """One call of the module on a measured step: its inputs with the examples along dim 0
    (detached), the masks additive (per example, or shared: `mask_shared`)."""

    def __init__(self, module: nn.MultiheadAttention, args: tuple, kwargs: dict, batch: int
                 ) -> None:
        names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
                 "average_attn_weights", "is_causal")
        given = dict(zip(names, args, strict=False)) | kwargs
        query, key, value = given["query"], given["key"], given["value"]
        dim = 0 if module.batch_first else 1
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                raise _Refused(f"it was called unbatched ({name} of "
                               f"{tuple(x.shape) if isinstance(x, torch.Tensor) else x})")
            if batch > 1 and x.shape[dim] != batch:
                raise _Refused(f"its {name} {tuple(x.shape)} does not hold the batch's {batch} "
                               f"examples along dim {dim} (batch_first={module.batch_first})")
        self.dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        self.query, self.key, self.value = (x.detach().movedim(dim, 0).to(self.dtype)
                                            for x in (query, key, value))
        n, length, source = self.query.shape[0], self.query.shape[1], self.key.shape[1]
        padding, mask = _masks(module, given.get("key_padding_mask"), given.get("attn_mask"),
                               bool(given.get("is_causal", False)),
                               bool(given.get("need_weights", True)), length, source,
                               self.dtype)
        self.padding = padding.detach() if padding is not None else None
        self.mask_shared = mask is None or mask.dim() == 2
        if mask is not None and mask.dim() == 3:  # (N * heads, L, S): each example's heads
            mask = mask.reshape(n, module.num_heads, *mask.shape[1:])
        self.mask = mask.detach() if mask is not None else None
        self.dim = dim


class _Refused(Exception):
    """A call this route cannot take (the message says why)."""


def per_example(module: nn.MultiheadAttention, call: Call, d: torch.Tensor, *, summed: bool
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(`sum_i |g_i|^2` over the module's trained parameters, and with `summed` each one's
    `sum_i g_i` by id: the batch gradient the module received), from every example's own
    gradient, `d` the gradient of the module's output (its own layout), in chunks."""
    pairs = parameters(module)
    names = [n for n, _ in pairs]
    values = tuple(p.detach().to(call.dtype) for _, p in pairs)
    g = d.detach().movedim(call.dim, 0).to(call.dtype)

    def loss(vals: tuple[torch.Tensor, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             pad: torch.Tensor | None, mask: torch.Tensor | None, di: torch.Tensor
             ) -> torch.Tensor:
        return _attend(module, dict(zip(names, vals, strict=True)), q, k, v, pad,
                       mask if mask is not None else shared, di)

    shared = call.mask if call.mask_shared else None
    own_mask = None if call.mask_shared else call.mask
    per = torch.func.vmap(torch.func.grad(loss),
                          in_dims=(None, 0, 0, 0, None if call.padding is None else 0,
                                   None if own_mask is None else 0, 0))
    numel = sum(p.numel() for _, p in pairs)
    n = g.shape[0]
    chunk = max(1, CHUNK_BYTES // (numel * g.element_size()))
    total = g.new_zeros(())
    sums = [torch.zeros_like(v) for v in values] if summed else []
    with torch.enable_grad():
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            grads = per(values, call.query[part], call.key[part], call.value[part],
                        call.padding[part] if call.padding is not None else None,
                        own_mask[part] if own_mask is not None else None, g[part])
            for i, grad in enumerate(grads):
                flat = grad.reshape(-1)
                total = total + torch.dot(flat, flat)
                if summed:
                    sums[i] += grad.sum(0)
    found = {id(p): s for (_, p), s in zip(pairs, sums, strict=True)} if summed else {}
    return total, found


class Attention:
    """The `nn.MultiheadAttention` modules of a model measured per example (`PerExample` owns
    one): a forward hook on each keeps a measured step's call and hooks its output's gradient;
    the examples' gradients go to `values()` as `sum_i |g_i|^2`, and, while `implied_wanted()`
    (the coverage check armed), their sum to `implied` for the check."""

    def __init__(self, gate: Gate, found: list[tuple[str, nn.MultiheadAttention]],
                 batch: Callable[[], int], forward_id: Callable[[], int],
                 values: Callable[[], list[torch.Tensor]],
                 implied_wanted: Callable[[], bool]) -> None:
        self.gate, self.found = gate, found
        self.batch, self.forward_id, self.values = batch, forward_id, values
        self.implied_wanted = implied_wanted
        self.names = {id(m): name for name, m in found}
        self.refused: dict[int, str] = {}
        """Parameter id -> why this route could not take a call of its module (the monitor
        moves the module's parameters to micro-batches)."""
        self.implied: dict[int, torch.Tensor] = {}
        """Parameter id -> the batch gradient the examples' own gradients add up to."""
        self.invalid = False
        """A call this step could not be measured: the step's per-example pair is discarded."""
        self._last: dict[int, int] = {}
        self.handles = [m.register_forward_hook(self._forward, with_kwargs=True)
                        for _, m in found]

    def reset(self) -> None:
        self.implied = {}
        self.invalid = False

    def _refuse(self, module: nn.MultiheadAttention, why: str) -> None:
        name = self.names.get(id(module), type(module).__name__)
        for pname, p in parameters(module):
            self.refused[id(p)] = (f"{name}.{pname}: nn.MultiheadAttention is measured per "
                                   f"example only without attention dropout, batched; {why}")
        self.invalid = True

    def _forward(self, module: nn.MultiheadAttention, args: tuple, kwargs: dict, output: Any
                 ) -> None:
        if not (self.gate.capturing and torch.is_grad_enabled()):
            return
        out = output[0] if isinstance(output, tuple) else output
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        if module.training and module.dropout > 0:
            self._refuse(module, f"its attention dropout (p={module.dropout}) draws masks that "
                         "cannot be drawn again one example at a time")
            return
        try:
            call = Call(module, args, kwargs, self.batch())
        except _Refused as why:
            self._refuse(module, str(why))
            return
        if self._last.get(id(module)) == self.forward_id():
            self.invalid = True  # used twice in one forward: the uses' cross terms are missed
            self.gate.warn_once(f"reuse{id(module)}", "noise scale: MultiheadAttention is "
                                "called more than once per forward; per-example norms skip "
                                "such steps")
            return
        self._last[id(module)] = self.forward_id()
        out.register_hook(partial(self._backward, module, call))

    def _backward(self, module: nn.MultiheadAttention, call: Call, grad: torch.Tensor) -> None:
        summed = self.implied_wanted()
        try:
            with torch.no_grad(), fp32(grad.device.type):
                total, sums = per_example(module, call, grad, summed=summed)
        except Exception as err:  # any failure: micro-batches, with the reason
            first = (str(err).splitlines() or [type(err).__name__])[0][:200]
            self._refuse(module, f"its computation could not be run one example at a time "
                         f"({first})")
            return
        self.values().append(total.float() if total.dtype != torch.float64 else total)
        for key, g in sums.items():
            known = self.implied.get(key)
            self.implied[key] = g if known is None else known + g
