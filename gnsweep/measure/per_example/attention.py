"""Per-example gradients of `nn.MultiheadAttention` (so of `nn.TransformerEncoderLayer` and
`nn.TransformerDecoderLayer`), the whole module taken as one leaf: its forward reads
`in_proj_weight` / `in_proj_bias` (or `q/k/v_proj_weight`) and `out_proj.weight` / `.bias`
inside `F.multi_head_attention_forward`, where no layer hook sees them.

On a measured step the module's call is kept (query, key, value, `key_padding_mask`,
`attn_mask`, `is_causal`, `need_weights`), and when its output's gradient `d` arrives the
attention is computed again for the batch (`per_example`: in-projections, the masks as
`F.multi_head_attention_forward` merges them, `bias_k` / `bias_v`, `add_zero_attn`, softmax
attention by plain products, the out-projection) and back-propagated once from `d` to the
projected queries, keys and values; each projection is then a linear layer over positions,
whose per-example squared norms come in the Gram or explicit form (as `nn.Linear`'s), and the
out-projection's from its input and `d`. Opacus replaces the module by one built of
`nn.Linear` layers (`DPMultiheadAttention`); here the user's module stays and runs as it does,
and the sum of the examples' gradients is checked against `.grad` at run time
(`coverage`), so a computation that differs from the module's (a new torch
release) is caught, not trusted.

Attention dropout while training (`dropout > 0`, PyTorch's transformer layers' default): the
random state is kept before the module's forward (nothing draws between it and the dropout),
and the recompute draws the same masks from it (`_attend`); the sum check would catch masks
drawn otherwise. Not on this route, measured with micro-batches instead, said with the
reason: an unbatched call, examples not along the module's batch dimension.
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


def _linear_sq(a: torch.Tensor, g: torch.Tensor, weight: bool, bias: bool) -> torch.Tensor:
    """`sum_i |g_i|^2` of a projection over positions, a (N, T, I), g (N, T, O): example i's
    weight gradient is `sum_t g_it a_it^T`, its bias gradient `sum_t g_it`; the Gram form
    `sum_{t,s} (a_it.a_is + 1)(g_it.g_is)` or the explicit gradient, whichever is cheaper."""
    total = g.new_zeros(())
    if weight:
        t, i, o = a.shape[1], a.shape[2], g.shape[2]
        if t * (i + o) < i * o:
            inputs = torch.bmm(a, a.transpose(1, 2))
            if bias:
                inputs.add_(1)
            return torch.dot(inputs.reshape(-1), torch.bmm(g, g.transpose(1, 2)).reshape(-1))
        explicit = torch.bmm(g.transpose(1, 2), a).reshape(-1)
        total = torch.dot(explicit, explicit)
    if bias:
        summed = g.sum(1).reshape(-1)
        total = total + torch.dot(summed, summed)
    return total


def _projections(module: nn.MultiheadAttention
                 ) -> list[tuple[torch.Tensor, torch.Tensor | None, nn.Parameter | None,
                                 nn.Parameter | None, int, int]]:
    """The query, key and value projections: (weight, bias, weight's parameter, bias's
    parameter, first row of each in its parameter) each; a packed `in_proj_weight` gives three
    row blocks of one parameter, `in_proj_bias` always does."""
    e = module.embed_dim
    bias = module.in_proj_bias
    biases = [None, None, None] if bias is None else [bias[:e], bias[e:2 * e], bias[2 * e:]]
    if module.in_proj_weight is not None:
        w = module.in_proj_weight
        return [(w[k * e:(k + 1) * e], biases[k], w, bias, k * e, k * e) for k in range(3)]
    weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
    return [(wk, biases[k], wk, bias, 0, k * e) for k, wk in enumerate(weights)]


class Call:
    """One call of the module on a measured step: its inputs with the examples along dim 0
    (detached), the masks additive: the key-padding mask (N, S), the attention mask (L, S)
    shared by every example or (N, heads, L, S)."""

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
        self.need_weights = bool(given.get("need_weights", True))
        self.causal = bool(given.get("is_causal", False)) and \
            given.get("key_padding_mask") is None and not self.need_weights
        """The module hands sdpa `is_causal=True` and no mask (`_masks`)."""
        self.dropout = module.dropout if module.training else 0.0
        self.rng: tuple[torch.Tensor, list[int], list[torch.Tensor]] | None = None
        """The random state before the module's forward (CPU, CUDA devices and theirs), to
        draw its attention dropout's masks again (`_attend`)."""
        self.padding = padding.detach() if padding is not None else None
        if mask is not None and mask.dim() == 3:  # (N * heads, L, S): each example's heads
            mask = mask.reshape(n, module.num_heads, *mask.shape[1:])
        self.mask = mask.detach() if mask is not None else None
        self.dim = dim


