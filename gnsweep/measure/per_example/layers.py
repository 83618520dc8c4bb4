"""The per-example layer rules: `sum_i |g_i|^2` of one layer's parameters from what its hooks
saved (the input, or the output's gradient) and the output's gradient, for `nn.Linear`,
transformers' `Conv1D`, `nn.Conv1d`, `nn.Conv2d`, `nn.Embedding`, `nn.LayerNorm` and `nn.RMSNorm`,
in the Gram form or through the explicit per-example gradient, whichever is cheaper; and the
same in the optimizer's diagonal preconditioner P (`preconditioned_norms`). The hooks that call
them are `hooks.PerExample`'s."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.measure.common import sq
from gnsweep.measure.per_example import preconditioned_norms as pnorm
from gnsweep.measure.per_example.tied import is_conv1d, linear_like


def row_sq(x: torch.Tensor) -> torch.Tensor:
    """`|x_i|^2` of each row, in fp32 (autocast would run `vecdot` in low precision)."""
    if x.dtype in _LOW:
        x = x.float()
    device = x.device.type
    if torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return torch.linalg.vecdot(x, x)
    return torch.linalg.vecdot(x, x)


def grad_row_sq(into: list[torch.Tensor], d: torch.Tensor) -> None:
    """A backward hook: `|d_i|^2` of a linear layer's output gradient appended to `into`."""
    into.append(row_sq(d.detach() if d.requires_grad else d))  # create_graph=True: no graph


_LOW = (torch.float16, torch.bfloat16)


def trainable(module: nn.Module) -> tuple[bool, bool]:
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    return (weight is not None and weight.requires_grad,
            bias is not None and bias.requires_grad)


def layer_sq(module: nn.Module, saved: Any, d: torch.Tensor) -> torch.Tensor:
    """Sum over examples of this layer's `|g_i|^2`, `g_i` the gradient of the captured loss."""
    d = d.float()
    weight, bias = trainable(module)
    if linear_like(module):  # Conv1D's transposed weight has the same per-example norms
        # (one example per row is `PerExample._stash`'s)
        return _linear_sq(saved.float().flatten(1, -2), d.flatten(1, -2), weight, bias)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return _conv_sq(module, saved.float(), d, weight, bias)
    if isinstance(module, nn.Embedding):
        return _embedding_sq(module, saved, d)
    assert isinstance(module, (nn.LayerNorm, nn.RMSNorm))
    return _norm_sq(module, saved.float(), d, weight, bias)


