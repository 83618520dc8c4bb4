"""Squared gradient norms from a live model, fed to the pure estimators in `gnsweep.noise`.

Three sources of the pair `(|G_small|^2, |G_big|^2)` of eq. A.2, all at the parameters of the
current step and all unbiased for the same `|G|^2` and `tr(Sigma)`:

- `per_example` (b_small = 1): per-example gradient norms from each layer's input activations and
  output gradients, captured by hooks during the ordinary backward pass (`nn.Linear`,
  `nn.Conv2d`, `nn.Embedding`, `nn.LayerNorm`, `nn.RMSNorm`; sequences through the Gram form).
  Parameters of other layers fall back to micro-batches (the two parts are summed, see
  `gnsweep.noise.combine_parts`).
- `microbatch` (b_small = B / k): the batch back-propagated as k micro-batches, as in gradient
  accumulation; `accumulate()` after each records the micro-batch's own gradient.
- `ddp` (b_small = per-worker batch, b_big = global batch): a DistributedDataParallel
  communication hook reads each worker's gradient before the all-reduce; one extra scalar
  all-reduce per measured step, overlapped with the next step (so the estimate `step()` returns
  lags one measured step; `close()` folds the last one in).

B_noise (eq. 2.8) uses Hessian-vector products (double backward) every `hessian_every` steps:
see `hessian_norms`.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.noise import NoiseEstimate, NoiseScaleEma

METHODS = ("per_example", "microbatch", "ddp")
log = logging.getLogger("gnsweep.measure")

LossFn = Callable[[Any, Any], torch.Tensor]
Batch = tuple[Any, Any]


class NoiseScaleMonitor:
    """Measures B_simple (eq. 2.9) and optionally B_noise (eq. 2.8) inside a training loop.

    Per step: forward, `loss.backward()` on the batch-mean loss, `monitor.step()`, then
    `optimizer.step()`. With gradient accumulation (and for `method="microbatch"`), scale each
    micro-batch's loss so that `.grad` ends up holding the batch mean and call
    `monitor.accumulate()` after each micro-batch's backward. `.grad` must start each step at
    zero (`optimizer.zero_grad()`); call `step()` before clipping or rescaling gradients.

    `every`: measure every n steps (hooks idle in between). `ema_steps` > 0 sets the EMA time
    constant in steps, else `ema_examples` in examples (`math.inf`: plain mean, for estimates at
    fixed parameters). `hessian_every` > 0 (with `loss_fn`) measures B_noise every n steps when
    `step(batch=(inputs, targets))` is given the step's batch, with `hessian_microbatches`
    gradients per measurement (see `hessian_norms`).
    """

    def __init__(self, model: nn.Module, method: str = "per_example", *, every: int = 1,
                 ema_steps: float = 0.0, ema_examples: float = 2048.0,
                 loss_fn: LossFn | None = None, hessian_every: int = 0,
                 hessian_microbatches: int = 2) -> None:
        if method not in METHODS:
            raise ValueError(f"method={method!r}: choose one of {', '.join(METHODS)}")
        if every < 1 or hessian_every < 0 or hessian_microbatches < 2:
            raise ValueError("need every >= 1, hessian_every >= 0 and hessian_microbatches >= 2")
        if hessian_every and loss_fn is None:
            raise ValueError("hessian_every > 0 needs loss_fn(outputs, targets) for B_noise")
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters: nothing to measure")
        self.every, self.hessian_every = every, hessian_every
        self.hessian_microbatches = hessian_microbatches
        self.loss_fn = loss_fn
        self.ema = NoiseScaleEma(ema_steps=ema_steps, ema_examples=ema_examples)
        self.steps = 0
        self.estimate: NoiseEstimate | None = None
        self._busy = False
        self._warned: set[str] = set()
        self._examples = 0
        self._since_examples, self._since_steps = 0, 0
        self._handles: list[Any] = []
        self._ddp: _DdpHook | None = None
        self._per_example: _PerExample | None = None
        self._increments: _Increments | None = None
        # The module the Hessian passes run on: never through DDP's reducer.
        self.module: nn.Module = cast(nn.Module, model.module) if _is_ddp(model) else model
        if method == "ddp":
            method = self._setup_ddp(model)
        elif _is_ddp(model) and _world_size(model) > 1:
            # .grad is all-reduced while per-example / micro-batch norms stay local.
            raise ValueError(f"method={method!r} with a DistributedDataParallel model: use "
                             "method='ddp'")
        self.method = method
        self._handles.append(
            model.register_forward_pre_hook(self._count_examples, with_kwargs=True))
        if method == "microbatch":
            self._increments = _Increments(self.params)
        elif method == "per_example":
            self._per_example = _PerExample(self, self.module)
            self._handles += self._per_example.handles
            rest = [p for p in self.params if id(p) not in self._per_example.covered]
            if rest:
                self._increments = _Increments(rest)

    def _setup_ddp(self, model: nn.Module) -> str:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("method='ddp' needs an initialised torch.distributed process group "
                             "(run under torchrun and call init_process_group first)")
        if not _is_ddp(model):
            raise ValueError("method='ddp' needs the DistributedDataParallel-wrapped model: "
                             "NoiseScaleMonitor(DistributedDataParallel(model), method='ddp')")
        if dist.get_world_size() < 2:
            log.warning("noise scale: world size 1 gives one batch size only; measuring with "
                        "per-example gradient norms instead of the DDP hook")
            return "per_example"
        self._ddp = _DdpHook.attach(self, model)
        return "ddp"

    # -- the training-loop API ------------------------------------------------------------

    @property
    def measuring(self) -> bool:
        """Whether the current step (the one before the next `step()`) is measured."""
        return self.steps % self.every == 0

    @property
    def needs_microbatches(self) -> bool:
        """True when the batch must be back-propagated in micro-batches with `accumulate()`
        after each: method microbatch, or per_example with layers it cannot handle."""
        return self._increments is not None

    @property
    def b_simple(self) -> float:
        return self.estimate.b_simple if self.estimate is not None else math.nan

    @property
    def b_noise(self) -> float:
        return self.estimate.b_noise if self.estimate is not None else math.nan

    def accumulate(self) -> None:
        """Record the micro-batch just back-propagated (call after each micro-batch's backward)."""
        if self._increments is not None and self.measuring and not self._busy:
            self._increments.accumulate(self._examples)

    @torch.no_grad()
    def step(self, batch: Batch | None = None) -> NoiseEstimate | None:
        """Fold this step's measurement in; call after backward, before `optimizer.step()`.

        `batch=(inputs, targets)` (the step's batch) lets a due Hessian measurement run. Returns
        the current estimate (None before the first measurement).
        """
        measuring = self.measuring
        self.steps += 1
        self._since_examples += self._examples
        self._since_steps += 1
        hessian = bool(self.hessian_every and (self.steps - 1) % self.hessian_every == 0)
        try:
            if measuring or hessian:
                self._measure(batch, plain=measuring, hessian=hessian)
        finally:
            self._examples = 0
            if self._per_example is not None:
                self._per_example.reset()
            if self._increments is not None:
                self._increments.reset()
            if self._ddp is not None:
                self._ddp.reset()
        return self.estimate

    def close(self) -> None:
        """Remove the hooks (DDP's communication hook stays, all-reducing without measuring)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._ddp is not None and self._ddp.monitor is self:
            self._fold(*self._ddp.collect())  # the last measurement's all-reduce
            self._ddp.monitor = None

    def __enter__(self) -> NoiseScaleMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _active(self) -> bool:
        return self.measuring and not self._busy and torch.is_grad_enabled()

    def _count_examples(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._busy or not torch.is_grad_enabled():
            return
        first = _first_tensor(args) if args else None
        if first is None:
            first = _first_tensor(tuple(kwargs.values()))
        if first is not None and first.dim() > 0:
            self._examples += int(first.shape[0])
        if self._per_example is not None:
            self._per_example.forward_id += 1

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _measure(self, batch: Batch | None, *, plain: bool, hessian: bool) -> None:
        hess = None
        if hessian:
            if batch is None:
                self._warn_once("hbatch", "noise scale: B_noise needs the step's batch: call "
                                "monitor.step(batch=(inputs, targets))")
            else:
                assert self.loss_fn is not None
                with _busy(self):
                    hess = hessian_norms(self.module, self.loss_fn, batch,
                                         self.hessian_microbatches)
                if hess is None:
                    self._warn_once("hsmall", "noise scale: batch too small to split for B_noise "
                                    f"(needs >= {2 * self.hessian_microbatches} examples)")
        parts: list[tuple[float, float, float, float]] = []
        if self._ddp is not None:
            parts, hess = self._ddp.measure(hess)
        elif plain and self._per_example is not None:
            part = self._per_example.measure(self._examples)
            if part is not None:
                parts.append(part)
        if self._increments is not None and plain:
            part = self._increments.measure(self.method == "microbatch")
            if part is not None:
                parts.append(part)
            elif self.method == "per_example":
                self._warn_once("fallback", "noise scale: layers without per-example norms "
                                "need micro-batches and monitor.accumulate(); this estimate "
                                "leaves their parameters out")
        self._fold(parts, hess)

    def _fold(self, parts: list[tuple[float, float, float, float]],
              hess: tuple[float, float, float, float] | None) -> None:
        valid = [p for p in parts if all(map(math.isfinite, p)) and 0 < p[2] < p[3]]
        if len(valid) < len(parts):
            self._warn_once("skip", "noise scale: a measurement had one batch size only or "
                            "non-finite norms; skipped (a batch of one example?)")
        elif parts:
            self.estimate = self.ema.update_parts(parts, examples=self._since_examples,
                                                  steps=self._since_steps)
            self._since_examples, self._since_steps = 0, 0
        if hess is not None and all(map(math.isfinite, hess)):
            estimate = self.ema.update_hessian(*hess)
            if estimate is not None:
                self.estimate = estimate


# -- per-example norms -----------------------------------------------------------------------


class _PerExample:
    """Sum over examples of `|g_i|^2` for the covered parameters, from forward/backward hooks.

    For a layer `y = W a + b` the gradient of example i is `sum_t d_it a_it^T` (t over positions
    of a sequence or an image), so `|g_i|^2 = sum_{t,s} (a_it.a_is)(d_it.d_is)` (the Gram form,
    `|a_i|^2 |d_i|^2` without positions) plus `|sum_t d_it|^2` for the bias; whichever of the
    Gram form or the explicit per-example gradient is cheaper is used. Nothing of parameter size
    is materialised per example unless that is cheaper.
    """

    def __init__(self, monitor: NoiseScaleMonitor, model: nn.Module) -> None:
        self.monitor = monitor
        self.forward_id = 0
        self.reset()
        self.covered: set[int] = set()
        self.handles: list[Any] = []
        self._last_forward: dict[int, int] = {}
        owners = Counter(id(p) for m in model.modules()
                         for p in m.parameters(recurse=False))
        skipped: list[str] = []
        for name, module in model.named_modules():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not params:
                continue
            reason = _unsupported(module)
            if reason is None and any(owners[id(p)] > 1 for p in params):
                reason = "parameters shared with another layer"
            if reason is not None:
                skipped.append(f"{name or type(module).__name__} ({reason})")
                continue
            self.covered.update(id(p) for p in params)
            self.handles.append(module.register_forward_hook(self._forward))
        if skipped:
            log.warning("noise scale: no per-example norms for %s; their parameters are measured "
                        "with micro-batches", ", ".join(skipped))
        self.params = [p for p in monitor.params if id(p) in self.covered]

    def reset(self) -> None:
        self.values: list[torch.Tensor] = []
        self.invalid = False

    def _forward(self, module: nn.Module, inputs: tuple, output: Any) -> None:
        if not self.monitor._active() or not isinstance(output, torch.Tensor):
            return
        if not output.requires_grad or not inputs or not isinstance(inputs[0], torch.Tensor):
            return
        if self._last_forward.get(id(module)) == self.forward_id:
            # Used twice in one forward: per-use norms would miss the cross terms.
            self.invalid = True
            self.monitor._warn_once(f"reuse{id(module)}", f"noise scale: {type(module).__name__}"
                                    " is called more than once per forward; per-example norms "
                                    "skip such steps")
            return
        self._last_forward[id(module)] = self.forward_id
        saved = _save_input(module, inputs[0].detach())
        if isinstance(module, nn.Linear) and saved.dim() == 1:
            # The common case, kept to two small ops: (|a_i|^2 + 1) . |d_i|^2.
            output.register_hook(lambda d: self.values.append(
                torch.dot(saved, torch.linalg.vecdot(d.detach().float(), d.detach().float()))))
        else:
            output.register_hook(lambda grad: self._backward(module, saved, grad))

    def _backward(self, module: nn.Module, saved: Any, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self.values.append(_per_example_sq(module, saved, grad.detach()))

    def measure(self, examples: int) -> tuple[float, float, float, float] | None:
        if not self.values or self.invalid:
            return None
        # With a mean-reduced loss every captured gradient is 1/B of the example's own, so the
        # mean over examples of |g_i|^2 is B^2 / B times the sum captured.
        total = torch.stack(self.values).sum().double().reshape(1)
        values = torch.cat([total, _sq_norm(self.params).reshape(1)]).tolist()
        return values[0] * examples, values[1], 1.0, float(examples)


def _unsupported(module: nn.Module) -> str | None:
    """Why per-example norms are not available for this module's own parameters, or None."""
    own = {name for name, _ in module.named_parameters(recurse=False)}
    kinds = (nn.Linear, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.RMSNorm)
    if not isinstance(module, kinds):
        return type(module).__name__
    if not own <= {"weight", "bias"}:
        return "extra parameters"
    if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
        return "scale_grad_by_freq"
    if isinstance(module, nn.Embedding) and module.sparse:
        return "sparse gradients"
    return None


def _save_input(module: nn.Module, a: torch.Tensor) -> Any:
    if isinstance(module, nn.Linear) and a.dim() == 2:
        # Keep |a_i|^2 (+ 1 for the bias), not the activation: |g_i|^2 = (|a_i|^2 + 1) |d_i|^2.
        weight, bias = _trainable(module)
        a = a.float()
        sq = torch.linalg.vecdot(a, a) if weight else a.new_zeros(a.shape[0])
        return sq + 1.0 if bias else sq
    return a


def _trainable(module: nn.Module) -> tuple[bool, bool]:
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    return (weight is not None and weight.requires_grad,
            bias is not None and bias.requires_grad)


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares, without a squared copy."""
    return torch.linalg.vector_norm(t).square()


def _per_example_sq(module: nn.Module, saved: Any, d: torch.Tensor) -> torch.Tensor:
    """Sum over examples of this layer's `|g_i|^2`, `g_i` the gradient of the captured loss."""
    d = d.float()
    weight, bias = _trainable(module)
    if isinstance(module, nn.Linear):
        if d.dim() == 2:
            return torch.dot(saved, torch.linalg.vecdot(d, d))
        a = saved.float().flatten(1, -2)
        d = d.flatten(1, -2)
        out = _weight_sq(a, d) if weight else d.new_zeros(())
        return out + _sq(d.sum(1)) if bias else out
    if isinstance(module, nn.Conv2d):
        return _conv_sq(module, saved.float(), d, weight, bias)
    if isinstance(module, nn.Embedding):
        index = saved.reshape(saved.shape[0], -1)
        d = d.reshape(index.shape[0], index.shape[1], -1)
        if module.padding_idx is not None:
            d = d * (index != module.padding_idx).unsqueeze(-1)
        if index.shape[1] == 1:
            return _sq(d)
        same = index.unsqueeze(2) == index.unsqueeze(1)
        return (torch.bmm(d, d.transpose(1, 2)) * same).sum()
    # LayerNorm / RMSNorm: per-example gradient of the scale is sum over positions of d * x_hat.
    assert isinstance(module, (nn.LayerNorm, nn.RMSNorm))
    shape = tuple(module.normalized_shape)
    x = saved.float()
    if isinstance(module, nn.LayerNorm):
        x_hat = F.layer_norm(x, shape, None, None, module.eps)
    else:
        x_hat = F.rms_norm(x, shape, None, module.eps)
    dims = tuple(range(1, d.dim() - len(shape)))
    out = d.new_zeros(())
    if weight:
        out = out + _sq((d * x_hat).sum(dims) if dims else d * x_hat)
    if bias:
        out = out + _sq(d.sum(dims) if dims else d)
    return out


def _weight_sq(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """`sum_i |sum_t d_it a_it^T|^2` for a (B, T, I), d (B, T, O): Gram form or explicit."""
    t, i, o = a.shape[1], a.shape[2], d.shape[2]
    if t * (i + o) < i * o:
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))).sum()
    return _sq(torch.bmm(d.transpose(1, 2), a))


