"""H-norms of micro-batch gradients from Hessian-vector products (double backward), for
B_noise (eq. 2.8)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gnsweep.measure.common import (
    Batch,
    LossFn,
    TaskLoss,
    batch_len,
    batch_loss,
    check_scalar,
    take,
)
from gnsweep.noise import NormPair


def hessian_norms(module: nn.Module, loss_fn: LossFn | None, batch: Batch,
                  microbatches: int = 2, *, task_loss: TaskLoss | None = None,
                  params: list[nn.Parameter] | None = None) -> NormPair | None:
    """H-norms of micro-batch gradients for B_noise (eq. 2.8 through eq. A.2), at the module's
    current parameters. Returns `(|G_small|_H^2, |G_big|_H^2, b_small, b_big)`, or None when the
    batch is too small to split.

    The batch is cut in two: k micro-batches of one part give gradients `g_j` (b_small examples
    each) and their mean `G_big` (b_big = k b_small examples); the other part's loss gives the
    Hessian `H_Q` through double backward. Because `H_Q` is independent of the `g_j` and
    `E H_Q = H`, `E[g^T H_Q g] = E[g^T H g]`; taking H from the same examples as g would bias
    tr(H Sigma) by terms of order 1/B. `H_Q G_big = mean_j H_Q g_j`, so k products suffice.

    The loss is `loss_fn(module(inputs), targets)` on `batch=(inputs, targets)`, or, with
    `task_loss`, `task_loss(module, part)` on parts of any batch a task samples (split along
    dim 0, dicts included). `params`: the measured block (default every trainable
    parameter): its gradient and the Hessian's diagonal block on it.
    """
    loss_of = _loss_closure(module, loss_fn, task_loss, batch)
    n = batch_len(batch if task_loss is not None else batch[0])
    size = n // (2 * microbatches)
    if size < 1:
        return None
    if params is None:
        params = [p for p in module.parameters() if p.requires_grad]
    split = size * microbatches
    grads = []
    for j in range(microbatches):
        index = slice(j * size, (j + 1) * size)
        loss = loss_of(index)
        grads.append(_grad(loss, params, create_graph=False))
    rest = slice(split, n)
    # Attention by the math kernel here: the fused kernels `scaled_dot_product_attention` picks
    # (flash, memory-efficient) have no double backward. Same attention, more memory.
    with torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]):
        loss = loss_of(rest)
        refuse_once_differentiable(loss)
        g_q = _grad(loss, params, create_graph=True)
    # Gradient entries that do not depend on the parameters have zero Hessian rows.
    keep = [i for i, g in enumerate(g_q) if g.requires_grad]
    h_small = []
    hv_sum = [torch.zeros_like(p) for p in params]
    for j, g in enumerate(grads):
        products = torch.autograd.grad([g_q[i] for i in keep], params,
                                       grad_outputs=[g[i] for i in keep],
                                       retain_graph=j < microbatches - 1, allow_unused=True)
        hv = [h if h is not None else torch.zeros_like(p) for h, p in zip(products, params,
                                                                          strict=True)]
        h_small.append(_dot(g, hv))
        torch._foreach_add_(hv_sum, hv)
    g_big = [torch.stack(gs).mean(0) for gs in zip(*grads, strict=True)]
    h_big = _dot(g_big, hv_sum) / microbatches
    values = torch.stack([*h_small, h_big]).tolist()
    return NormPair(sum(values[:-1]) / microbatches, values[-1], float(size), float(split))


def _loss_closure(module: nn.Module, loss_fn: LossFn | None, task_loss: TaskLoss | None,
                  batch: Batch) -> Callable[[slice], torch.Tensor]:
    """The loss of the examples `index` of the batch."""
    if task_loss is not None:
        def of_task(index: slice) -> torch.Tensor:
            with torch.enable_grad():
                loss = task_loss(module, take(batch, index))
            check_scalar(loss)
            return loss

        return of_task
    if loss_fn is None:
        raise ValueError("hessian_norms needs loss_fn(outputs, targets) or task_loss(model, "
                         "batch)")
    inputs, targets = batch

    def of_outputs(index: slice) -> torch.Tensor:
        return batch_loss(module, loss_fn, take(inputs, index), take(targets, index))

    return of_outputs


def refuse_once_differentiable(loss: torch.Tensor) -> None:
    """RuntimeError when the loss's graph has a custom autograd Function whose backward is
    marked `once_differentiable` (some custom kernels): that backward builds no graph, so double
    backward would miss its second-derivative terms and B_noise would be wrong without a word."""
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        function: Any = getattr(node, "_forward_cls", None)  # a custom Function's node
        backward: Any = getattr(function, "backward", None)
        if getattr(backward, "__wrapped__", None) is not None and \
                backward.__code__.co_filename == _ONCE_DIFFERENTIABLE_FILE:
            raise RuntimeError(f"{function.__name__} (a custom autograd Function) is marked "
                               "once_differentiable: it has no double backward")
        stack.extend(next_node for next_node, _ in node.next_functions)


_ONCE_DIFFERENTIABLE_FILE = torch.autograd.function.once_differentiable(
    lambda ctx: None).__code__.co_filename
"""Where `once_differentiable`'s wrapper is defined (torch's own file): how a marked backward is
told from any other."""


def _grad(loss: torch.Tensor, params: list[nn.Parameter], *, create_graph: bool
          ) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, params, create_graph=create_graph, allow_unused=True)
    return [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params,
                                                                       strict=True)]


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(x.double() * y.double()).sum() for x, y in zip(a, b, strict=True)]
                       ).sum()


def hessian_or_refusal(module: nn.Module, loss_fn: LossFn | None, batch: Batch,
                       microbatches: int, *, task_loss: TaskLoss | None,
                       params: list[nn.Parameter]
                       ) -> tuple[NormPair | None, tuple[str, str] | None]:
    """`hessian_norms`, or None and the (key, message) to say once where B_noise cannot be
    measured on this model at all: its loss has no double backward (an op without one), or its
    Hessian pass does not fit in device memory. The run trains on without B_noise."""
    try:
        return hessian_norms(module, loss_fn, batch, microbatches, task_loss=task_loss,
                             params=params), None
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None, ("hmemory", "noise scale: B_noise's Hessian pass ran out of device memory "
                      "(double backward keeps the graph of a gradient, and attention runs by "
                      "its math kernel there); B_noise is not measured (noise.hessian_every=0 "
                      "leaves it out)")
    except RuntimeError as err:
        text = str(err)
        if "derivative for" not in text and "double backward" not in text:
            raise
        return None, ("hdouble", "noise scale: B_noise needs Hessian-vector products (double "
                      "backward) of the loss, which this model does not support ("
                      f"{text.splitlines()[0]}); B_noise is not measured")
