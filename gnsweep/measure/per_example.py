"""Per-example gradient norms (b_small = 1) from forward/backward hooks on the layers that
allow them (`nn.Linear`, transformers' `Conv1D`, `nn.Conv1d`, `nn.Conv2d`, `nn.Embedding`,
`nn.LayerNorm`, `nn.RMSNorm`; parameters tied across such layers through
`gnsweep.measure.shared.Tied`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.module import _global_forward_hooks

from gnsweep.measure import attention as attention_route
from gnsweep.measure import weighted as pnorm
from gnsweep.measure.attention import Attention
from gnsweep.measure.broadcast import Broadcast, candidates
from gnsweep.measure.common import Gate, fp32, say_once, sq
from gnsweep.measure.coverage import Coverage
from gnsweep.measure.functional import functional_refusal, own_parameters, per_example_sq
from gnsweep.measure.positions import shared_lookups
from gnsweep.measure.shared import Tied, along_batch, is_conv1d, linear_like, own_forward
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
        -> why per-example norms are wrong for it (`gnsweep.measure.coverage`): its layer is
        left to micro-batches, said with that reason."""
        self.gate = gate
        self.weigh: Callable[[], dict[int, torch.Tensor] | None] | None = None
        """The optimizer's diagonal preconditioner P by parameter id (set by the monitor for
        an adaptive optimizer, `Preconditioned.precondition`), read once a measured step: the
        hooks then also sum the P-norms `sum_i |g_i|_P^2` (`gnsweep.measure.weighted`)."""
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
        # nn.MultiheadAttention whole, as one leaf (`gnsweep.measure.attention`): its
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
        """Layers measured by their own forward (`gnsweep.measure.functional`)."""
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
                    # gradients of its parameters by its own forward (`measure.functional`).
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
                                   self._broadcast_weighted)
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
        """The nn.MultiheadAttention modules measured whole (`gnsweep.measure.attention`)."""
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
        """Every hooked layer has P-norms (`gnsweep.measure.weighted`): not so for
        nn.MultiheadAttention measured whole, nor for parameters tied across layers larger
        than `shared.WEIGHED_NUMEL`."""
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
        P is known (`weigh`)."""
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
    def weighs(self) -> bool:
        """This source gives B_simple_P's P-norm pair itself, with no micro-batches: every
        measured parameter covered by layers with P-norms."""
        return self.weighable and self.complete

    def _weights_now(self) -> dict[int, torch.Tensor] | None:
        """P by parameter id for this measured step (read once a step), or None (no
        adaptive optimizer, or before its first update)."""
        if self.weigh is None or not self.weighs:
            return None
        if not self._weights_read:
            self._weights, self._weights_read = self.weigh(), True
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
            # Looked up once for the whole batch (`gnsweep.measure.positions`): the output
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
        weighing = self._weights_now() is not None
        if a.dim() == 2 and linear_like(module):
            if weighing:
                output.register_hook(partial(self._rows_weighted, module, a.detach()))
            self._stash(module, a.detach(), output)
            return output
        if isinstance(module, (nn.Conv1d, nn.Conv2d)) and not weighing and \
                _fusable(module, a, output) and _first_hook(module, self._forward):
            self.positional.add(type(module).__name__)
            return _ConvWeightByExamples.apply(a, module.weight, module.bias, output.detach(),
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
                if self._weights_now() is not None:
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
        a_sq = _row_sq(a) if weight is not None and weight.requires_grad else None
        grad_sq: list[torch.Tensor] = []
        self.rows.append((a_sq, bias is not None and bias.requires_grad, grad_sq))
        output.register_hook(partial(_grad_row_sq, grad_sq))

    def _rows_weighted(self, module: nn.Module, a: torch.Tensor, d: torch.Tensor) -> None:
        """A backward hook of a linear layer with one example per row: its P-norms."""
        with torch.no_grad(), fp32(d.device.type):
            weight, bias = _weight_p(module, self._p)
            self.pvalues.append(pnorm.rows_sq(a.float(), d.detach().float(), weight, bias))

    def _backward(self, module: nn.Module, saved: Any, grad: torch.Tensor) -> None:
        with torch.no_grad(), fp32(grad.device.type):
            if self._weights is not None and linear_like(module) and saved.dim() > 2:
                # Both norms from the same explicit per-example gradients.
                weight, bias = _weight_p(module, self._p)
                plain, weighted = pnorm.linear_both(
                    saved.float().flatten(1, -2), grad.detach().float().flatten(1, -2),
                    _trainable(module), weight, bias)
                self.values.append(plain)
                self.pvalues.append(weighted)
                return
            self.values.append(_per_example_sq(module, saved, grad.detach()))
            if self._weights is not None:
                self.pvalues.append(_per_example_psq(module, saved, grad.detach(), self._p))

    def _broadcast_weighted(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """The P-norms of a broadcast parameter from its expanded view's gradient (B, ...)."""
        if self._weights_now() is not None:
            weight = self._p(p)
            if weight is not None:
                self.pvalues.append(pnorm.explicit_sq(grad, weight))

    def measure(self, examples: int) -> NormPair | None:
        """Eq. A.2's pair for b_small = 1 from this step's captures; None when it cannot be
        measured (no layer captured, or a step that had to be skipped)."""
        weights = self._weights_now() if self.tied.uses else None
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

    def measure_weighted(self, examples: int) -> NormPair | None:
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
        """The checks of `gnsweep.measure.coverage` on this measured step, run inside `busy`
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
            pair = self.measure_weighted(step.examples)
            weighted = None if pair is None else [unscale(pair, step.small_scale,
                                                         step.big_scale)]
            return Reading([unscale(part, step.small_scale, step.big_scale)], weighted=weighted)
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
    (`gnsweep.measure.positions.shared_lookups`): their outputs are expanded along the batch
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
    never fire while their gradients count in `.grad`; `gnsweep.measure.coverage` catches the
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


def _row_sq(x: torch.Tensor) -> torch.Tensor:
    """`|x_i|^2` of each row, in fp32 (autocast would run `vecdot` in low precision)."""
    if x.dtype in _LOW:
        x = x.float()
    device = x.device.type
    if torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return torch.linalg.vecdot(x, x)
    return torch.linalg.vecdot(x, x)


def _grad_row_sq(into: list[torch.Tensor], d: torch.Tensor) -> None:
    """A backward hook: `|d_i|^2` of a linear layer's output gradient appended to `into`."""
    into.append(_row_sq(d.detach() if d.requires_grad else d))  # create_graph=True: no graph