def weight_p(module: nn.Module, p_of: Callable[[Any], torch.Tensor | None]
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """P of a linear-like layer's weight as (out, in) (transformers' Conv1D holds it
    transposed) and of its bias, each None where not trained."""
    own = module._parameters
    weight, bias = p_of(own.get("weight")), p_of(own.get("bias"))
    if weight is not None and is_conv1d(module):
        weight = weight.t()
    return weight, bias


def layer_psq(module: nn.Module, saved: Any, d: torch.Tensor,
                     p_of: Callable[[Any], torch.Tensor | None]) -> torch.Tensor:
    """Sum over examples of this layer's `|g_i|_P^2` (`preconditioned_norms`), P of each
    parameter by `p_of`."""
    d = d.float()
    own = module._parameters
    if linear_like(module):
        weight, bias = weight_p(module, p_of)
        a = saved.float()
        if a.dim() == 2:
            return pnorm.rows_sq(a, d, weight, bias)
        return pnorm.linear_sq(a.flatten(1, -2), d.flatten(1, -2), weight, bias)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return _conv_psq(module, saved.float(), d, p_of(own.get("weight")),
                         p_of(own.get("bias")))
    if isinstance(module, nn.Embedding):
        weight = p_of(own.get("weight"))
        index = saved.reshape(saved.shape[0], -1)
        d = d.reshape(index.shape[0], index.shape[1], -1)
        if module.padding_idx is not None:
            d = d * (index != module.padding_idx).unsqueeze(-1)
        return pnorm.embedding_sq(index, d, weight) if weight is not None else d.new_zeros(())
    assert isinstance(module, (nn.LayerNorm, nn.RMSNorm))
    return _norm_psq(module, saved.float(), d, p_of(own.get("weight")), p_of(own.get("bias")))


def _scale_gradients(module: nn.LayerNorm | nn.RMSNorm, x: torch.Tensor, d: torch.Tensor,
                     shape: tuple[int, ...]) -> torch.Tensor:
    """`d * x_hat` per position: each example's scale gradient before the sum over positions;
    `x_hat` recomputed from the input (the normalisation without its affine part, by a weight
    of ones: the CPU kernel runs 1.3x faster with a weight than without)."""
    ones = x.new_ones(shape)
    if isinstance(module, nn.LayerNorm):
        x_hat = F.layer_norm(x, shape, ones, None, module.eps)
    else:
        x_hat = F.rms_norm(x, shape, ones, module.eps)
    return x_hat.mul_(d)


def _norm_psq(module: nn.LayerNorm | nn.RMSNorm, x: torch.Tensor, d: torch.Tensor,
              weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """`_norm_sq` in the P-norm: the same explicit per-example gradients, weighted."""
    shape = tuple(module.normalized_shape)
    dims = tuple(range(1, d.dim() - len(shape)))
    total = d.new_zeros(())
    if weight is not None:
        x_hat = _scale_gradients(module, x, d, shape)
        total = total + pnorm.explicit_sq(x_hat.sum(dims) if dims else x_hat, weight)
    if bias is not None:
        total = total + pnorm.explicit_sq(d.sum(dims) if dims else d, bias)
    return total


def _conv_psq(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, d: torch.Tensor,
              weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """A conv's `sum_i |g_i|_P^2`: the explicit per-example weight gradients (the backend's
    grouped kernel, `_conv_per_example_grad`) in chunks of at most
    `weighted.GRADIENT_BYTES`, weighted by P; the bias's from the output gradient summed over
    positions."""
    n = x.shape[0]
    total = d.new_zeros(())
    if bias is not None:
        s = d.flatten(2).sum(2)  # (B, out)
        total = total + pnorm.explicit_sq(s, bias)
    if weight is not None:
        chunk = max(1, pnorm.GRADIENT_BYTES // (d.element_size() * weight.numel()))
        for start in range(0, n, chunk):
            xs, ds = x[start:start + chunk], d[start:start + chunk]
            grads = _conv_per_example_grad(module, xs, ds).reshape(xs.shape[0], *weight.shape)
            total = total + pnorm.explicit_sq(grads, weight)
    return total


def _dot(x: torch.Tensor) -> torch.Tensor:
    """`|x|^2` in one op where x is contiguous (`sq` takes two: a norm and its square)."""
    flat = x.reshape(-1)
    return torch.dot(flat, flat)


def _linear_sq(a: torch.Tensor, d: torch.Tensor, weight: bool, bias: bool) -> torch.Tensor:
    """`sum_i |g_i|^2` of a linear layer over positions, a (B, T, I), d (B, T, O): example
    i's weight gradient is `sum_t d_it a_it^T`, its bias gradient `sum_t d_it`. In the Gram
    form the bias is a constant input 1 appended to `a`, so both are one product,
    `sum_{t,s} (a_it.a_is + 1)(d_it.d_is)`; explicitly, the gradients' squares in two dots."""
    if not weight:
        return _dot(d.sum(1)) if bias else d.new_zeros(())
    if gram_is_cheaper(a.shape[1], a.shape[2], d.shape[2]):
        inputs = torch.bmm(a, a.transpose(1, 2))
        if bias:
            inputs.add_(1)
        return torch.dot(inputs.view(-1), torch.bmm(d, d.transpose(1, 2)).view(-1))
    out = _dot(torch.bmm(d.transpose(1, 2), a))
    return out + _dot(d.sum(1)) if bias else out


def _embedding_sq(module: nn.Embedding, saved: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """`sum_i |g_i|^2` of an embedding: example i's gradient has row `k` = the sum of `d_it`
    over its positions t that look up k, so `|g_i|^2 = sum_{t,s: x_it = x_is} d_it.d_is`.
    Indices shared by the whole batch (positions looked up once and broadcast, a stride-0
    batch dimension) need the T x T equality once, and the products summed over examples
    `sum_i d_it.d_is` are one matrix product instead of one per example."""
    index = saved.reshape(saved.shape[0], -1)
    n, t = index.shape
    d = d.reshape(n, t, -1)
    if module.padding_idx is not None:
        d = d * (index != module.padding_idx).unsqueeze(-1)
    if t == 1:
        return sq(d)
    if n > 1 and index.stride(0) == 0:  # one row of indices for every example
        row = index[0]
        flat = d.transpose(0, 1).reshape(t, -1)  # (T, B * dim)
        same = (row.unsqueeze(1) == row.unsqueeze(0)).to(d.dtype)
        return torch.dot(torch.mm(flat, flat.t()).view(-1), same.view(-1))
    same = index.unsqueeze(2) == index.unsqueeze(1)
    return (torch.bmm(d, d.transpose(1, 2)) * same).sum()


def _norm_sq(module: nn.LayerNorm | nn.RMSNorm, x: torch.Tensor, d: torch.Tensor, weight: bool,
             bias: bool) -> torch.Tensor:
    """`sum_i |g_i|^2` of a LayerNorm / RMSNorm: example i's scale gradient is the sum over
    positions of `d * x_hat`, its bias gradient the sum of `d`; `x_hat` recomputed from the
    input (the normalisation without its affine part, by a weight of ones: the CPU kernel
    runs 1.3x faster with a weight than without)."""
    shape = tuple(module.normalized_shape)
    dims = tuple(range(1, d.dim() - len(shape)))
    out = None
    if weight:
        x_hat = _scale_gradients(module, x, d, shape)
        out = _dot(x_hat.sum(dims) if dims else x_hat)
    if bias:
        b = _dot(d.sum(dims) if dims else d)
        out = b if out is None else out + b
    return out if out is not None else d.new_zeros(())


def gram_is_cheaper(positions: int, inputs: int, outputs: int) -> bool:
    """Whether the Gram ("ghost") form of a per-example weight-gradient norm costs less than
    the explicit per-example gradient (mixed ghost norm, Bu et al. 2022): the Gram matrices of
    activations and output gradients cost T^2 (I + O) per example, the explicit gradient
    T I O (and I O memory)."""
    return positions * (inputs + outputs) < inputs * outputs


def _weight_sq(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """`sum_i |sum_t d_it a_it^T|^2` for a (B, T, I), d (B, T, O): Gram form or explicit."""
    t, i, o = a.shape[1], a.shape[2], d.shape[2]
    if gram_is_cheaper(t, i, o):
        return torch.dot(torch.bmm(a, a.transpose(1, 2)).view(-1),
                         torch.bmm(d, d.transpose(1, 2)).view(-1))
    return _dot(torch.bmm(d.transpose(1, 2), a))


def _patches_last(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The conv's input patches with channels last, (B, L, K, C): L output positions, K kernel
    taps, C input channels; one strided copy of the padded input in (B, ..., C) layout. The
    order of a patch's entries does not change a norm or a Gram matrix, and a contiguous
    channel run copies about 1.5x faster here than `F.unfold`'s (C, taps) order, which also
    loops over the batch on the CPU."""
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
    x = x.movedim(1, -1).contiguous()  # (B, *spatial, C)
    n, c, spatial = x.shape[0], x.shape[-1], x.shape[1:-1]
    kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    out = [(size - d * (k - 1) - 1) // s + 1
           for size, k, d, s in zip(spatial, kernel, dilation, stride, strict=True)]
    strides = x.stride()
    view = x.as_strided(
        (n, *out, *kernel, c),
        (strides[0], *(s * st for s, st in zip(stride, strides[1:-1], strict=True)),
         *(d * st for d, st in zip(dilation, strides[1:-1], strict=True)), strides[-1]))
    return view.reshape(n, math.prod(out), math.prod(kernel), c)


def _patches_first(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The conv's input patches with positions last, (B, C * K, L): C input channels, K kernel
    taps, L output positions (`F.unfold`'s layout, for Conv1d too); one strided copy of the
    padded input whose innermost runs are rows of output positions, contiguous at stride 1
    (`F.unfold` itself loops over the batch on the CPU)."""
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
    n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
    kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    out = [(size - d * (k - 1) - 1) // s + 1
           for size, k, d, s in zip(spatial, kernel, dilation, stride, strict=True)]
    strides = x.stride()
    view = x.as_strided(
        (n, c, *kernel, *out),
        (strides[0], strides[1], *(d * st for d, st in zip(dilation, strides[2:], strict=True)),
         *(s * st for s, st in zip(stride, strides[2:], strict=True))))
    return view.reshape(n, c * math.prod(kernel), math.prod(out))


def patches_are_cheaper(channels: int, groups: int, taps: int, positions: int, device: str
                        ) -> bool:
    """Whether the explicit per-example weight gradient of a conv with `channels` input
    channels per group, `groups` groups, `taps` kernel taps and `positions` output positions
    costs less from its patches and one batched matmul (`_patches_first`) than from the
    backend's grouped weight-gradient kernel (`_conv_per_example_grad`). Measured on the CPU
    (one thread, batches 32 and 128, 8-256 channels, 1x1 to 7x7 kernels, strides 1 and 2,
    8x8 to 64x64 inputs, groups, Conv1d): oneDNN has direct kernels for groups of 8 and more
    input channels (1.2-4.5x faster than the patches at 3x3 to 7x7) and for depthwise layers
    of 4 or more groups (1.5-4.5x faster; 2-4 channels in 4-32 groups: 0.6-1.3x); with 1 to
    7 channels in 1-3 groups it runs a small gemm per example and the patches cost 0.25-0.9x
    as much; a 1x1 kernel over at most 64 positions is a small matmul per example either way,
    and the patches cost 0.3-0.9x (8 to 256 channels). The patches in the other layout,
    (positions, taps x channels) with the output gradient multiplied against them, cost about
    as much as the grouped kernel at 16+ channels, 10-20x more with groups: not used.
    Elsewhere (other devices) the backend's kernel."""
    if device != "cpu" or groups >= 4:
        return False
    return channels < 8 or (taps == 1 and positions <= 64)


PATCH_BYTES = 16 << 20
"""Most bytes of patches `_conv_sq` copies at once (a 7x7 stem on 224x224 RGB images has 7 MB
of patches per example)."""


GRADIENT_BYTES = 256 << 20
"""Most bytes of explicit per-example conv weight gradients held at once, on any device (a
128 -> 128 3x3 conv has 0.6 MB of them per example): on measured steps they are the training
gradient's path too, so a large batch must not run out of memory there only."""


def _conv_per_example_grad(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, d: torch.Tensor
                           ) -> torch.Tensor:
    """Every example's own weight gradient, (B * out, in / groups, *kernel), by one weight
    backward of the convolution with the batch folded into its groups (example b's channels
    form groups b * groups ...): the backend's own conv kernel, 1.3-1.8x faster here than
    patches and a batched matmul, and no patches in memory."""
    n = x.shape[0]
    padding: Any = module.padding
    if module.padding_mode != "zeros" or isinstance(padding, str):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding = [0] * len(module.kernel_size)
    shape = (n * module.out_channels, *module.weight.shape[1:])
    # Only the weight gradient is asked for: the weight's values are never read.
    weight = x.new_empty(shape)
    return torch.ops.aten.convolution_backward(
        d.reshape(1, -1, *d.shape[2:]), x.reshape(1, -1, *x.shape[2:]), weight, None,
        module.stride, padding, module.dilation, False, [0] * len(module.kernel_size),
        n * module.groups, [False, True, False])[1]


CONV_CHUNK = 32
"""Most examples per explicit per-example weight gradient on the CPU. oneDNN's grouped
weight-gradient kernel, with the batch folded into its groups, costs 1.3-2x more per example
past 32-64 groups (measured from 16 to 64 channels, 8x8 and 16x16 inputs, chunks of 8 to 128
examples: at 64 examples 10-35% more than at 32); chunks of 32 stay within 10% of the best
chunk for every layer measured."""


def _conv_sq(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, d: torch.Tensor, weight: bool,
             bias: bool) -> torch.Tensor:
    """Sum over examples of a Conv1d/Conv2d's `|g_i|^2`: the weight's in the Gram form (from
    its patches and output gradients, per group) or as the explicit per-example gradient,
    whichever costs less at this layer's shape (`gram_is_cheaper`; mixed ghost norm, Bu et al.
    2022), the explicit one from the backend's grouped kernel or from patches and a batched
    matmul (`patches_are_cheaper`), in chunks on the CPU (`CONV_CHUNK`, `PATCH_BYTES`); the
    bias's from the output gradient summed over positions. Few ops: each costs several
    microseconds in a training step, as much as a small layer's arithmetic."""
    n, groups = x.shape[0], module.groups
    total = None
    if bias:
        summed = d.flatten(2).sum(2).flatten()  # (B * out): each example's bias gradient
        total = torch.dot(summed, summed)
    if not weight:
        return total if total is not None else d.new_zeros(())
    taps = math.prod(module.kernel_size)
    positions = math.prod(d.shape[2:])
    if _explicit_is_cheaper(module, positions):
        weight_sq, _ = _conv_weight_by_examples(module, x, d, False)
        return weight_sq if total is None else total + weight_sq
    d = d.reshape(n, d.shape[1], -1)  # (B, out, L)
    a = _patches_last(module, x)  # (B, L, K, C)
    if groups == 1:
        a = a.reshape(n, positions, -1)
        dg = d.transpose(1, 2)  # (B, L, out)
    else:  # (B*g, L, K*C/g) against (B*g, L, out/g)
        a = (a.reshape(n, positions, taps, groups, -1).permute(0, 3, 1, 2, 4)
             .reshape(n * groups, positions, -1))
        dg = d.reshape(n, groups, -1, positions).transpose(2, 3).flatten(0, 1)
    gram = _weight_sq(a, dg)
    return gram if total is None else total + gram


def _explicit_is_cheaper(module: nn.Conv1d | nn.Conv2d, positions: int) -> bool:
    """Whether this conv's per-example weight-gradient norms come from the explicit per-example
    gradients (`gram_is_cheaper` false at `positions` output positions)."""
    groups = module.groups
    return not gram_is_cheaper(positions, math.prod(module.kernel_size) * module.in_channels
                               // groups, module.out_channels // groups)


def _conv_weight_by_examples(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, d: torch.Tensor,
                             summed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sum_i |g_i|^2` of the conv's weight from its explicit per-example gradients `g_i` (the
    backend's grouped kernel or patches and a batched matmul, `patches_are_cheaper`; in chunks
    on the CPU, `CONV_CHUNK`, `PATCH_BYTES`), and with `summed` their sum `sum_i g_i`: the
    batch's weight gradient, in the weight's layout."""
    n, groups = x.shape[0], module.groups
    taps = math.prod(module.kernel_size)
    positions = math.prod(d.shape[2:])
    channels = module.in_channels // groups
    by_patches = patches_are_cheaper(channels, groups, taps, positions, x.device.type)
    chunk = CONV_CHUNK if x.device.type == "cpu" else max(n, 1)
    chunk = min(chunk, max(1, GRADIENT_BYTES // (x.element_size() * module.weight.numel())))
    if by_patches:
        per_example = x.element_size() * taps * module.in_channels * positions
        chunk = min(chunk, max(1, PATCH_BYTES // per_example))
    total: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    for start in range(0, n, chunk):
        xs, ds = (x, d) if n <= chunk else (x[start:start + chunk], d[start:start + chunk])
        b = xs.shape[0]
        if by_patches:  # (b*g, C/g*K, L) against (b*g, L, out/g)
            rows = b * groups
            grads = torch.bmm(_patches_first(module, xs).reshape(rows, -1, positions),
                              ds.reshape(rows, -1, positions).transpose(1, 2))
        else:  # (b*out, C/g, *kernel)
            grads = _conv_per_example_grad(module, xs, ds)
        flat = grads.flatten()
        part = torch.dot(flat, flat)
        total = part if total is None else total + part
        if summed:
            if by_patches:  # (g, C/g*K, out/g) -> (out, C/g, *kernel)
                part = grads.reshape(b, groups, -1, grads.shape[-1]).sum(0).transpose(1, 2)
                part = part.reshape(module.weight.shape)
            else:
                part = grads.reshape(b, *module.weight.shape).sum(0)
            weight = part if weight is None else weight + part
    return (total if total is not None else d.new_zeros(())), weight


def fusable(module: nn.Conv1d | nn.Conv2d, a: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether a measured step computes this conv's weight gradient as the sum of its explicit
    per-example gradients (`ConvWeightByExamples`) instead of the backend's batch weight
    gradient plus a second pass for the norms: a trained plain weight (not a subclass such as
    a sharded DTensor), batched input, zero padding given as numbers (the forward then runs
    the conv on the input itself), float32/float64 throughout without autocast, no saved-tensor
    hooks (activation checkpointing recomputes the forward and expects the tensors it saved
    the first time), and the explicit form cheaper than the Gram form. Elsewhere the output's
    gradient hook."""
    weight = module._parameters.get("weight")
    if weight is None or type(weight) is not nn.Parameter or not weight.requires_grad:
        return False
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return False
    if a.dim() != weight.dim() or not a.dtype == weight.dtype == output.dtype or \
            a.dtype not in _FULL or torch.is_autocast_enabled(a.device.type):
        return False
    if _saved_tensors_hooks is None or _saved_tensors_hooks(False) is not None:
        return False
    bias = module._parameters.get("bias")
    if bias is not None and (type(bias) is not nn.Parameter or bias.dtype != weight.dtype):
        return False
    return _explicit_is_cheaper(module, math.prod(output.shape[2:]))


_FULL = (torch.float32, torch.float64)


_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
"""The innermost saved-tensor hooks in force (`torch.autograd.graph.saved_tensors_hooks`:
activation checkpointing, offloading), or None."""


_POSITIONS = {1: (2,), 2: (2, 3)}
"""The position dimensions of a Conv1d's and a Conv2d's output."""


class ConvWeightByExamples(torch.autograd.Function):
    """A conv's output on a measured step, whose backward computes the weight gradient once,
    as the sum over examples of the explicit per-example gradients `g_i`, with
    `sum_i |g_i|^2` (and the bias's) as a by-product appended to the owner's values; the input
    and bias gradients as the backend computes them. The forward hands back the output already
    computed (no second conv); the original output's graph is left unused. Under
    `create_graph=True` the backend's differentiable backward (the norms then from a second
    pass), so that second derivatives stay right."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                output: torch.Tensor, module: nn.Conv1d | nn.Conv2d, owner: Any  # hooks.PerExample
                ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.owner, ctx.bias = module, owner, bias is not None
        return output.detach()  # a new tensor, not a view of an input: in-place ops allowed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        module = ctx.module
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        spatial = len(module.kernel_size)
        args = (module.stride, module.padding, module.dilation, False, [0] * spatial,
                module.groups)
        sizes = [weight.shape[0]] if ctx.bias else None
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients
            dx, dw, db = torch.ops.aten.convolution_backward(
                grad, x, weight, sizes, *args, [need_x, need_weight, need_bias])
            with torch.no_grad():
                ctx.owner.values.append(_conv_sq(module, x.detach().float(), grad.detach().float(),
                                                 need_weight, need_bias))
            return dx, dw, db, None, None, None
        dx = db = None
        if need_x:
            dx = torch.ops.aten.convolution_backward(grad, x, weight, None, *args,
                                                     [True, False, False])[0]
        total, dw = _conv_weight_by_examples(module, x, grad, True)
        if need_bias:  # each example's bias gradient, (B, out)
            summed = grad.sum(_POSITIONS[spatial])
            flat = summed.view(-1)
            total = total + torch.dot(flat, flat)
            db = summed.sum(0)
        ctx.owner.values.append(total)
        return dx, dw, db, None, None, None