class _Refused(Exception):
    """A call this route cannot take (the message says why)."""


def per_example(module: nn.MultiheadAttention, call: Call, d: torch.Tensor, *, summed: bool
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(`sum_i |g_i|^2` over the module's trained parameters, and with `summed` each one's
    `sum_i g_i` by id: the batch gradient the module received), `d` the gradient of the
    module's output (its own layout).

    The attention is computed again for the batch from the call's inputs (in-projections, the
    masks as `F.multi_head_attention_forward` merges them, `bias_k` / `bias_v`, `add_zero_attn`,
    softmax attention, its dropout's masks drawn again), and one backward of it from
    `d` through the out-projection gives the gradients of the projected queries, keys and
    values (and of `bias_k` / `bias_v` per example, expanded along the batch). Each projection
    is then a linear layer over positions, `q = x W_q^T + b_q`: example i's gradient of `W_q`
    is `sum_t dq_it x_it^T`, so its squared norm comes in the Gram or explicit form without
    any per-example gradient of the whole module held; the row blocks of a packed
    `in_proj_weight` are disjoint, so their squared norms add. The out-projection's are those
    of its input (the merged heads) and `d`."""
    e, heads = module.embed_dim, module.num_heads
    hd = e // heads
    dtype = call.dtype
    g = d.detach().movedim(call.dim, 0).to(dtype)
    n = g.shape[0]
    blocks = _projections(module)
    inputs = (call.query, call.key, call.value)
    with torch.enable_grad():
        projected = [F.linear(x, w.detach().to(dtype), None if b is None else b.detach().to(dtype))
                     .detach().requires_grad_() for x, (w, b, *_) in zip(inputs, blocks,
                                                                         strict=True)]
        q, k, v = projected
        extra: list[torch.Tensor] = []
        padding, mask = call.padding, call.mask
        if module.bias_k is not None and module.bias_v is not None:
            bias_k, bias_v = (t.detach().to(dtype).reshape(1, 1, e).expand(n, 1, e).clone()
                              .requires_grad_() for t in (module.bias_k, module.bias_v))
            extra = [bias_k, bias_v]
            k, v = torch.cat([k, bias_k], 1), torch.cat([v, bias_v], 1)
            mask = F.pad(mask, (0, 1)) if mask is not None else None
            padding = F.pad(padding, (0, 1)) if padding is not None else None
        if module.add_zero_attn:
            k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
            mask = F.pad(mask, (0, 1)) if mask is not None else None
            padding = F.pad(padding, (0, 1)) if padding is not None else None
        qh = q.reshape(n, -1, heads, hd).transpose(1, 2)  # (N, H, L, hd)
        kh = k.reshape(n, -1, heads, hd).transpose(1, 2)
        vh = v.reshape(n, -1, heads, hd).transpose(1, 2)
        merged = _attend(call, qh, kh, vh, mask, padding).transpose(1, 2).reshape(n, -1, e)
        wo, bo = module.out_proj.weight, module.out_proj.bias
        out = F.linear(merged, wo.detach().to(dtype), None if bo is None else bo.detach().to(dtype))
        grads = torch.autograd.grad(out, [*projected, *extra], g)
    merged = merged.detach()
    total = _linear_sq(merged, g, wo.requires_grad, bo is not None and bo.requires_grad)
    found: dict[int, torch.Tensor] = {}
    if summed:
        rows_in, rows_out = merged.reshape(-1, e), g.reshape(-1, e)
        if wo.requires_grad:
            found[id(wo)] = rows_out.t() @ rows_in
        if bo is not None and bo.requires_grad:
            found[id(bo)] = rows_out.sum(0)
    for x, dp, (_, _, weight, bias, first, first_bias) in zip(inputs, grads[:3], blocks,
                                                              strict=True):
        trained_bias = bias is not None and bias.requires_grad
        total = total + _linear_sq(x, dp, weight is not None and weight.requires_grad,
                                   trained_bias)
        if not summed:
            continue
        rows = dp.reshape(-1, dp.shape[-1])
        if weight is not None and weight.requires_grad:
            part = rows.t() @ x.reshape(-1, x.shape[-1])
            _add_rows(found, weight, first, part)
        if trained_bias:
            assert bias is not None
            _add_rows(found, bias, first_bias, rows.sum(0))
    for param, grad in zip((module.bias_k, module.bias_v), grads[3:], strict=False):
        assert param is not None
        if param.requires_grad:
            total = total + torch.dot(grad.reshape(-1), grad.reshape(-1))
            if summed:
                found[id(param)] = grad.sum(0).reshape(param.shape)
    return total, found


def _attend(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor | None, padding: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention of (N, H, L, hd) queries on (N, H, S, hd) keys and values, the
    additive masks applied. With attention dropout, its masks are drawn again as the module
    drew them: the random state restored to the one before the module's forward (nothing
    draws between it and the dropout), and the same draw, `F.scaled_dot_product_attention`
    with the merged mask (or `is_causal`) where no weights were asked for, else dropout of
    the (N * H, L, S) weights, as `F.multi_head_attention_forward` does; the random state
    is left as it was. Without dropout, plain products."""
    if call.dropout > 0 and call.rng is not None:
        cpu, devices, states = call.rng
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu)
            for device, state in zip(devices, states, strict=True):
                torch.cuda.set_rng_state(state, device)
            merged = mask
            if padding is not None:
                merged = padding[:, None, None, :] if merged is None else \
                    merged + padding[:, None, None, :]
            if not call.need_weights:
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if call.causal else merged,
                    dropout_p=call.dropout, is_causal=call.causal)
            scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(2, 3))
            if merged is not None:
                scores = scores + merged
            n, h, length, source = scores.shape
            weights = F.dropout(torch.softmax(scores, -1).reshape(n * h, length, source),
                                p=call.dropout).reshape(n, h, length, source)
            return torch.matmul(weights, v)
    scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(2, 3))  # (N, H, L, S)
    if mask is not None:
        scores = scores + mask  # (L, S) or (N, H, L, S)
    if padding is not None:
        scores = scores + padding[:, None, None, :]
    return torch.matmul(torch.softmax(scores, -1), v)


