"""Per-example squared gradient norms in the optimizer's diagonal preconditioner P,
`sum_i |g_i|_P^2 = sum_i sum_j P_j g_ij^2` (`gnsweep.measure.preconditioner`), for the
preconditioned noise scale `B_simple_P = tr(P Sigma) / G^T P G` (eq. 2.9 and A.2 in the P-norm)
measured with per-example hooks, with no micro-batches.

The Gram ("ghost") form of the plain norms, `sum_{t,s} (a_t.a_s)(d_t.d_s)`, does not carry a
weight on the parameter's entries, so a layer over positions materialises each example's own
gradient, in chunks of examples of at most `GRADIENT_BYTES` (the cost of one more weight
gradient, and no more memory than that bound). Where a layer has one position per example
(a linear layer on rows, an embedding looked up once per example) nothing is materialised:
`sum_{o,k} P_ok d_o^2 a_k^2 = (d^2)^T P (a^2)`.
"""

from __future__ import annotations

import torch

GRADIENT_BYTES = 64 << 20
"""Most bytes of explicit per-example gradients held at once by the P-weighted norms of a
layer over positions (a 768 x 768 linear layer: 2.4 MB an example, 28 examples a chunk)."""


def _chunk(numel: int, element_size: int) -> int:
    return max(1, GRADIENT_BYTES // max(1, numel * element_size))


def rows_sq(a: torch.Tensor | None, d: torch.Tensor, weight: torch.Tensor | None,
            bias: torch.Tensor | None) -> torch.Tensor:
    """`sum_i |g_i|_P^2` of a linear layer with one example per row, a (B, I), d (B, O), P of
    the weight (O, I) and of the bias (O,) (None: not trained): example i's weight gradient is
    `d_i a_i^T`, so its P-norm is `(d_i^2)^T P (a_i^2)`, one matrix product for the batch."""
    d2 = d * d
    total = d.new_zeros(())
    if weight is not None and a is not None:
        total = total + torch.dot((d2 @ weight).reshape(-1), (a * a).reshape(-1))
    if bias is not None:
        total = total + torch.dot(d2.sum(0), bias)
    return total


def linear_sq(a: torch.Tensor, d: torch.Tensor, weight: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
    """`sum_i |g_i|_P^2` of a linear layer over positions, a (B, T, I), d (B, T, O), P of the
    weight (O, I) and of the bias (O,) (None: not trained): example i's weight gradient
    `sum_t d_it a_it^T` materialised in chunks of examples (`GRADIENT_BYTES`); one position
    per example goes `rows_sq`'s way."""
    if a.shape[1] == 1:
        return rows_sq(a[:, 0], d[:, 0], weight, bias)
    total = d.new_zeros(())
    if weight is not None:
        chunk = _chunk(weight.numel(), d.element_size())
        for start in range(0, a.shape[0], chunk):
            g = torch.bmm(d[start:start + chunk].transpose(1, 2), a[start:start + chunk])
            total = total + torch.dot((g * g).sum(0).reshape(-1), weight.reshape(-1))
    if bias is not None:
        s = d.sum(1)
        total = total + torch.dot((s * s).sum(0), bias)
    return total


def linear_both(a: torch.Tensor, d: torch.Tensor, trained: tuple[bool, bool],
                weight: torch.Tensor | None, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(`sum_i |g_i|^2`, `sum_i |g_i|_P^2`) of a linear layer over positions, a (B, T, I),
    d (B, T, O), from the same explicit per-example gradients (`linear_sq`): where the plain
    norms would take the explicit form too, this costs one weighting more, not a second
    gradient. `trained`: whether the weight and the bias are trained; `weight`, `bias`: their
    P."""
    plain = d.new_zeros(())
    weighted = d.new_zeros(())
    if trained[0]:
        chunk = _chunk(a.shape[2] * d.shape[2], d.element_size())
        for start in range(0, a.shape[0], chunk):
            g = torch.bmm(d[start:start + chunk].transpose(1, 2), a[start:start + chunk])
            g2 = (g * g).sum(0).reshape(-1)
            plain = plain + g2.sum()
            if weight is not None:
                weighted = weighted + torch.dot(g2, weight.reshape(-1))
    if trained[1]:
        s = d.sum(1)
        s2 = (s * s).sum(0)
        plain = plain + s2.sum()
        if bias is not None:
            weighted = weighted + torch.dot(s2, bias)
    return plain, weighted


def embedding_sq(index: torch.Tensor, d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`sum_i |g_i|_P^2` of an embedding, index (B, T), d (B, T, C) (padding rows already
    zeroed), P of the weight (V, C): row k of example i's gradient is the sum of `d_it` over
    its positions t looking up k, so `|g_i|_P^2 = sum_{t,s: x_it = x_is} sum_c P_{x_it,c}
    d_itc d_isc`: P gathered at the looked-up rows, B T^2 C as the plain norms, never V."""
    p = weight[index]  # (B, T, C)
    if index.shape[1] == 1:
        return torch.dot((p * d).reshape(-1), d.reshape(-1))
    same = index.unsqueeze(2) == index.unsqueeze(1)
    return (torch.bmm(d * p, d.transpose(1, 2)) * same).sum()


def explicit_sq(grads: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`sum_i |g_i|_P^2` from explicit per-example gradients `grads` (B, *shape), P of shape
    `shape` (or broadcast to it)."""
    g2 = (grads * grads).sum(0)
    return (g2 * weight).sum()
