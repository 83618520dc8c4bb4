"""Per-example gradient norms (b_small = 1) from forward/backward hooks on the layers that
allow them (`nn.Linear`, transformers' `Conv1D`, `nn.Conv1d`, `nn.Conv2d`, `nn.Embedding`,
`nn.LayerNorm`, `nn.RMSNorm`; parameters tied across such layers through
`tied.Tied`); the layer rules themselves are `layers`'."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks

from gnsweep.measure.common import Gate, fp32, say_once
from gnsweep.measure.per_example import attention as attention_route
from gnsweep.measure.per_example import preconditioned_norms as pnorm
from gnsweep.measure.per_example.attention import Attention
from gnsweep.measure.per_example.broadcast import Broadcast, candidates
from gnsweep.measure.per_example.coverage import Coverage
from gnsweep.measure.per_example.functional import (
    functional_refusal,
    own_parameters,
    per_example_sq,
)
from gnsweep.measure.per_example.layers import (
    ConvWeightByExamples,
    fusable,
    grad_row_sq,
    layer_psq,
    layer_sq,
    row_sq,
    trainable,
    weight_p,
)
from gnsweep.measure.per_example.positions import shared_lookups
from gnsweep.measure.per_example.tied import (
    Tied,
    along_batch,
    is_conv1d,
    linear_like,
    own_forward,
)
from gnsweep.measure.source import Reading, StepNorms, unscale
from gnsweep.noise import NormPair


class PerExample:
    """Sum over examples of `|g_i|^2` for the covered parameters, from forward/backward hooks.

    For a layer `y = W a + b` the gradient of example i is `sum_t d_it a_it^T` (t over positions
    of a sequence or an image), so `|g_i|^2 = sum_{t,s} (a_it.a_is)(d_it.d_is)` (the Gram form,
    `|a_i|^2 |d_i|^2` without positions) plus `|sum_t d_it|^2` for the bias; whichever of the
    Gram form or the explicit per-example gradient is cheaper is used. Nothing of parameter size
    is materialised per example unless that is cheaper.
    """

    def __init__(self, gate: Gate, model: nn.Module, measured: list[nn.Parameter],
                 excluded: dict[int, str] | None = None) -> None:
        """Hooks on the layers holding `measured` parameters; layers without any are left
        alone (their gradients are not part of the measured block). `excluded`: parameter id
        -> why per-example norms are wrong for it (`coverage`): its layer is
        left to micro-batches, said with that reason."""
        self.gate = gate
        self.preconditioner: Callable[[], dict[int, torch.Tensor] | None] | None = None
        """The optimizer's diagonal preconditioner P by parameter id (set by the monitor for
        an adaptive optimizer, `PreconditionedEstimate.precondition`), read once a measured step:
        the hooks then also sum the P-norms `sum_i |g_i|_P^2` (`preconditioned_norms`)."""
        self.forward_id = 0
        self.batch = 0
        """Examples in the current forward of the model (set by the monitor)."""
        self.reset()
        self.covered: set[int] = set()
        self.positional: set[str] = set()
        """Kinds of the layers captured so far whose norms needed per-position work
        (convolutions, sequences: Gram matrices or explicit per-example gradients)."""
        self.positions = 0
        """The most positions per example of a sequence layer captured so far (tokens)."""
        self.handles: list[Any] = []
        self.unattributed: dict[str, str] = {}
        """Layers whose output did not carry the batch's examples along dim 0 (name -> what
        was seen): an input without the batch dimension, such as positions
        `wpe(torch.arange(T))` of shape (T, C) broadcast over the batch, whose gradient arrives
        summed over the examples. Per-example norms cannot attribute their gradients; a step
        with one is not measured (`invalid`), and `NoiseScaleMonitor` switches to
        micro-batches."""
        self._last_forward: dict[int, int] = {}
        self._positions: dict[int, bool] = {}
        self._names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        self.excluded = dict(excluded or {})
        wanted = {id(p) for p in measured}
        owners = Counter(id(p) for m in model.modules()
                         for p in m.parameters(recurse=False))
        # nn.MultiheadAttention whole, as one leaf (`attention`): its
        # parameters are read inside F.multi_head_attention_forward, out_proj's too.
        found_attention: list[tuple[str, nn.MultiheadAttention]] = []
        whole: set[int] = set()
        """Attention modules measured whole, and their out_proj layers."""
        for name, module in model.named_modules():
            if not isinstance(module, nn.MultiheadAttention):
                continue
            ids = {id(p) for _, p in attention_route.parameters(module)}
            if ids and ids <= wanted and not ids & set(self.excluded) and \
                    all(owners[i] == 1 for i in ids):
                found_attention.append((name or type(module).__name__, module))
                whole |= {id(module), id(module.out_proj)}
                self.covered |= ids
        excluded = self.excluded | read_functionally(model, whole)
        skipped: list[str] = []
        self.layers: list[tuple[str, nn.Module]] = []
        """The hooked layers (name, layer), those of tied parameters too."""
        self.functional: set[int] = set()
        """Layers measured by their own forward (`functional`)."""
        self.refused: dict[int, str] = {}
        """Parameter id -> why: parameters of functional-route layers met in a call that route
        cannot take (the monitor moves them to micro-batches)."""
        # Parameters shared by several layers: the norm of the summed per-example gradient.
        self.tied = Tied(gate, model, wanted - set(excluded) - self.covered)
        self.covered |= self.tied.covered
        self.handles += self.tied.handles
        # Parameters of shape (1, ...) held by a layer of one's own beside its children (a
        # position embedding, a class token): per example through their expanded views.
        found = [c for c in candidates(model, wanted - set(excluded), set())
                 if _own_kind(c[1]) and next(c[1].children(), None) is not None]
        spread = {id(c[3]) for c in found}
        for name, module in model.named_modules():
            if id(module) in whole:
                continue
            if id(module) in self.tied.modules:
                self.layers.append((name or type(module).__name__, module))
                continue
            params = [p for p in module.parameters(recurse=False)
                      if p.requires_grad and id(p) not in spread]
            inside = [id(p) in wanted for p in params]
            if not any(inside):
                continue
            reason = next((excluded[id(p)] for p in params if id(p) in excluded), None)
            if reason is None:
                reason = _unsupported(module)
                refusal = functional_refusal(module) if _own_kind(module) else None
                if reason is not None and _own_kind(module) and refusal is not None:
                    own = ", ".join(n for n, p in module.named_parameters(recurse=False)
                                    if p.requires_grad)
                    reason = f"its own {own}: {refusal}"
                if reason is not None and _own_kind(module) and all(inside) and \
                        not any(owners[id(p)] > 1 for p in params) and refusal is None:
                    # A layer of the user's own (a custom norm, a layer-scale): per-example
                    # gradients of its parameters by its own forward (`functional`).
                    self.functional.add(id(module))
                    self.covered.update(id(p) for p in params)
                    self.handles.append(module.register_forward_hook(self._functional_forward,
                                                                     with_kwargs=True))
                    self.layers.append((name or type(module).__name__, module))
                    continue
            if reason is None and not all(inside):
                reason = "only some of its parameters measured"
            if reason is None and any(owners[id(p)] > 1 for p in params):
                reason = "parameters shared with another layer"
            if reason is not None:
                skipped.append(f"{name or type(module).__name__} ({reason})")
                continue
            self.covered.update(id(p) for p in params)
            self.handles.append(module.register_forward_hook(self._forward))
            self.layers.append((name or type(module).__name__, module))
        self.broadcast = Broadcast(gate, found, lambda: self.batch, lambda: self.values,
                                   self._broadcast_preconditioned)
        """The broadcast parameters measured through their expanded views."""
        self.handles += self.broadcast.handles
        self.covered |= spread
        self.lookups = Lookups(model, {id(m): (name, m) for name, m in self.layers
                                       if isinstance(m, nn.Embedding)
                                       and id(m) not in self.tied.modules})
        """The embeddings looked up once for the whole batch (positions)."""
        self.attention = Attention(gate, found_attention, lambda: self.batch,
                                   lambda: self.forward_id, lambda: self.values,
                                   lambda: self.coverage.armed)
        """The nn.MultiheadAttention modules measured whole (`attention`)."""
        self.handles += self.attention.handles
        self.skipped = skipped
        """The layers left to micro-batches, each with why (name (reason))."""
        by_forward = [name for name, m in self.layers if id(m) in self.functional]
        views = [name for name, _, _, _ in found]
        attending = [name for name, _ in found_attention]
        self._routes = "; ".join(part for part in (
            f"by their own forward: {', '.join(by_forward)}" if by_forward else "",
            f"nn.MultiheadAttention whole: {', '.join(attending)}" if attending
            else "",
            f"through their views expanded along the batch: {', '.join(views)}" if views
            else "") if part)
        """What is measured per example another way than by the layer formulas (one line, ""
        when nothing): layers of one's own and broadcast parameters, by name."""
        if skipped:
            text = ", ".join(skipped)
            say_once(f"skipped {text}", f"noise scale: no per-example norms for {text}; their "
                     "parameters are measured with micro-batches")
        self.params = [p for p in measured if id(p) in self.covered]
        self.weighable = self.tied.weighable and not found_attention
        """Every hooked layer has P-norms (`preconditioned_norms`): not so for
        nn.MultiheadAttention measured whole, nor for parameters tied across layers larger
        than `tied.WEIGHED_NUMEL`."""
        self.complete = len(self.params) == len(measured)
        """Every measured parameter is covered (no micro-batches for the rest)."""
        self.coverage = Coverage(gate, model, self.layers, self.params, self.functional,
                                 lambda: self.broadcast.implied | self.attention.implied)
        """The run-time proof that these hooks see the covered parameters' whole gradients."""

    def reset(self) -> None:
        self.values: list[torch.Tensor] = []
        """Sums over examples of `|g_i|^2` of the layers measured during backward."""
        self.rows: list[tuple[torch.Tensor | None, bool, list[torch.Tensor]]] = []
        """The linear layers with one example per row (`_stash`): `|a_i|^2` (None for a frozen
        weight), whether the bias is trained, and `|d_i|^2` of each output gradient."""
        self.invalid = False
        self.pvalues: list[torch.Tensor] = []
        """Sums over examples of `|g_i|_P^2` of the layers measured during backward, while
        P is known (`preconditioner`)."""
        self._weights: dict[int, torch.Tensor] | None = None
        self._weights_read = False
        if hasattr(self, "tied"):
            self.tied.reset()
        if hasattr(self, "broadcast"):
            self.broadcast.implied = {}
            self.broadcast.restore()  # a forward that raised may have left its views in
        if hasattr(self, "attention"):
            self.attention.reset()

    @property
    def preconditions(self) -> bool:
        """This source gives B_simple_P's P-norm pair itself, with no micro-batches: every
        measured parameter covered by layers with P-norms."""
        return self.weighable and self.complete

    def _preconditioner_now(self) -> dict[int, torch.Tensor] | None:
        """P by parameter id for this measured step (read once a step), or None (no
        adaptive optimizer, or before its first update)."""
        if self.preconditioner is None or not self.preconditions:
            return None
        if not self._weights_read:
            self._weights, self._weights_read = self.preconditioner(), True
        return self._weights

    def _p(self, p: Any) -> torch.Tensor | None:
        """P of parameter `p` in its shape, or None (not trained, or P not known)."""
        weights = self._weights
        if weights is None or not isinstance(p, torch.Tensor) or not p.requires_grad:
            return None
        part = weights.get(id(p))
        return None if part is None else part.view(p.shape)

    def _forward(self, module: nn.Module, inputs: tuple, output: Any) -> Any:
        if not (self.gate.capturing and torch.is_grad_enabled()):
            return None
        if not isinstance(output, torch.Tensor) or not output.requires_grad or not inputs:
            return None
        a = inputs[0]
        if not isinstance(a, torch.Tensor):
            return None
        if self.batch > 1 and a.dim() == 1 and not self.lookups.probed and \
                id(module) in self.lookups.embeddings:
            self.lookups.probe()  # before any expanded output is used in training
        if id(module) in self.lookups.refused:
            self.invalid = True  # its weight goes to micro-batches (`verify`)
            return None
        if self.batch > 1 and id(module) in self.lookups.shared and a.dim() == 1:
            # Looked up once for the whole batch (`positions`): the output
            # expanded along the batch, so that its hook receives each example's gradient.
            a = a.unsqueeze(0).expand(self.batch, -1)
            output = output.unsqueeze(0).expand(self.batch, *output.shape)
        flipped = False
        if self.batch > 1 and output.shape[0] != self.batch and \
                _sequence_first(module, a, output, self.batch):
            # Examples along dim 1 (a sequence-first layer, (T, B, ...), T != B): the same
            # formulas on the views with the batch first; the layout check holds dim 1 to the
            # batch (`Coverage.layout`).
            self.coverage.second.add(id(module))
            flipped = True
        elif self.batch > 1 and output.shape[0] != self.batch:
            fitted = along_batch(module, a, output, self.batch)
            if fitted is None:
                # Examples are not along dim 0 here (an input without the batch dimension,
                # broadcast over it, or a sequence-first layout): per-example norms would be
                # wrong, so the step is not measured.
                return self._unattributed(module, a, output)
            a, output = fitted
        elif self.batch > 1 and not self.lookups.known and self._positions_only(module, a):
            # (T,) positions whose count happens to equal the batch's: still not examples.
            return self._unattributed(module, a, output)
        if self._last_forward.get(id(module)) == self.forward_id:
            # Used twice in one forward: per-use norms would miss the cross terms.
            self.invalid = True
            self.gate.warn_once(f"reuse{id(module)}", f"noise scale: {type(module).__name__}"
                                " is called more than once per forward; per-example norms "
                                "skip such steps")
            return None
        self._last_forward[id(module)] = self.forward_id
        weighing = self._preconditioner_now() is not None
        if a.dim() == 2 and linear_like(module):
            if weighing:
                output.register_hook(partial(self._rows_preconditioned, module, a.detach()))
            self._stash(module, a.detach(), output)
            return output
        if isinstance(module, (nn.Conv1d, nn.Conv2d)) and not weighing and \
                fusable(module, a, output) and _first_hook(module, self._forward):
            self.positional.add(type(module).__name__)
            return ConvWeightByExamples.apply(a, module.weight, module.bias, output.detach(),
                                               module, self)
        saved = a.detach().transpose(0, 1) if flipped else a.detach()
        sequence = isinstance(module, nn.Embedding) and saved[0].numel() > 1
        if linear_like(module) or sequence or isinstance(module, (nn.Conv1d, nn.Conv2d)):
            self.positional.add(type(module).__name__)
        if linear_like(module) or sequence:
            positions = saved[0].numel() if sequence else math.prod(saved.shape[1:-1])
            self.positions = max(self.positions, positions)
        if flipped:
            output.register_hook(lambda grad: self._backward(module, saved,
                                                             grad.transpose(0, 1)))
            return output
        output.register_hook(lambda grad: self._backward(module, saved, grad))
        return output

    def _functional_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any
                            ) -> None:
        """A layer of the user's own: its per-example gradients by its own forward, from the
        one tensor it is called on (examples along dim 0) and its output's gradient."""
        if not (self.gate.capturing and torch.is_grad_enabled()):
            return
        a = args[0] if len(args) == 1 and not kwargs else None
        if not (isinstance(a, torch.Tensor) and isinstance(output, torch.Tensor)
                and a.dim() >= 1 and output.dim() >= 1
                and a.shape[0] == output.shape[0] == max(self.batch, 1)):
            name = self._names.get(id(module), type(module).__name__)
            for pname, p in module.named_parameters(recurse=False):
                self.refused[id(p)] = (f"{name}.{pname}: {type(module).__name__} is measured by "
                                       "its own forward only when called on one tensor with "
                                       "the examples along dim 0, and its output alike")
            self.invalid = True
            return
        if not output.requires_grad:
            return
        if self._last_forward.get(id(module)) == self.forward_id:
            self.invalid = True  # used twice in one forward: the uses' cross terms are missed
            self.gate.warn_once(f"reuse{id(module)}", f"noise scale: {type(module).__name__}"
                                " is called more than once per forward; per-example norms "
                                "skip such steps")
            return
        self._last_forward[id(module)] = self.forward_id
        saved = a.detach()
        output.register_hook(partial(self._functional_backward, module, saved))

    def _functional_backward(self, module: nn.Module, a: torch.Tensor, grad: torch.Tensor
                             ) -> None:
        try:
            with torch.no_grad(), fp32(grad.device.type):
                weights = None
                if self._preconditioner_now() is not None:
                    weights = [self._p(p) for p in own_parameters(module)[1]]
                total, weighted = per_example_sq(module, a, grad.detach(), weights)
                self.values.append(total)
                if weighted is not None:
                    self.pvalues.append(weighted)
        except Exception as err:  # a forward vmap cannot run (random ops, data-dependent
            # control flow): its parameters go to micro-batches, with the reason
            name = self._names.get(id(module), type(module).__name__)
            first = (str(err).splitlines() or [type(err).__name__])[0][:200]
            for pname, p in module.named_parameters(recurse=False):
                self.refused[id(p)] = (f"{name}.{pname}: {type(module).__name__}'s own forward "
                                       f"cannot be run one example at a time ({first})")
            self.invalid = True

    def _positions_only(self, module: nn.Module, a: torch.Tensor) -> bool:
        """`positions_only`, decided once per layer (a device sync on a GPU)."""
        if not isinstance(module, nn.Embedding) or a.dim() != 1:
            return False
        known = self._positions.get(id(module))
        if known is None:
            known = self._positions[id(module)] = positions_only(module, a)
        return known

    def _unattributed(self, module: nn.Module, a: torch.Tensor, output: torch.Tensor) -> None:
        self.invalid = True
        name = self._names.get(id(module), type(module).__name__)
        seen = f"{type(module).__name__} on input {tuple(a.shape)} -> {tuple(output.shape)}"
        if output.dim() > 1 and output.shape[1] == self.batch:
            why = ("examples along dim 1, not dim 0: a sequence-first layout, whose "
                   "positions would be taken for examples")
        else:
            why = ("its input has no batch dimension (positions such as wpe(torch.arange(T)) "
                   "broadcast over the batch), so its gradient arrives summed over the batch")
        self.unattributed.setdefault(name, f"{seen}: {why}")
        return None

    def _stash(self, module: nn.Module, a: torch.Tensor, output: torch.Tensor) -> None:
        """A linear layer with one example per row: example i's gradient is `d_i a_i^T` (and
        `d_i` for the bias), so `|g_i|^2 = (|a_i|^2 + 1) |d_i|^2` (the 1 for a trained bias).
        The forward keeps `|a_i|^2`, the backward `|d_i|^2` (computed where `d` is made, while
        it is in cache: keeping `d` for later costs more), and `measure` finishes every layer
        together."""
        own = module._parameters  # not getattr: a module's getattr of a parameter is slow
        weight, bias = own.get("weight"), own.get("bias")
        a_sq = row_sq(a) if weight is not None and weight.requires_grad else None
        grad_sq: list[torch.Tensor] = []
        self.rows.append((a_sq, bias is not None and bias.requires_grad, grad_sq))
        output.register_hook(partial(grad_row_sq, grad_sq))

    def _rows_preconditioned(self, module: nn.Module, a: torch.Tensor, d: torch.Tensor) -> None:
        """A backward hook of a linear layer with one example per row: its P-norms."""
        with torch.no_grad(), fp32(d.device.type):
            weight, bias = weight_p(module, self._p)
            self.pvalues.append(pnorm.rows_sq(a.float(), d.detach().float(), weight, bias))

    def _backward(self, module: nn.Module, saved: Any, grad: torch.Tensor) -> None:
        with torch.no_grad(), fp32(grad.device.type):
            if self._weights is not None and linear_like(module) and saved.dim() > 2:
                # Both norms from the same explicit per-example gradients.
                weight, bias = weight_p(module, self._p)
                plain, weighted = pnorm.linear_both(
                    saved.float().flatten(1, -2), grad.detach().float().flatten(1, -2),
                    trainable(module), weight, bias)
                self.values.append(plain)
                self.pvalues.append(weighted)
                return
            self.values.append(layer_sq(module, saved, grad.detach()))
            if self._weights is not None:
                self.pvalues.append(layer_psq(module, saved, grad.detach(), self._p))

    def _broadcast_preconditioned(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """The P-norms of a broadcast parameter from its expanded view's gradient (B, ...)."""
        if self._preconditioner_now() is not None:
            weight = self._p(p)
            if weight is not None:
                self.pvalues.append(pnorm.explicit_sq(grad, weight))

    def measure(self, examples: int) -> NormPair | None:
        """Eq. A.2's pair for b_small = 1 from this step's captures; None when it cannot be
        measured (no layer captured, or a step that had to be skipped)."""
        weights = self._preconditioner_now() if self.tied.uses else None
        if weights is not None:
            both = self.tied.totals(weights)
            if both is not None:
                self.values.append(both[0])
                self.pvalues.append(both[1])
        else:
            tied = self.tied.total()
            if tied is not None:
                self.values.append(tied)
        if self.invalid or self.attention.invalid or not (self.values or self.rows):
            return None
        # The rows' sum_i |a_i|^2 |d_i|^2 in one dot (and sum_i |d_i|^2 of their biases in one
        # sum), |G_big|^2's parameter gradients in one foreach norm, all in one transfer.
        sqs, grad_sqs, biases = [], [], []
        alike = True  # every layer here trains both its weight and its bias
        for a_sq, bias, grad_sq in self.rows:
            if not grad_sq:  # no gradient reached this layer's output: no contribution
                continue
            e = grad_sq[0] if len(grad_sq) == 1 else torch.stack(grad_sq).sum(0)
            if a_sq is not None:
                sqs.append(a_sq)
                grad_sqs.append(e)
            if bias:
                biases.append(e)
            alike = alike and bias and a_sq is not None
        if sqs:
            e = grad_sqs[0] if len(grad_sqs) == 1 else torch.cat(grad_sqs)
            self.values.append(torch.dot(sqs[0] if len(sqs) == 1 else torch.cat(sqs), e))
            if alike:  # the biases' sum_i |d_i|^2 is that of the same rows
                self.values.append(e.sum())
                biases = []
        if biases:
            self.values.append(torch.cat(biases).sum())
        big = [p.grad for p in self.params if p.grad is not None]
        kinds = {g.dtype for g in big}
        # fp32 norms of low-precision gradients (float64 ones stay float64).
        dtype = None if len(kinds) == 1 and torch.float32 in kinds else \
            torch.float64 if torch.float64 in kinds else torch.float32
        norms = torch._foreach_norm(big, 2, dtype=dtype) if big else ()
        values = torch.stack([*norms, *self.values]).tolist()
        # With a mean-reduced loss every captured gradient is 1/B of the example's own, so the
        # mean over examples of |g_i|^2 is B^2 / B times the sum captured.
        sq_big = math.fsum(v * v for v in values[:len(norms)])
        total = math.fsum(values[len(norms):])
        return NormPair(total * examples, sq_big, 1.0, float(examples))

    def measure_preconditioned(self, examples: int) -> NormPair | None:
        """Eq. A.2's pair for b_small = 1 in the P-norm (B_simple_P), from this step's
        P-norms and `G^T P G` of `.grad`; None where P was not known for the step, or the step
        could not be measured. (Call after `measure`.)"""
        weights = self._weights
        if weights is None or self.invalid or self.attention.invalid or not self.pvalues:
            return None
        grads = [p.grad.detach().reshape(-1).float() for p in self.params if p.grad is not None]
        weights_of = [weights[id(p)] for p in self.params if p.grad is not None]
        # G^T P G per parameter in three foreach ops: P g^2 >= 0, so its sum is its 1-norm.
        products = list(torch._foreach_mul(grads, grads)) if grads else []
        if products:
            torch._foreach_mul_(products, weights_of)
        big = list(torch._foreach_norm(products, 1)) if products else []
        values = torch.stack([*big, *self.pvalues]).double().tolist()
        sq_big = math.fsum(values[:len(big)])
        total = math.fsum(values[len(big):])
        return NormPair(total * examples, sq_big, 1.0, float(examples))


    splits = False

    def saw_forward(self, args: tuple, kwargs: dict, batch: int) -> None:
        """The model's forward starts, on a batch of `batch` examples (the monitor counts);
        its arguments are kept for the check of the embeddings looked up once for the whole
        batch, until it ran (`Lookups.probe`)."""
        self.forward_id += 1
        self.batch = batch
        self.coverage.saw_inputs(args, kwargs, batch)
        if not self.lookups.probed:
            self.lookups.inputs = (args, kwargs, batch)

    def verify(self, busy: AbstractContextManager[Any], loss_scale: float,
               grads_unscaled: bool) -> dict[int, str]:
        """The checks of `coverage` on this measured step, run inside `busy`
        (the layout check's extra forward is no step of training): a layer whose dim 0 is not
        the batch's joins `unattributed`; the parameters whose `.grad` the hooks do not
        account for are returned (id -> why), with calls the functional route could not take
        and broadcast parameters the model does not broadcast along the batch (their own
        reason first). Any of them discards the step's per-example pair."""
        uncovered: dict[int, str] = {}
        for key in self.lookups.shared:  # no batch dimension, known: not the layout's to judge
            self.coverage.first_dims.pop(key, None)
        if self.coverage.armed:
            with busy:
                wrong = self.coverage.layout()
            if wrong:
                for name, why in wrong.items():
                    self.unattributed.setdefault(name, why)
                self.invalid = True
            else:
                uncovered = self.coverage.check(loss_scale, 1.0 if grads_unscaled
                                                else loss_scale)
                self.invalid = self.invalid or bool(uncovered)
        self.refused.update(self.lookups.refused_parameters())
        if self.refused or self.broadcast.refused or self.attention.refused:
            uncovered.update(self.refused)
            uncovered.update(self.broadcast.refused)
            uncovered.update(self.attention.refused)
            self.invalid = True
        return uncovered

    def accumulate(self, examples_so_far: int) -> None:
        """Nothing: the hooks capture every micro-batch of the step as it runs."""

    def read(self, step: StepNorms) -> Reading:
        """The `Source` reading: this step's pair, unscaled; a step it had to skip (a layer
        used twice, a check that failed) while it measures parameters is incomplete."""
        if not step.plain:
            return Reading()
        part = self.measure(step.examples)
        if part is not None:
            pair = self.measure_preconditioned(step.examples)
            in_p = None if pair is None else [unscale(pair, step.small_scale, step.big_scale)]
            return Reading([unscale(part, step.small_scale, step.big_scale)], preconditioned=in_p)
        return Reading(complete=not self.params)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self, owner: Gate) -> Reading | None:
        self.coverage.disarm()
        return None

    @property
    def routes(self) -> str:
        """What is measured per example another way than by the layer formulas (one line, ""
        when nothing): layers of one's own, attention modules whole, broadcast parameters and
        embeddings looked up once for the whole batch, by name."""
        shared = sorted(self.lookups.embeddings[key][0] for key in self.lookups.shared)
        lookups = (f"looked up once for the batch, through their outputs expanded along it: "
                   f"{', '.join(shared)}") if shared else ""
        return "; ".join(part for part in (self._routes, lookups) if part)

    def describe(self) -> str:
        said = f"; {self.routes}" if self.routes else ""
        return f"per-example norms of {len(self.params)} parameters (b_small = 1){said}"


