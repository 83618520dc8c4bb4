"""Proof at run time that per-example hooks see each covered parameter's whole gradient.

Module hooks see only what runs through a layer's `forward`. A parameter also read outside it
(`nn.MultiheadAttention` reads `out_proj.weight` inside `F.multi_head_attention_forward`; an
embedding reused as the output layer, `x @ emb.weight.t()`), or a layer whose first dimension
is not the batch's although it has the batch's length (a sequence-first layer with T == B),
gives per-example norms that look right and are not: B_simple 0.3-0.7x of brute force. Two
checks catch them, on the first measured steps and from time to time (`Coverage.due`):

- the sum check: the batch gradient implied by what the hooks saw, each hooked layer's stock
  backward formula at the input it was given and the output gradient it received (for
  `nn.Linear`, `sum_i d_i a_i^T`; `implied_gradients`), against the parameter's `.grad`. A parameter
  whose `.grad` holds more than that is used where the hooks do not look (`Coverage.check`).
- the layout check: once per batch size, the model run again without gradients on half the
  batch: a hooked layer whose input had the batch's length along dim 0 and does not halve
  carries something else there (positions, or examples along dim 1) (`Coverage.layout`).

`NoiseScaleMonitor` discards a step that fails either, and measures the parameters concerned
another way (micro-batches) or refuses, naming them and the reason.
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
from gnsweep.measure.per_example.broadcast import first_examples
from gnsweep.measure.per_example.functional import per_example
from gnsweep.measure.per_example.tied import linear_like

CHECK_FIRST = 2
"""Measured steps checked at the start of a monitor's life (the first, and one more: a model
whose second step takes another path)."""
CHECK_EVERY = 64
"""Then one measured step in this many: a model whose path changes during training (a branch
taken late) is caught within this many measured steps."""
TOLERANCE = 1e-3
"""Most relative difference between the implied gradient and `.grad` in float32/float64
(summation order: about 1e-6 here; a use the hooks miss is a difference of order one)."""
TOLERANCE_LOW = 5e-2
"""The same where inputs or gradients were bfloat16/float16 (autocast): the hooks' tensors are
rounded to 8-11 bits while `.grad` accumulates in the parameter's precision."""
_LOW = (torch.float16, torch.bfloat16)


