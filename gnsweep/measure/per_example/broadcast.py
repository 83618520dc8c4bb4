"""Per-example gradients of parameters broadcast over the batch: a position embedding or class
token held as a parameter of shape (1, ...) and added to, or concatenated with, every example
(ViT's `pos_embed` and `cls_token`). Its gradient arrives summed over the examples, and no
layer's hooks see it per example. On a measured step the parameter is replaced, for the model's
forward only, by its view expanded along dim 0 to the batch, `P.expand(B, ...)`: the same
values, so the same computation wherever the model broadcasts it along the batch; the view's
gradient is each example's own (row i), and autograd sums it into `P.grad` as before.

That the expanded view computes the same is checked, never assumed: before the first measured
forward of its owner, the owner is run twice without gradients on the first examples of the
batch, with the parameter and with its expanded view, the random state the same for both; a
parameter whose outputs differ (a use along another dimension, `x @ P.t()`) is left to
micro-batches, said with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gnsweep.measure.common import Gate

PROBE_EXAMPLES = 2
"""Examples the check runs the model on (two: a broadcast along dim 0 needs more than one)."""


def candidates(model: nn.Module, wanted: set[int], functional: set[int]
               ) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(full name, owner, attribute, parameter) of the measured parameters that may be broadcast
    over the batch: owned by a module that is no leaf measured by its own forward (`functional`),
    of shape (1, ...) with at least two dimensions, not shared with another module."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    found = []
    for prefix, module in model.named_modules():
        if id(module) in functional:
            continue
        for name, p in module.named_parameters(recurse=False):
            if id(p) in wanted and p.dim() >= 2 and p.shape[0] == 1 and owners[id(p)] == 1:
                found.append((f"{prefix}.{name}" if prefix else name, module, name, p))
    return found


def same_values(a: Any, b: Any) -> bool:
    """Whether two outputs of the model are equal: tensors bitwise (NaN in the same places),
    containers element by element, anything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.shape == b.shape and bool(torch.equal(a.nan_to_num(), b.nan_to_num()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:
        return False


def first_examples(values: Any, batch: int, n: int) -> Any:
    """The first `n` examples of every tensor whose dim 0 has the batch's length; everything
    else as it is."""
    if isinstance(values, torch.Tensor):
        return values[:n] if values.dim() > 0 and values.shape[0] == batch else values
    if isinstance(values, (tuple, list)):
        return type(values)(first_examples(v, batch, n) for v in values)
    if isinstance(values, dict):
        return {k: first_examples(v, batch, n) for k, v in values.items()}
    return values


class Broadcast:
    """The broadcast parameters of a model measured per example through their expanded views
    (`PerExample` owns one): hooks on each owner swap them in before its forward on a measured
    step and put the parameters back after it."""

    def __init__(self, gate: Gate, found: list[tuple[str, nn.Module, str, nn.Parameter]],
                 batch: Callable[[], int], values: Callable[[], list[torch.Tensor]],
                 weighted: Callable[[nn.Parameter, torch.Tensor], None] | None = None
                 ) -> None:
        """`batch()`: the examples of the model's current forward; `values()`: the list each
        example's squared gradient norm is appended to; `weighted(p, grads)`: given each
        parameter's per-example gradients (B, ...) too (the P-norms of an adaptive
        optimizer's preconditioner)."""
        self.gate, self.found, self.batch, self.values = gate, found, batch, values
        self.weighted = weighted
        self.params = [p for _, _, _, p in found]
        self.checked: set[int] = set()
        """Owners whose expanded views were checked (`check`)."""
        self.refused: dict[int, str] = {}
        """Parameter id -> why its expanded view is not used (the model computes otherwise)."""
        self.implied: dict[int, torch.Tensor] = {}
        """Parameter id -> the batch gradient its views received (for the coverage check)."""
        self._swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        self.handles: list[Any] = []
        owners = {id(m): m for _, m, _, _ in found}
        for module in owners.values():
            self.handles.append(module.register_forward_pre_hook(self._before, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._after, always_call=True))

    def _mine(self, module: nn.Module) -> list[tuple[str, str, nn.Parameter]]:
        return [(name, attr, p) for name, m, attr, p in self.found
                if m is module and id(p) not in self.refused]

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (self.gate.capturing and torch.is_grad_enabled()):
            return
        batch = self.batch()
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if batch < 1 or first is None or first.dim() == 0 or first.shape[0] != batch:
            # The owner's input does not carry the model's batch along dim 0: no view (its
            # parameters then count as unseen, and go to micro-batches).
            return
        if id(module) not in self.checked and batch > 1:  # one example: the view is the
            self.check(module, args, kwargs, batch)       # parameter's own shape
        for _, attr, p in self._mine(module):
            view = p.expand(batch, *p.shape[1:])
            view.register_hook(lambda grad, p=p: self._captured(p, grad))
            module._parameters[attr] = view  # type: ignore[assignment]
            self._swapped.append((module, attr, p))

    def _after(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.restore()

    def restore(self) -> None:
        for module, attr, p in self._swapped:
            module._parameters[attr] = p
        self._swapped = []

    def check(self, module: nn.Module, args: tuple, kwargs: dict, batch: int) -> None:
        """Run the owner on its first `PROBE_EXAMPLES` examples with each parameter and with its
        expanded view (no gradients, the same random state both times) and refuse the views
        whose outputs differ."""
        self.checked.add(id(module))
        n = min(PROBE_EXAMPLES, batch)
        cut_args, cut_kwargs = first_examples(args, batch, n), first_examples(kwargs, batch, n)
        devices = sorted({p.device.index or 0 for p in self.params if p.device.type == "cuda"})
        forward = type(module).forward  # without the hooks (this one among them)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                state = torch.get_rng_state()
                plain = forward(module, *cut_args, **cut_kwargs)
                for name, attr, p in self._mine(module):
                    module._parameters[attr] = p.expand(n, *p.shape[1:])  # type: ignore[assignment]
                    try:
                        torch.set_rng_state(state)
                        expanded: Any = forward(module, *cut_args, **cut_kwargs)
                    except Exception as err:
                        expanded = err
                    finally:
                        module._parameters[attr] = p
                    if isinstance(expanded, Exception) or not same_values(plain, expanded):
                        self.refused[id(p)] = (f"{name}: the model does not compute the same "
                                               "with it expanded along the batch, so it is not "
                                               "broadcast over the examples")
        except Exception as err:  # the owner cannot run on a few examples: no verdict
            first = (str(err).splitlines() or [type(err).__name__])[0][:200]
            for name, _, p in self._mine(module):
                self.refused[id(p)] = (f"{name}: its layer could not be run on {n} examples to "
                                       f"check that it is broadcast over the batch ({first})")

    def _captured(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        with torch.no_grad():
            g = grad.detach().float()
            flat = g.reshape(-1)
            self.values().append(torch.dot(flat, flat))
            if self.weighted is not None:
                self.weighted(p, g)
            summed = g.sum(0, keepdim=True)
            known = self.implied.get(id(p))
            self.implied[id(p)] = summed if known is None else known + summed