def _add_rows(found: dict[int, torch.Tensor], param: nn.Parameter, first: int,
              part: torch.Tensor) -> None:
    """Add `part` into the batch gradient of `param` kept in `found`, at rows `first`..."""
    known = found.get(id(param))
    if known is None:
        known = found[id(param)] = part.new_zeros(param.shape)
    known[first:first + part.shape[0]] += part


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
        self._rng: dict[int, tuple[torch.Tensor, list[int], list[torch.Tensor]]] = {}
        self.handles = [m.register_forward_hook(self._forward, with_kwargs=True)
                        for _, m in found]
        self.handles += [m.register_forward_pre_hook(self._before) for _, m in found]

    def _before(self, module: nn.MultiheadAttention, args: tuple) -> None:
        """Before a measured forward with attention dropout: the random state, from which its
        masks are drawn again (`_attend`)."""
        if not (self.gate.capturing and torch.is_grad_enabled() and module.training
                and module.dropout > 0):
            return
        devices = sorted({p.device.index or 0 for p in module.parameters()
                          if p.device.type == "cuda"})
        self._rng[id(module)] = (torch.get_rng_state(), devices,
                                 [torch.cuda.get_rng_state(d) for d in devices])

    def reset(self) -> None:
        self.implied = {}
        self.invalid = False

    def _refuse(self, module: nn.MultiheadAttention, why: str) -> None:
        name = self.names.get(id(module), type(module).__name__)
        for pname, p in parameters(module):
            self.refused[id(p)] = (f"{name}.{pname}: nn.MultiheadAttention is measured per "
                                   f"example only batched; {why}")
        self.invalid = True

    def _forward(self, module: nn.MultiheadAttention, args: tuple, kwargs: dict, output: Any
                 ) -> None:
        if not (self.gate.capturing and torch.is_grad_enabled()):
            return
        out = output[0] if isinstance(output, tuple) else output
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        rng = self._rng.pop(id(module), None)
        try:
            call = Call(module, args, kwargs, self.batch())
        except _Refused as why:
            self._refuse(module, str(why))
            return
        call.rng = rng
        if call.dropout > 0 and rng is None:
            self._refuse(module, f"its attention dropout (p={module.dropout}) drew masks from "
                         "a random state not seen before its forward")
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
            self._refuse(module, f"its attention could not be computed again for the batch "
                         f"({first})")
            return
        self.values().append(total.float() if total.dtype != torch.float64 else total)
        for key, g in sums.items():
            known = self.implied.get(key)
            self.implied[key] = g if known is None else known + g