class Coverage:
    """The sum and layout checks of the layers a `PerExample` source hooks (`layers`) for its
    covered parameters (`params`). Its own hooks are registered only while a check is due
    (`arm`); `after_step` counts measured steps and arms or disarms them."""

    def __init__(self, gate: Gate, model: nn.Module, layers: list[tuple[str, nn.Module]],
                 params: list[nn.Parameter], functional: set[int] | None = None,
                 more: Callable[[], dict[int, torch.Tensor]] | None = None) -> None:
        """`functional`: the ids of the layers measured by their own forward; `more()`: the
        batch gradients implied by other captures (broadcast parameters' views), by id."""
        self.gate, self.model = gate, model
        self.layers = layers
        self.functional = functional or set()
        self.more = more
        self.params = params
        self.checked = {id(p) for p in params}
        self.names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        self.measured = 0
        """Measured steps seen so far (`after_step`)."""
        self.handles: list[Any] = []
        self.probed: set[int] = set()
        """Batch sizes whose layout was checked."""
        self.second: set[int] = set()
        """Layers whose examples were taken along dim 1 (sequence-first, T != B): the layout
        check holds their dim 1 to the batch."""
        self.reset()
        self.arm()

    def reset(self) -> None:
        self.implied: dict[int, torch.Tensor] = {}
        """Parameter id -> the batch gradient implied by what its layers' hooks saw."""
        self.low = False
        self.first_dims: dict[int, set[int]] = {}
        """Layer id -> the lengths of its inputs along dim 0 this step (a hook may expand an
        output over the batch: `tied.along_batch`)."""
        self.inputs: tuple[tuple, dict, int] | None = None
        """The model's first call of this step: its arguments and batch."""

    @property
    def due(self) -> bool:
        """The next measured step is checked."""
        return self.measured < CHECK_FIRST or self.measured % CHECK_EVERY == 0

    @property
    def armed(self) -> bool:
        return bool(self.handles)

    def arm(self) -> None:
        if self.handles or not self.layers:
            return
        self.handles = [module.register_forward_hook(self._forward, with_kwargs=True)
                        for _, module in self.layers]

    def disarm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def after_step(self, measured: bool) -> None:
        """A step ended (`measured`: it was a measured one): arm the hooks for the next measured
        step where it is due, else remove them (hooks cost even idle)."""
        self.reset()
        if measured:
            self.measured += 1
        if self.due:
            self.arm()
        else:
            self.disarm()

    def saw_inputs(self, args: tuple, kwargs: dict, batch: int) -> None:
        """The model's forward was called (the monitor's pre-hook): the first call of a checked
        step is the one the layout check runs again on half the batch."""
        if self.handles and self.inputs is None and self.gate.capturing:
            self.inputs = (args, kwargs, batch)

    def _forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not (self.gate.capturing and torch.is_grad_enabled()):
            return
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            self.first_dims.setdefault(id(module), set()).add(int(first.shape[0]))
        saved = tuple(_detached(a) for a in args)
        named = {k: _detached(v) for k, v in kwargs.items()}
        output.register_hook(partial(self._backward, module, saved, named))

    def _backward(self, module: nn.Module, args: tuple, kwargs: dict,
                  grad: torch.Tensor) -> None:
        a = args[0] if args else kwargs.get("input")
        if not isinstance(a, torch.Tensor):
            return
        if grad.dtype in _LOW or a.dtype in _LOW:
            self.low = True
        with torch.no_grad(), fp32(grad.device.type):
            implied = functional_gradients if id(module) in self.functional else \
                implied_gradients
            for p, g in implied(module, a, grad.detach()):
                if id(p) in self.checked:
                    known = self.implied.get(id(p))
                    self.implied[id(p)] = g if known is None else known + g

    def check(self, small: float = 1.0, big: float = 1.0) -> dict[int, str]:
        """Parameter id -> why (its name first) the hooks do not account for its `.grad` this
        step (empty when they do). `small`, `big`: the factors the hooks' and `.grad`'s
        gradients carry (a loss scale)."""
        grads = {id(p): (p.grad.detach().float() / big if p.grad is not None else None)
                 for p in self.params}
        total = math.sqrt(sum(float(torch.linalg.vector_norm(g)) ** 2
                              for g in grads.values() if g is not None))
        tolerance = TOLERANCE_LOW if self.low else TOLERANCE
        floor = 1e-6 * total  # a parameter whose gradient is this small moves no estimate
        failed: dict[int, str] = {}
        for p in self.params:
            grad, implied = grads[id(p)], self.implied.get(id(p))
            if implied is None and self.more is not None:
                implied = self.more().get(id(p))
            size = float(torch.linalg.vector_norm(grad)) if grad is not None else 0.0
            name = self.names.get(id(p), "a parameter")
            if implied is None:
                if size > floor:
                    failed[id(p)] = (f"{name}: its layer's forward did not run on this "
                                     "step, yet it has a gradient: it is read outside the "
                                     "layer (as nn.MultiheadAttention reads out_proj.weight "
                                     "in F.multi_head_attention_forward)")
                continue
            seen = implied.float() / small
            error = float(torch.linalg.vector_norm(seen - grad if grad is not None else seen))
            if error > tolerance * max(size, float(torch.linalg.vector_norm(seen))) and \
                    error > floor:
                failed[id(p)] = (f"{name}: what its layer's hooks saw differs from its .grad by "
                                f"{error / max(size, 1e-300):.0%}: it is also used outside the "
                                "layer's forward (a tied output layer such as "
                                "x @ emb.weight.t(), or a functional read), or .grad changed "
                                "between backward and monitor.step() (clipping)")
        return failed

    def layout(self) -> dict[str, str]:
        """Layer name -> why its dim 0 is not the batch's, for the hooked layers whose inputs
        had the batch's length along dim 0 on this step: the model run again (no gradients,
        the random state restored) on the first half of the batch. Once per batch size; empty
        where nothing is wrong or the model cannot be run on half its batch."""
        if self.inputs is None:
            return {}
        args, kwargs, batch = self.inputs
        if batch < 2 or batch in self.probed:
            return {}
        self.probed.add(batch)
        full = [(name, m) for name, m in self.layers if self.first_dims.get(id(m)) == {batch}]
        second = [(name, m) for name, m in self.layers if id(m) in self.second]
        if not full and not second:
            return {}
        half = batch // 2
        seen: dict[int, list[torch.Size]] = {}

        def record(module: nn.Module, inputs: tuple, output: Any) -> None:
            if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() > 0:
                seen.setdefault(id(module), []).append(inputs[0].shape)

        handles = [m.register_forward_hook(record) for _, m in (*full, *second)]
        devices = sorted({p.device.index or 0 for p in self.params if p.device.type == "cuda"})
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                self.model(*first_examples(args, batch, half),
                           **first_examples(kwargs, batch, half))
        except Exception:  # a model that cannot run on half its batch: no verdict
            return {}
        finally:
            for handle in handles:
                handle.remove()
        wrong: dict[str, str] = {}
        for name, module in second:
            shapes = seen.get(id(module))
            if not shapes or all(len(s) > 1 and s[1] == half for s in shapes):
                continue
            shape = next(s for s in shapes if len(s) < 2 or s[1] != half)
            wrong[name] = (f"input {tuple(shape)} on half the batch: its dim 1 was taken for "
                           "the examples (a sequence-first layout) and does not follow the "
                           "batch")
        for name, module in full:
            shapes = seen.get(id(module))
            if not shapes or all(s[0] == half for s in shapes):
                continue
            shape = next(s for s in shapes if s[0] != half)
            if len(shape) > 1 and shape[1] == half:
                why = (f"examples along dim 1, input {tuple(shape)} on half the batch: a "
                       "sequence-first layout with as many positions as examples, whose "
                       "positions were taken for examples")
            else:
                why = (f"input {tuple(shape)} on half the batch: it has no batch dimension "
                       "(shared by every example) but as many rows as examples")
            wrong[name] = why
        return wrong