def _patches(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """`F.unfold` of the conv's input, (B, C*kh*kw, L), as one strided copy (unfold loops over
    the batch on the CPU)."""
    padding: Any = module.padding
    if module.padding_mode != "zeros" or isinstance(padding, str):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
    else:
        return F.unfold(x, module.kernel_size, dilation=module.dilation, padding=padding,
                        stride=module.stride)
    n, c, h, w = x.shape
    (kh, kw), (dh, dw), (sh, sw) = module.kernel_size, module.dilation, module.stride
    ho, wo = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    s_n, s_c, s_h, s_w = x.stride()
    view = x.as_strided((n, c, kh, kw, ho, wo), (s_n, s_c, dh * s_h, dw * s_w, sh * s_h, sw * s_w))
    return view.reshape(n, c * kh * kw, ho * wo)


def _conv_sq(module: nn.Conv2d, x: torch.Tensor, d: torch.Tensor, weight: bool, bias: bool
             ) -> torch.Tensor:
    n, groups = x.shape[0], module.groups
    d = d.reshape(n, d.shape[1], -1)  # (B, out, L)
    out = _sq(d.sum(2)) if bias else d.new_zeros(())
    if not weight:
        return out
    a = _patches(module, x)  # (B, C*kh*kw, L)
    a = a.reshape(n, groups, -1, a.shape[-1]).transpose(2, 3).flatten(0, 1)  # (B*g, L, Cg*k)
    dg = d.reshape(n, groups, -1, d.shape[-1]).transpose(2, 3).flatten(0, 1)  # (B*g, L, Og)
    return out + _weight_sq(a, dg)


# -- micro-batches ---------------------------------------------------------------------------


class _Increments:
    """Each micro-batch's own gradient, as the increment of `.grad` since the previous one.

    The gradients are flattened into one vector per call: a few ops whatever the number of
    parameters (`foreach` ops run per tensor on the CPU).
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.reset()

    def reset(self) -> None:
        self.previous: torch.Tensor | None = None
        self.sq: list[torch.Tensor] = []
        self.counts: list[int] = []
        self._seen = 0

    def accumulate(self, examples_so_far: int) -> None:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params]).detach()
        increment = flat if self.previous is None else flat - self.previous
        self.sq.append(torch.dot(increment, increment))
        self.previous = flat
        self.counts.append(examples_so_far - self._seen)
        self._seen = examples_so_far

    def measure(self, required: bool) -> tuple[float, float, float, float] | None:
        k = len(self.counts)
        if k < 2:
            if required:
                raise ValueError(
                    "method='microbatch' needs >= 2 micro-batches per measured step, each "
                    "followed by monitor.accumulate(); a batch of one example cannot be split")
            return None
        big = sum(self.counts)
        if min(self.counts) < 1:
            raise ValueError("monitor.accumulate() was called without a forward pass of the "
                             "model since the last call: no examples to attribute")
        assert self.previous is not None
        # After the last accumulate() the flat vector is the batch-mean gradient: |G_big|^2.
        values = torch.stack([*self.sq, torch.dot(self.previous, self.previous)]).tolist()
        # .grad holds the batch mean: micro-batch j's own gradient is (B / n_j) x its increment;
        # E|g_j|^2 = |G|^2 + tr(Sigma)/n_j, so the mean over j has b_small = 1 / mean(1/n_j).
        sq_small = sum((big / n) ** 2 * s for n, s in zip(self.counts, values, strict=False)) / k
        b_small = k / sum(1.0 / n for n in self.counts)
        return sq_small, values[-1], b_small, float(big)


# -- DistributedDataParallel communication hook --------------------------------------------


class _DdpHook:
    """Reads each worker's gradient in DDP's buckets before the all-reduce.

    With a registered hook DDP no longer divides by the world size: the hook does. Buckets are
    rebuilt after the first step; summing squared norms over whatever buckets pass through is
    indifferent to that.
    """

    def __init__(self, model: nn.Module) -> None:
        import torch.distributed as dist

        self.monitor: NoiseScaleMonitor | None = None
        self.group = getattr(model, "process_group", None)
        self.world = dist.get_world_size(self.group)
        self.local_sq: torch.Tensor | None = None
        self.pending: tuple[Any, torch.Tensor] | None = None
        try:
            # A lambda: DDP rejects hooks whose (postponed, string) annotations it cannot match.
            cast(Any, model).register_comm_hook(None, lambda state, bucket: self._hook(state,
                                                                                    bucket))
        except RuntimeError as err:
            raise ValueError("method='ddp': this DistributedDataParallel model already has a "
                             "communication hook of its own; DDP allows one") from err

    @classmethod
    def attach(cls, monitor: NoiseScaleMonitor, model: nn.Module) -> _DdpHook:
        """DDP takes one hook per model, for good: later monitors reuse it."""
        hook = getattr(model, "_gnsweep_comm_hook", None)
        if hook is None:
            hook = cls(model)
            model._gnsweep_comm_hook = hook  # type: ignore[assignment]
        hook.collect()  # a previous monitor's last all-reduce, if it was never closed
        hook.monitor = monitor
        hook.reset()
        return hook

    def reset(self) -> None:
        self.local_sq = None

    def _hook(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        import torch.distributed as dist

        buffer = bucket.buffer()
        monitor = self.monitor
        if monitor is not None and monitor.measuring and not monitor._busy:
            sq = _sq(buffer.float())
            self.local_sq = sq if self.local_sq is None else self.local_sq + sq
        buffer.div_(self.world)
        future = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
        return future.then(lambda fut: fut.value()[0])

    def measure(self, hess: tuple[float, float, float, float] | None
                ) -> tuple[list[tuple[float, float, float, float]],
                           tuple[float, float, float, float] | None]:
        """Start this step's one scalar all-reduce (worker norms, example counts, Hessian
        norms) and return the previous one's result: the reduction overlaps the next step."""
        import torch.distributed as dist

        done = self.collect()
        assert self.monitor is not None
        params = self.monitor.params
        local = self.local_sq if self.local_sq is not None else params[0].new_zeros(())
        h_small, h_big, hb_small, hb_big = hess if hess is not None else (0.0, 0.0, 0.0, 0.0)
        scalars = [float(self.monitor._examples), float(self.local_sq is not None),
                   h_small, h_big, hb_small, hb_big, float(hess is not None)]
        # |G_big|^2 is the same on every worker (after the all-reduce): it rides along.
        pack = torch.cat([local.double().reshape(1), _sq_norm(params).to(local.device).reshape(1),
                          torch.tensor(scalars, dtype=torch.float64, device=local.device)])
        work = dist.all_reduce(pack, group=self.group, async_op=True)
        self.pending = (work, pack)
        return done

    def collect(self) -> tuple[list[tuple[float, float, float, float]],
                               tuple[float, float, float, float] | None]:
        """Wait for the pending all-reduce, if any; its (parts, Hessian norms)."""
        if self.pending is None:
            return [], None
        work, pack = self.pending
        self.pending = None
        work.wait()
        w = float(self.world)
        sq_small, sq_big, examples, have, *hessian, have_hessian = (v / w for v in pack.tolist())
        parts = [(sq_small, sq_big, examples, examples * w)] if have == 1 else []
        # Every worker measured the same batch pair: their H-norms are averaged.
        return parts, (tuple(hessian) if have_hessian == 1 else None)  # type: ignore[return-value]