class Lookups:
    """The embeddings of a model looked up once for the whole batch (`shared`, ids), found
    once, when a measured forward first looks one up with a 1-d index
    (`positions.shared_lookups`): their outputs are expanded along the batch
    on measured steps; those the model does not broadcast over the examples are `refused`
    (id -> why), their weights left to micro-batches."""

    def __init__(self, model: nn.Module, embeddings: dict[int, tuple[str, nn.Module]]) -> None:
        self.model, self.embeddings = model, embeddings
        self.shared: set[int] = set()
        self.refused: dict[int, str] = {}
        self.probed = not embeddings
        self.inputs: tuple[tuple, dict, int] | None = None
        """The model's current call (arguments and batch), kept until the check ran."""
        self.known = False
        """The probe ran: an embedding not in `shared` has the batch along dim 0."""

    def probe(self) -> None:
        """Find them, from the model's current call (`inputs`), the first time an embedding is
        looked up with a 1-d index on a measured step (a model without one is never run
        again): the model is run inside its own forward, without gradients, where no hook
        of the monitor captures."""
        self.probed = True
        if self.inputs is None:
            return
        args, kwargs, batch = self.inputs
        self.inputs = None
        found = shared_lookups(self.model, self.embeddings, args, kwargs, batch)
        if found is not None:
            self.shared, self.refused = found
            self.known = True

    def refused_parameters(self) -> dict[int, str]:
        """Parameter id -> why, for the weights of the refused lookups."""
        return {id(p): why for key, why in self.refused.items()
                for p in self.embeddings[key][1].parameters(recurse=False) if p.requires_grad}


