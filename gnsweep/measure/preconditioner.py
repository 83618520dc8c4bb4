"""The optimizer's diagonal preconditioner P, for the preconditioned noise scale
`B_simple_P = tr(P Sigma) / (G^T P G)`.

An adaptive optimizer steps along `P g`; in the coordinates `x' = P^(-1/2) x` that step is a
plain gradient step, and its B_simple (eq. 2.9) is the one above: eq. A.2 with every squared
norm `|v|^2` replaced by `|v|_P^2 = sum P v^2`. P is read from the optimizer's state as it stands
before this step's update (the second moments of the steps so far):

- Adam, AdamW, NAdam (a state with `exp_avg_sq`): `P = 1 / (sqrt(v_hat) + eps)`,
  `v_hat = exp_avg_sq / (1 - beta2^step)` (`max_exp_avg_sq` with amsgrad);
- RMSprop (`square_avg`): `P = 1 / (sqrt(v) + eps)`, `v = square_avg - grad_avg^2` when centered;
- Adagrad (`sum`): `P = 1 / (sqrt(sum) + eps)`;
- SGD, with or without momentum: `P = I`, and B_simple_P is B_simple.

Any other optimizer: None (B_simple_P is not measured, never guessed). Before the first update
an adaptive optimizer has no state yet: no P.
"""

from __future__ import annotations

import torch
from torch import nn

IDENTITY = "identity"
"""`preconditioner`'s answer for an optimizer whose step is the gradient itself (SGD)."""

ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RMSprop,
            torch.optim.Adagrad)
"""Optimizers whose diagonal P is read from their state (module docstring)."""


def kind(optimizer: torch.optim.Optimizer | None) -> str | None:
    """"identity" (SGD), "diagonal" (an optimizer of `ADAPTIVE`), or None (unknown: B_simple_P
    is not measured)."""
    if optimizer is None:
        return None
    if type(optimizer) is torch.optim.SGD:
        return IDENTITY
    if isinstance(optimizer, ADAPTIVE):
        return "diagonal"
    return None


@torch.no_grad()
def preconditioner(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]
                   ) -> torch.Tensor | None:
    """P over `params`, flattened in their order (fp32), from the optimizer's current state;
    None when some parameter has no state yet (before the first update) or the optimizer is
    not one of `ADAPTIVE`."""
    parts = preconditioner_parts(optimizer, params)
    return None if parts is None else torch.cat([part.reshape(-1) for part in parts])


@torch.no_grad()
def preconditioner_parts(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]
                         ) -> list[torch.Tensor] | None:
    """`preconditioner`, one fp32 tensor per parameter in its shape; Adam's family in a few
    `foreach` ops for all parameters (per tensor on the CPU, each op costs microseconds)."""
    if not isinstance(optimizer, ADAPTIVE):
        return None
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam))
    parts = []
    moments, scales, eps = [], [], []
    for p in params:
        group, state = groups.get(id(p)), optimizer.state.get(p)
        if group is None or not state:
            return None
        if adam:
            v = state.get("max_exp_avg_sq") if group.get("amsgrad") else state.get("exp_avg_sq")
            step = float(state["step"]) if v is not None else 0.0
            if v is None or step < 1:
                return None
            moments.append(v.float())
            scales.append(1.0 / (1.0 - group["betas"][1] ** step))
            eps.append(float(group["eps"]))
            continue
        diagonal = _diagonal(optimizer, group, state)
        if diagonal is None:
            return None
        parts.append(diagonal.float())
    if adam:  # 1 / (sqrt(v / (1 - beta2^step)) + eps)
        parts = list(torch._foreach_mul(moments, scales))
        torch._foreach_sqrt_(parts)
        torch._foreach_add_(parts, eps)
        torch._foreach_reciprocal_(parts)
    return parts


def _diagonal(optimizer: torch.optim.Optimizer, group: dict, state: dict
              ) -> torch.Tensor | None:
    eps = float(group["eps"])
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam)):
        v = state.get("max_exp_avg_sq") if group.get("amsgrad") else state.get("exp_avg_sq")
        if v is None:
            return None
        step = float(state["step"])
        if step < 1:
            return None
        v_hat = v / (1.0 - group["betas"][1] ** step)
        return 1.0 / (v_hat.sqrt() + eps)
    if isinstance(optimizer, torch.optim.RMSprop):
        v = state.get("square_avg")
        if v is None:
            return None
        if group.get("centered") and "grad_avg" in state:
            v = v - state["grad_avg"] ** 2
        return 1.0 / (v.sqrt() + eps)
    if isinstance(optimizer, torch.optim.Adagrad):
        v = state.get("sum")
        return None if v is None else 1.0 / (v.sqrt() + eps)
    return None
