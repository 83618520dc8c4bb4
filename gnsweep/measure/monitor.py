"""The monitor: squared gradient norms from a live model, fed to the pure estimators in
`gnsweep.noise`.

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

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from gnsweep.measure.common import (
    Batch,
    LossFn,
    TaskLoss,
    batch_len,
    batch_loss,
    first_tensor,
    is_ddp,
    log,
    split_batch,
    world_size,
)
from gnsweep.measure.ddp import DdpHook
from gnsweep.measure.hessian import hessian_norms
from gnsweep.measure.microbatch import Increments
from gnsweep.measure.per_example import PerExample
from gnsweep.noise import (
    NoiseEstimate,
    NoiseScaleEma,
    NormPair,
    estimate_state,
    load_estimate,
)

METHODS = ("per_example", "microbatch", "ddp")


class NoiseScaleMonitor:
    """Measures B_simple (eq. 2.9) and optionally B_noise (eq. 2.8) inside a training loop.

    Per step: forward, `loss.backward()` on the batch-mean loss, `monitor.step()`, then
    `optimizer.step()`. With gradient accumulation (and for `method="microbatch"`), scale each
    micro-batch's loss so that `.grad` ends up holding the batch mean and call
    `monitor.accumulate()` after each micro-batch's backward. `.grad` must start each step at
    zero (`optimizer.zero_grad()`); call `step()` before clipping or rescaling gradients.

    The time window of the estimate: `b_simple` is EMA(tr Sigma) / EMA(|G|^2), a |G|^2-weighted
    mean of B_simple over the EMA's window, which is
    - `ema_fraction` > 0: the last `ema_fraction` of the examples seen so far (time constant
      `ema_fraction * seen`; 0.2 in gnsweep's runs), so it covers the same span of log examples
      all run long and follows training as |G|^2 falls;
    - else `ema_steps` > 0: a time constant in steps;
    - else `ema_examples`: a time constant in examples (`math.inf`: the plain mean of every
      measurement, for estimates at fixed parameters).
    B_noise's EMAs run on the same clock (examples since the last Hessian measurement), so both
    ratios cover the same span however rarely B_noise is measured. Where |G|^2 changed more than
    2x inside the window the estimate leans to the window's start: `estimate.drift` says so.

    `every`: measure every n steps (hooks idle in between). `hessian_every` > 0 measures
    B_noise every n steps when `step(batch=...)` is given the step's batch, with
    `hessian_microbatches` gradients per measurement (see `hessian_norms`). The loss for those
    passes is either `loss_fn(outputs, targets)` with `batch=(inputs, targets)`, or
    `task_loss(model, batch)` with whatever batch the training loop drew (a task's `loss`:
    tensor, tuple, list or dict of tensors, split along dim 0).

    `parameters`: the parameters whose gradient is measured (default: every trainable one of
    the model). G, Sigma and H are then those of that block of the gradient, and B_simple is
    eq. 2.9 on it; e.g. an actor-critic's actor alone (`docs/tasks.md`, `noise_parameters`).
    The other parameters still train; their gradients are just not looked at.
    """

    def __init__(self, model: nn.Module, method: str = "per_example", *, every: int = 1,
                 ema_steps: float = 0.0, ema_examples: float = 2048.0,
                 loss_fn: LossFn | None = None, hessian_every: int = 0,
                 hessian_microbatches: int = 2, task_loss: TaskLoss | None = None,
                 ema_fraction: float = 0.0,
                 parameters: Iterable[nn.Parameter] | None = None) -> None:
        if method not in METHODS:
            raise ValueError(f"method={method!r}: choose one of {', '.join(METHODS)}")
        if every < 1 or hessian_every < 0 or hessian_microbatches < 2:
            raise ValueError("need every >= 1, hessian_every >= 0 and hessian_microbatches >= 2")
        if hessian_every and loss_fn is None and task_loss is None:
            raise ValueError("hessian_every > 0 needs loss_fn(outputs, targets) or "
                             "task_loss(model, batch) for B_noise")
        self.model = model
        self.params = _measured(model, parameters)
        self.every, self.hessian_every = every, hessian_every
        self.hessian_microbatches = hessian_microbatches
        self.loss_fn, self.task_loss = loss_fn, task_loss
        self.ema = NoiseScaleEma(ema_steps=ema_steps, ema_examples=ema_examples,
                                 ema_fraction=ema_fraction)
        self.steps = 0
        self.estimate: NoiseEstimate | None = None
        self._busy = False
        self._warned: set[str] = set()
        self._examples = 0
        self._since_examples, self._since_steps = 0, 0
        self._handles: list[Any] = []
        self._ddp: DdpHook | None = None
        self._per_example: PerExample | None = None
        self._increments: Increments | None = None
        # The module the Hessian passes run on: never through DDP's reducer.
        self.module: nn.Module = cast(nn.Module, model.module) if is_ddp(model) else model
        if method == "ddp":
            method = self._setup_ddp(model)
        elif is_ddp(model) and world_size(model) > 1:
            # .grad is all-reduced while per-example / micro-batch norms stay local.
            raise ValueError(f"method={method!r} with a DistributedDataParallel model: use "
                             "method='ddp'")
        self.method = method
        self._handles.append(
            model.register_forward_pre_hook(self._count_examples, with_kwargs=True))
        if method == "microbatch":
            self._increments = Increments(self.params)
        elif method == "per_example":
            self._per_example = PerExample(self, self.module, self.params)
            self._handles += self._per_example.handles
            rest = [p for p in self.params if id(p) not in self._per_example.covered]
            if rest:
                self._increments = Increments(rest)

    def _setup_ddp(self, model: nn.Module) -> str:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("method='ddp' needs an initialised torch.distributed process group "
                             "(run under torchrun and call init_process_group first)")
        if not is_ddp(model):
            raise ValueError("method='ddp' needs the DistributedDataParallel-wrapped model: "
                             "NoiseScaleMonitor(DistributedDataParallel(model), method='ddp')")
        if dist.get_world_size() < 2:
            log.warning("noise scale: world size 1 gives one batch size only; measuring with "
                        "per-example gradient norms instead of the DDP hook")
            return "per_example"
        self._ddp = DdpHook.attach(self, model, self.params)
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
    def step(self, batch: Batch | None = None, *, examples: int | None = None,
             loss_scale: float = 1.0) -> NoiseEstimate | None:
        """Fold this step's measurement in; call after backward, before `optimizer.step()`.

        `batch` (the step's batch: `(inputs, targets)` for `loss_fn`, anything the task samples
        for `task_loss`) lets a due Hessian measurement run. Returns
        the current estimate (None before the first measurement). `examples`: the examples
        this step trained on, in the caller's unit (tokens for a language model), for the EMA's
        time constant in examples; default the batch dimension of the model's forward calls.
        `loss_scale`: the factor this step's gradients carry (mixed precision's gradient
        scaler: call `step()` before unscaling, pass `scaler.get_scale()`); the squared norms
        are divided by its square, so every statistic is of the unscaled gradient.
        """
        measuring = self.measuring
        self.steps += 1
        self._since_examples += self._examples if examples is None else examples
        self._since_steps += 1
        hessian = bool(self.hessian_every and (self.steps - 1) % self.hessian_every == 0)
        try:
            if measuring or hessian:
                self._measure(batch, plain=measuring, hessian=hessian,
                              unscale=1.0 / float(loss_scale) ** 2)
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
        if self._ddp is not None and self._ddp.owner is self:
            self._fold(*self._ddp.collect())  # the last measurement's all-reduce
            self._ddp.owner = None

    def state_dict(self) -> dict[str, Any]:
        """The measurement's state between steps: the method in use, steps counted, the EMAs
        (`NoiseScaleEma.state_dict`), the examples and steps since the last measurement, whether
        B_noise is still measured, and the warnings already given. Under DDP the last
        measured step's norms, still in their all-reduce, are not in it."""
        return {"method": self.method, "steps": self.steps,
                "estimate": estimate_state(self.estimate), "hessian_every": self.hessian_every,
                "ema": self.ema.state_dict(),
                "since_examples": self._since_examples, "since_steps": self._since_steps,
                "warned": sorted(self._warned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` into a monitor built alike (same model, method, settings)."""
        if state["method"] != self.method:
            raise ValueError(f"monitor state of method {state['method']}, this monitor "
                             f"measures with {self.method}")
        self.steps, self.estimate = int(state["steps"]), load_estimate(state["estimate"])
        self.hessian_every = int(state["hessian_every"])
        self.ema.load_state_dict(state["ema"])
        self._since_examples, self._since_steps = state["since_examples"], state["since_steps"]
        self._warned = set(state["warned"])

    def __enter__(self) -> NoiseScaleMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    @property
    def capturing(self) -> bool:
        """This step is measured and no pass of the monitor's own (Hessian) is running: what
        the sources' hooks ask before they capture (`gnsweep.measure.common.Gate`)."""
        return self.measuring and not self._busy

    def _count_examples(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._busy or not torch.is_grad_enabled():
            return
        first = first_tensor(args) if args else None
        if first is None:
            first = first_tensor(tuple(kwargs.values()))
        if first is not None and first.dim() > 0:
            self._examples += int(first.shape[0])
        if self._per_example is not None:
            self._per_example.forward_id += 1

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _measure(self, batch: Batch | None, *, plain: bool, hessian: bool,
                 unscale: float = 1.0) -> None:
        """Fold in this step's norms; `unscale` multiplies the squared gradient norms (1 /
        the loss scale squared). The Hessian passes run the loss unscaled, in fp32."""
        hess = None
        if hessian:
            if batch is None:
                self.warn_once("hbatch", "noise scale: B_noise needs the step's batch: call "
                               "monitor.step(batch=(inputs, targets))")
            else:
                hess = self._hessian(batch)
                if hess is None and self.hessian_every:
                    self.warn_once("hsmall", "noise scale: batch too small to split for "
                                   f"B_noise (needs >= {2 * self.hessian_microbatches} examples)")
        if plain and self.method == "per_example" and self._examples == 1:
            # One sample has no spread: tr(Sigma) is undefined at this batch size (eq. A.2
            # needs two batch sizes). Skipped, so the estimate stays None (NaN), never wrong.
            # (method microbatch says so as an error: its caller cut the batch.)
            self.warn_once("one", "noise scale: a batch of one sample has no spread to measure; "
                           "B_simple is not measured at this batch size")
            plain = False
        parts: list[NormPair] = []
        if self._ddp is not None:
            parts, hess = self._ddp.measure(hess, self._examples, self.params, unscale)
        elif plain and self._per_example is not None:
            part = self._per_example.measure(self._examples)
            if part is not None:
                parts.append(_unscaled(part, unscale))
        if self._increments is not None and plain:
            part = self._increments.measure(self.method == "microbatch")
            if part is not None:
                parts.append(_unscaled(part, unscale))
            elif self.method == "per_example":
                self.warn_once("fallback", "noise scale: layers without per-example norms "
                               "need micro-batches and monitor.accumulate(); this estimate "
                               "leaves their parameters out")
        self._fold(parts, hess)

    def _hessian(self, batch: Batch) -> NormPair | None:
        """H-norms for B_noise; a model whose loss has no double backward (e.g. a fused
        attention kernel) is said once and B_noise is no longer measured."""
        try:
            with _busy(self):
                return hessian_norms(self.module, self.loss_fn, batch,
                                     self.hessian_microbatches, task_loss=self.task_loss,
                                     params=self.params)
        except RuntimeError as err:
            text = str(err)
            if "derivative for" not in text and "double backward" not in text:
                raise
            self.warn_once("hdouble", "noise scale: B_noise needs Hessian-vector products "
                           "(double backward) of the loss, which this model does not support ("
                           f"{text.splitlines()[0]}); B_noise is not measured")
            self.hessian_every = 0
            return None

    def _fold(self, parts: list[NormPair], hess: NormPair | None) -> None:
        valid = [p for p in parts if all(map(math.isfinite, p)) and 0 < p.b_small < p.b_big]
        if len(valid) < len(parts):
            self.warn_once("skip", "noise scale: a measurement had one batch size only or "
                           "non-finite norms; skipped (a batch of one example?)")
        elif parts:
            blocks: list[tuple[float, float, float, float]] = list(parts)
            self.estimate = self.ema.update_parts(blocks, examples=self._since_examples,
                                                  steps=self._since_steps)
            self._since_examples, self._since_steps = 0, 0
        if hess is not None and all(map(math.isfinite, hess)):
            estimate = self.ema.update_hessian(*hess)
            if estimate is not None:
                self.estimate = estimate



def _unscaled(pair: NormPair, unscale: float) -> NormPair:
    """Squared gradient norms of a scaled loss's gradients times `unscale` (1 / scale^2)."""
    if unscale == 1.0:
        return pair
    return pair._replace(sq_small=pair.sq_small * unscale, sq_big=pair.sq_big * unscale)


# -- one-shot measurement at fixed parameters ------------------------------------------------


def measure_noise_scale(model: nn.Module, loss_fn: LossFn | None, batches: Iterable[Batch],
                        method: str = "per_example", hessian: bool = False, *,
                        microbatches: int = 4, hessian_microbatches: int = 2,
                        parameters: Iterable[nn.Parameter] | None = None,
                        task_loss: TaskLoss | None = None) -> NoiseEstimate:
    """B_simple (eq. 2.9), and with `hessian=True` B_noise (eq. 2.8), at the model's current
    parameters: no optimizer step is taken and `.grad` is left as it was.

    `loss_fn(outputs, targets)` returns the batch-mean loss; `batches` yields `(inputs, targets)`
    (inputs a tensor, or a tuple of tensors passed as `model(*inputs)`). The squared norms of
    all batches are pooled with equal weights (eq. A.2 on the means), so the estimate sharpens
    with more batches. `microbatches`: the split for method="microbatch" (and for layers without
    per-example norms). `parameters`: the measured block, as for `NoiseScaleMonitor`.
    With `task_loss(model, batch)` instead of `loss_fn` (pass `loss_fn=None`), `batches` yields
    whatever a task samples (a tensor or a tuple / list / dict of tensors, split along dim 0),
    e.g. `measure_noise_scale(model, None, batches, task_loss=task.loss)`.
    """
    if microbatches < 2:
        raise ValueError(f"microbatches={microbatches}: need >= 2")
    if (loss_fn is None) == (task_loss is None):
        raise ValueError("give exactly one of loss_fn(outputs, targets) and "
                         "task_loss(model, batch)")
    monitor = NoiseScaleMonitor(model, method, ema_steps=math.inf, loss_fn=loss_fn,
                                hessian_every=1 if hessian else 0,
                                hessian_microbatches=hessian_microbatches,
                                parameters=parameters, task_loss=task_loss)
    saved = [p.grad for p in monitor.params]
    try:
        for batch in batches:
            n = batch_len(batch if task_loss is not None else batch[0])
            if monitor.method == "microbatch" and n < 2:
                raise ValueError("method='microbatch' cannot split a batch of one example into "
                                 "micro-batches; use larger batches or method='per_example'")
            k = min(microbatches, n) if monitor.needs_microbatches else 1
            for p in monitor.params:
                p.grad = None
            for part, share in _pieces(batch, k, n, task_loss is not None):
                if task_loss is not None:
                    with torch.enable_grad():
                        loss = task_loss(model, part)
                else:
                    assert loss_fn is not None
                    loss = batch_loss(model, loss_fn, *part)
                (loss * share).backward()
                monitor.accumulate()
            monitor.step(batch=batch)
    finally:
        monitor.close()
        for p, grad in zip(monitor.params, saved, strict=True):
            p.grad = grad
    if monitor.estimate is None:
        raise ValueError("no batch could be measured: give at least one batch of >= 2 examples")
    return monitor.estimate



def _pieces(batch: Batch, k: int, n: int, whole: bool) -> list[tuple[Any, float]]:
    """`batch` in k micro-batches along dim 0 (`split_batch`: `(inputs, targets)` are cut alike
    for loss_fn), each with its share of the n examples."""
    if k == 1:
        return [(batch, 1.0)]
    parts = split_batch(batch, k)
    if parts is None:
        raise ValueError("the batch cannot be split along dim 0 into micro-batches; use "
                         "method='per_example' or batches of tensors of equal length")
    return [(part, batch_len(part if whole else part[0]) / n) for part in parts]


def _measured(model: nn.Module, parameters: Iterable[nn.Parameter] | None
              ) -> list[nn.Parameter]:
    """The measured parameters: the given ones (trainable parameters of the model, each once),
    or every trainable parameter of the model."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if parameters is None:
        if not trainable:
            raise ValueError("the model has no trainable parameters: nothing to measure")
        return trainable
    ids = {id(p) for p in parameters}
    if not ids:
        raise ValueError("parameters= is empty: nothing to measure")
    if not ids <= {id(p) for p in trainable}:
        raise ValueError("parameters= must be trainable parameters of the model (one is not, "
                         "or does not require grad)")
    # The model's order, so that flattened gradients line up with DDP's and the optimizer's.
    return [p for p in trainable if id(p) in ids]


@contextmanager
def _busy(monitor: NoiseScaleMonitor) -> Iterator[None]:
    monitor._busy = True
    try:
        yield
    finally:
        monitor._busy = False