def read_functionally(model: nn.Module, measured: Collection[int] = ()) -> dict[int, str]:
    """Parameter id -> why, for the parameters of layers whose own forward never runs because
    their owner reads their parameters functionally: `nn.MultiheadAttention`'s `out_proj`
    (`F.multi_head_attention_forward` takes `out_proj.weight` and `.bias`), where the attention
    module is not measured whole (`measured`: the ids of those that are). Their hooks would
    never fire while their gradients count in `.grad`; `coverage` catches the
    cases not known here."""
    found: dict[int, str] = {}
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention) and id(module) not in measured:
            for p in module.out_proj.parameters(recurse=False):
                found[id(p)] = ("read by nn.MultiheadAttention's functional forward; its own "
                                "forward never runs")
    return found


def positions_only(module: nn.Module, a: torch.Tensor) -> bool:
    """Whether an embedding looks up consecutive indices with no batch dimension: positions
    `torch.arange(T)` (nanoGPT's `wpe`), shared by every example. Shapes alone cannot tell them
    from one index per example where T equals the batch size; a batch of labels that happen to
    be consecutive is taken for positions too, which only costs micro-batches (right for any
    model)."""
    if not isinstance(module, nn.Embedding) or a.dim() != 1 or a.numel() < 2:
        return False
    return bool((a[1:] - a[:-1] == 1).all())