# -- Hessian-vector products -----------------------------------------------------------------


def hessian_norms(module: nn.Module, loss_fn: LossFn, batch: Batch, microbatches: int = 2
                  ) -> tuple[float, float, float, float] | None:
    """H-norms of micro-batch gradients for B_noise (eq. 2.8 through eq. A.2), at the module's
    current parameters. Returns `(|G_small|_H^2, |G_big|_H^2, b_small, b_big)`, or None when the
    batch is too small to split.

    The batch is cut in two: k micro-batches of one part give gradients `g_j` (b_small examples
    each) and their mean `G_big` (b_big = k b_small examples); the other part's loss gives the
    Hessian `H_Q` through double backward. Because `H_Q` is independent of the `g_j` and
    `E H_Q = H`, `E[g^T H_Q g] = E[g^T H g]`; taking H from the same examples as g would bias
    tr(H Sigma) by terms of order 1/B. `H_Q G_big = mean_j H_Q g_j`, so k products suffice.
    """
    inputs, targets = batch
    n = _batch_len(inputs)
    size = n // (2 * microbatches)
    if size < 1:
        return None
    params = [p for p in module.parameters() if p.requires_grad]
    split = size * microbatches
    grads = []
    for j in range(microbatches):
        index = slice(j * size, (j + 1) * size)
        loss = _loss(module, loss_fn, _take(inputs, index), _take(targets, index))
        grads.append(_grad(loss, params, create_graph=False))
    rest = slice(split, n)
    with torch.enable_grad():
        loss = _loss(module, loss_fn, _take(inputs, rest), _take(targets, rest))
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
    return sum(values[:-1]) / microbatches, values[-1], float(size), float(split)