def implied_gradients(module: nn.Module, a: torch.Tensor, d: torch.Tensor
                      ) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """The gradients of a layer's trained parameters implied by one call: its input `a` and the
    gradient `d` its output received, by the stock backward formulas (no autograd: a nested
    backward would fire the parameters' own hooks). `nn.Linear` / `Conv1D`: `d^T a` and
    `sum d` over every row; convolutions: the backend's weight gradient; `nn.Embedding`: the
    rows of `d` added at their indices; `nn.LayerNorm` / `nn.RMSNorm`: `sum d * x_hat` and
    `sum d`. Other layers: none (their parameters then count as unseen;
    `functional_gradients` for the layers measured by their own forward)."""
    own = module._parameters
    weight, bias = own.get("weight"), own.get("bias")
    weight = weight if weight is not None and weight.requires_grad else None
    bias = bias if bias is not None and bias.requires_grad else None
    found: list[tuple[nn.Parameter, torch.Tensor]] = []
    d = d.float()
    if linear_like(module):
        x, g = a.float().reshape(-1, a.shape[-1]), d.reshape(-1, d.shape[-1])
        if weight is not None:
            found.append((weight, g.t() @ x if isinstance(module, nn.Linear) else x.t() @ g))
        if bias is not None:
            found.append((bias, g.sum(0)))
    elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
        x = a.float()
        if x.dim() == len(module.kernel_size) + 1:  # one unbatched example
            x, d = x.unsqueeze(0), d.unsqueeze(0)
        padding: Any = module.padding
        if module.padding_mode != "zeros" or isinstance(padding, str):
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
            padding = [0] * len(module.kernel_size)
        _, dw, db = torch.ops.aten.convolution_backward(
            d, x, module.weight.float(), [module.out_channels] if bias is not None else None,
            module.stride, padding, module.dilation, False, [0] * len(module.kernel_size),
            module.groups, [False, weight is not None, bias is not None])
        if weight is not None:
            found.append((weight, dw))
        if bias is not None:
            found.append((bias, db))
    elif isinstance(module, nn.Embedding) and weight is not None:
        if d.shape[:-1] != a.shape:  # an output expanded over the batch by an earlier hook
            d = d.sum_to_size(*a.shape, d.shape[-1])
        index = a.reshape(-1)
        rows = d.reshape(index.numel(), -1)
        if module.padding_idx is not None:
            rows = rows * (index != module.padding_idx).unsqueeze(-1)
        found.append((weight, rows.new_zeros(weight.shape).index_add_(0, index, rows)))
    elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        shape = tuple(module.normalized_shape)
        x = a.float()
        if isinstance(module, nn.LayerNorm):
            x_hat = F.layer_norm(x, shape, None, None, module.eps)
        else:
            x_hat = F.rms_norm(x, shape, None, module.eps)
        if weight is not None:
            found.append((weight, (d * x_hat).reshape(-1, *shape).sum(0)))
        if bias is not None:
            found.append((bias, d.reshape(-1, *shape).sum(0)))
    return found


def functional_gradients(module: nn.Module, a: torch.Tensor, d: torch.Tensor
                         ) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """`implied_gradients` of a layer measured by its own forward (`functional`): the
    sum of its examples' gradients; none where that fails (its parameters then count as
    unseen)."""
    try:
        return per_example(module, a, d, summed=True)[1]
    except Exception:
        return []


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value