def _sequence_first(module: nn.Module, a: torch.Tensor, output: torch.Tensor, batch: int
                    ) -> bool:
    """Whether a layer's call looks sequence-first, (T, B, ...) with T != B: a linear layer or a
    LayerNorm / RMSNorm over the last dimension of a 3-d or larger input, or an embedding of a
    2-d or larger index, whose input and output hold the batch's `batch` examples along dim 1
    and something else along dim 0 (PyTorch's transformer layers with batch_first=False).
    `Coverage.layout` checks once per batch size that dim 1 is the batch's."""
    if output.dim() < 3 or output.shape[1] != batch or output.shape[0] == batch:
        return False
    if a.dim() < 2 or a.shape[1] != batch or a.shape[0] != output.shape[0]:
        return False
    if isinstance(module, nn.Embedding):
        return True
    return a.dim() >= 3 and (linear_like(module) or isinstance(module, (nn.LayerNorm,
                                                                       nn.RMSNorm)))


def _unsupported(module: nn.Module) -> str | None:
    """Why per-example norms are not available for this module's own parameters, or None."""
    own = {name for name, _ in module.named_parameters(recurse=False)}
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.RMSNorm)
    if not isinstance(module, kinds) and not is_conv1d(module):
        return type(module).__name__
    if own_forward(module):
        return f"{type(module).__name__} computes its own forward"
    if not own <= {"weight", "bias"}:
        return "extra parameters"
    if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
        return "scale_grad_by_freq"
    if isinstance(module, nn.Embedding) and module.sparse:
        return "sparse gradients"
    return None


def _own_kind(module: nn.Module) -> bool:
    """A layer class of the user's or a library's own, not one of torch's (torch's own
    recurrent, attention and normalisation layers have their own rules)."""
    return not type(module).__module__.startswith("torch.")


def _first_hook(module: nn.Module, hook: Any) -> bool:
    """Whether `hook` is the first forward hook to see the module's output (no global forward
    hook, none registered before it on the module): only then may it hand back an output of a
    new graph, an earlier hook having perhaps hooked the original output's gradient."""
    if _global_forward_hooks:
        return False
    for first in module._forward_hooks.values():
        return bool(first == hook)
    return False
