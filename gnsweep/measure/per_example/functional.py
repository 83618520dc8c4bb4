"""Per-example gradients of a layer gnsweep has no formula for, by its own forward: the layer's
forward run again on each example alone under `torch.func.vmap` of `torch.func.grad` (as
Opacus does for modules it does not know, and ExpandedWeights for stock ones), for the
parameters the layer owns. It suits small leaf layers that own their parameters: a custom
RMSNorm or LayerNorm, ConvNeXt's LayerNorm2d, a layer-scale module. The layer's own forward
runs without its hooks, with its parameters swapped for detached copies, so that neither the
monitor's hooks nor the parameters' own hooks fire.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.utils import stateless

FUNCTIONAL_MAX_NUMEL = 1 << 20
"""Most elements of a layer's own parameters for the functional route: each example's gradient
of them is materialised (a norm layer's scale has a few thousand)."""


def functional_refusal(module: nn.Module) -> str | None:
    """Why the functional route cannot measure this layer's own parameters, or None: it needs a
    leaf layer (no child modules, whose forwards would run again too), plain parameters of at
    most `FUNCTIONAL_MAX_NUMEL` elements, and no buffers it updates (batch statistics)."""
    if next(module.children(), None) is not None:
        return ("used beside its child layers, where no hook sees them per example (a "
                "parameter broadcast over the batch, such as a position embedding or a class "
                "token, gets its gradient summed over the examples)")
    own = [p for p in module.parameters(recurse=False) if p.requires_grad]
    if not own:
        return f"{type(module).__name__} owns no trained parameter"
    if sum(p.numel() for p in own) > FUNCTIONAL_MAX_NUMEL:
        return f"{type(module).__name__}'s own parameters are large"
    if any(b is not None for b in module.buffers(recurse=False)) and \
            any(name.startswith("running") for name, _ in module.named_buffers(recurse=False)):
        return f"{type(module).__name__} keeps running statistics"
    return None


def _loss(module: nn.Module, names: list[str], values: tuple[torch.Tensor, ...],
          x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """`<module(x), d>` for one example (no batch dimension), the module's own parameters set
    to `values`: its gradient in `values` is that example's parameter gradient."""
    with stateless._reparametrize_module(module, dict(zip(names, values, strict=True))):
        out = type(module).forward(module, x.unsqueeze(0))
    return (out * d.unsqueeze(0)).sum()


def own_parameters(module: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
    pairs = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
    return [n for n, _ in pairs], [p for _, p in pairs]


def per_example_sq(module: nn.Module, a: torch.Tensor, d: torch.Tensor,
                   weights: list[torch.Tensor | None] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum over the examples (dim 0) of `|g_i|^2`, `g_i` example i's gradient of the layer's own
    parameters, from its input `a` and output gradient `d`, in float32 (float64 kept); with
    `weights` (the optimizer's P of each own parameter, `own_parameters`' order, None for one
    without), also `sum_i |g_i|_P^2` (else None)."""
    total, _, weighted = _per_example(module, a, d, summed=False, weights=weights)
    return total, weighted


def per_example(module: nn.Module, a: torch.Tensor, d: torch.Tensor, *, summed: bool
                ) -> tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]:
    """(`sum_i |g_i|^2`, and with `summed` each parameter's `sum_i g_i`: the batch gradient the
    layer received) from every example's own gradient, in chunks of examples."""
    total, sums, _ = _per_example(module, a, d, summed=summed, weights=None)
    return total, sums


def _per_example(module: nn.Module, a: torch.Tensor, d: torch.Tensor, *, summed: bool,
                 weights: list[torch.Tensor | None] | None
                 ) -> tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]],
                            torch.Tensor | None]:
    names, params = own_parameters(module)
    dtype = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    values = tuple(p.detach().to(dtype) for p in params)
    x, g = a.detach(), d.detach()
    if x.is_floating_point():
        x = x.to(dtype)
    g = g.to(dtype)
    per = torch.func.vmap(torch.func.grad(lambda v, xi, di: _loss(module, names, v, xi, di)),
                          in_dims=(None, 0, 0))
    numel = sum(p.numel() for p in params)
    chunk = max(1, (64 << 20) // (numel * g.element_size()))
    total = g.new_zeros(())
    weighted = g.new_zeros(()) if weights is not None else None
    sums = [torch.zeros_like(v) for v in values] if summed else []
    with torch.enable_grad():
        for start in range(0, x.shape[0], chunk):
            grads = per(values, x[start:start + chunk], g[start:start + chunk])
            for i, grad in enumerate(grads):
                flat = grad.reshape(-1)
                total = total + torch.dot(flat, flat)
                if weights is not None and weights[i] is not None:
                    weight = weights[i]
                    assert weight is not None and weighted is not None
                    weighted = weighted + ((grad * grad).sum(0) * weight.to(grad.dtype)).sum()
                if summed:
                    sums[i] += grad.sum(0)
    return total, list(zip(params, sums, strict=False)) if summed else [], weighted


def fits(module: nn.Module, a: Any) -> bool:
    """Whether a call can go the functional route: one tensor input with examples along dim 0."""
    return isinstance(a, torch.Tensor) and a.dim() >= 1 and math.prod(a.shape) > 0