def _loss(module: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any) -> torch.Tensor:
    with torch.enable_grad():
        outputs = module(*inputs) if isinstance(inputs, (tuple, list)) else module(inputs)
        loss = loss_fn(outputs, targets)
    _check_scalar(loss)
    return loss


def _grad(loss: torch.Tensor, params: list[nn.Parameter], *, create_graph: bool
          ) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, params, create_graph=create_graph, allow_unused=True)
    return [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params,
                                                                       strict=True)]


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(x.double() * y.double()).sum() for x, y in zip(a, b, strict=True)]
                       ).sum()


# -- one-shot measurement at fixed parameters ------------------------------------------------


def measure_noise_scale(model: nn.Module, loss_fn: LossFn, batches: Iterable[Batch],
                        method: str = "per_example", hessian: bool = False, *,
                        microbatches: int = 4, hessian_microbatches: int = 2) -> NoiseEstimate:
    """B_simple (eq. 2.9), and with `hessian=True` B_noise (eq. 2.8), at the model's current
    parameters: no optimizer step is taken and `.grad` is left as it was.

    `loss_fn(outputs, targets)` returns the batch-mean loss; `batches` yields `(inputs, targets)`
    (inputs a tensor, or a tuple of tensors passed as `model(*inputs)`). The squared norms of
    all batches are pooled with equal weights (eq. A.2 on the means), so the estimate sharpens
    with more batches. `microbatches`: the split for method="microbatch" (and for layers without
    per-example norms).
    """
    if microbatches < 2:
        raise ValueError(f"microbatches={microbatches}: need >= 2")
    monitor = NoiseScaleMonitor(model, method, ema_steps=math.inf, loss_fn=loss_fn,
                                hessian_every=1 if hessian else 0,
                                hessian_microbatches=hessian_microbatches)
    saved = [p.grad for p in monitor.params]
    try:
        for inputs, targets in batches:
            n = _batch_len(inputs)
            if monitor.method == "microbatch" and n < 2:
                raise ValueError("method='microbatch' cannot split a batch of one example into "
                                 "micro-batches; use larger batches or method='per_example'")
            k = min(microbatches, n) if monitor.needs_microbatches else 1
            for p in monitor.params:
                p.grad = None
            bounds = [round(j * n / k) for j in range(k + 1)]
            for lo, hi in itertools.pairwise(bounds):
                index = slice(lo, hi)
                loss = _loss(model, loss_fn, _take(inputs, index), _take(targets, index))
                (loss * ((hi - lo) / n)).backward()
                monitor.accumulate()
            monitor.step(batch=(inputs, targets))
    finally:
        monitor.close()
        for p, grad in zip(monitor.params, saved, strict=True):
            p.grad = grad
    if monitor.estimate is None:
        raise ValueError("no batch could be measured: give at least one batch of >= 2 examples")
    return monitor.estimate


# -- small helpers ---------------------------------------------------------------------------


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _world_size(model: nn.Module) -> int:
    import torch.distributed as dist

    return dist.get_world_size(getattr(model, "process_group", None))


def _first_tensor(values: Iterable[Any]) -> torch.Tensor | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)):
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def _batch_len(inputs: Any) -> int:
    first = inputs if isinstance(inputs, torch.Tensor) else _first_tensor(inputs)
    if first is None or first.dim() == 0:
        raise ValueError("inputs must be a tensor (or tuple of tensors) with a batch dimension")
    return int(first.shape[0])


def _take(values: Any, index: slice) -> Any:
    if isinstance(values, torch.Tensor):
        return values[index]
    if isinstance(values, (tuple, list)):
        return type(values)(_take(v, index) for v in values)
    return values


def _check_scalar(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor (the batch-mean loss), got "
                         f"{shape}; reduce it with .mean()")


def _sq_norm(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """Squared norm of the parameters' `.grad` (float64, 0-d)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack(torch._foreach_norm(grads)).double()
    return torch.dot(norms, norms)


@contextmanager
def _busy(monitor: NoiseScaleMonitor) -> Iterator[None]:
    monitor._busy = True
    try:
        yield
    finally:
        monitor._busy = False