_LOW = (torch.float16, torch.bfloat16)


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


def _trainable(module: nn.Module) -> tuple[bool, bool]:
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    return (weight is not None and weight.requires_grad,
            bias is not None and bias.requires_grad)


def _per_example_sq(module: nn.Module, saved: Any, d: torch.Tensor) -> torch.Tensor:
    """Sum over examples of this layer's `|g_i|^2`, `g_i` the gradient of the captured loss."""
    d = d.float()
    weight, bias = _trainable(module)
    if linear_like(module):  # Conv1D's transposed weight has the same per-example norms
        # (one example per row is `PerExample._stash`'s)
        return _linear_sq(saved.float().flatten(1, -2), d.flatten(1, -2), weight, bias)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return _conv_sq(module, saved.float(), d, weight, bias)
    if isinstance(module, nn.Embedding):
        return _embedding_sq(module, saved, d)
    assert isinstance(module, (nn.LayerNorm, nn.RMSNorm))
    return _norm_sq(module, saved.float(), d, weight, bias)


def _weight_p(module: nn.Module, p_of: Callable[[Any], torch.Tensor | None]
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """P of a linear-like layer's weight as (out, in) (transformers' Conv1D holds it
    transposed) and of its bias, each None where not trained."""
    own = module._parameters
    weight, bias = p_of(own.get("weight")), p_of(own.get("bias"))
    if weight is not None and is_conv1d(module):
        weight = weight.t()
    return weight, bias


def _per_example_psq(module: nn.Module, saved: Any, d: torch.Tensor,
                     p_of: Callable[[Any], torch.Tensor | None]) -> torch.Tensor:
    """Sum over examples of this layer's `|g_i|_P^2` (`gnsweep.measure.weighted`), P of each
    parameter by `p_of`."""
    d = d.float()
    own = module._parameters
    if linear_like(module):
        weight, bias = _weight_p(module, p_of)
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


def _norm_psq(module: nn.LayerNorm | nn.RMSNorm, x: torch.Tensor, d: torch.Tensor,
              weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """`_norm_sq` in the P-norm: the same explicit per-example gradients, weighted."""
    shape = tuple(module.normalized_shape)
    dims = tuple(range(1, d.dim() - len(shape)))
    total = d.new_zeros(())
    if weight is not None:
        ones = x.new_ones(shape)
        if isinstance(module, nn.LayerNorm):
            x_hat = F.layer_norm(x, shape, ones, None, module.eps)
        else:
            x_hat = F.rms_norm(x, shape, ones, module.eps)
        x_hat.mul_(d)
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
        ones = x.new_ones(shape)
        if isinstance(module, nn.LayerNorm):
            x_hat = F.layer_norm(x, shape, ones, None, module.eps)
        else:
            x_hat = F.rms_norm(x, shape, ones, module.eps)
        x_hat.mul_(d)
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


def _fusable(module: nn.Conv1d | nn.Conv2d, a: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether a measured step computes this conv's weight gradient as the sum of its explicit
    per-example gradients (`_ConvWeightByExamples`) instead of the backend's batch weight
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


def _first_hook(module: nn.Module, hook: Any) -> bool:
    """Whether `hook` is the first forward hook to see the module's output (no global forward
    hook, none registered before it on the module): only then may it hand back an output of a
    new graph, an earlier hook having perhaps hooked the original output's gradient."""
    if _global_forward_hooks:
        return False
    for first in module._forward_hooks.values():
        return bool(first == hook)
    return False


class _ConvWeightByExamples(torch.autograd.Function):
    """A conv's output on a measured step, whose backward computes the weight gradient once,
    as the sum over examples of the explicit per-example gradients `g_i`, with
    `sum_i |g_i|^2` (and the bias's) as a by-product appended to the owner's values; the input
    and bias gradients as the backend computes them. The forward hands back the output already
    computed (no second conv); the original output's graph is left unused. Under
    `create_graph=True` the backend's differentiable backward (the norms then from a second
    pass), so that second derivatives stay right."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                output: torch.Tensor, module: nn.Conv1d | nn.Conv2d, owner: PerExample
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
