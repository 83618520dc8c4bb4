"""Gradient norms of a model sharded by FSDP (`torch.distributed.fsdp.fully_shard`): b_small =
one rank's micro-step (one backward), b_big = the global step (every rank's micro-steps).

FSDP keeps each parameter as a sharded `DTensor` and, for forward and backward, swaps in an
unsharded parameter it all-gathers: autograd computes the gradient of that unsharded parameter
(this rank's micro-batch, whole, before any reduction), then FSDP reduce-scatters it into the
sharded `.grad` (or, with `set_requires_gradient_sync(False)`, keeps summing it unsharded until
the step's last backward). So:

- a hook on each unsharded parameter (hooked when a forward pre-hook finds it registered on its
  module) sees `g_(r,k)`, rank r's gradient of micro-step k, whatever the gradient sync setting:
  its squared norm summed over parameters is that micro-step's `|g|^2`, no communication;
- after the last backward the sharded `.grad` holds the global gradient, each rank a disjoint
  shard: `|G_big|^2` is the sum over ranks of the shards' squared norms.

One all-reduce of five scalars per measured step combines both (eq. A.2). Scale: with micro-step
k of rank r on `n` of the step's `N` examples, the loss scaled so that `.grad` ends up holding
the global mean (`loss * n * D / N`, i.e. `loss / K` for K equal micro-steps, D the divide
factor, FSDP's default the world size), the captured gradient is `c g` with `c = D n / N`: its
micro-batch-mean gradient is `(N / (D n)) x` the captured one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gnsweep.measure.common import Gate, first_tensor, log, sq
from gnsweep.measure.source import Reading, Stateless, StepNorms, unscale
from gnsweep.noise import NoiseEstimate, NoiseScaleEma, NormPair, ema_window


def sharded_parameters(model: nn.Module) -> list[str]:
    """Names of the model's parameters that FSDP holds sharded (`DTensor`, or FSDP1's
    `FlatParameter`)."""
    return [name for name, p in model.named_parameters()
            if type(p).__name__ in ("DTensor", "FlatParameter")]


def fsdp_refusal(model: nn.Module) -> str | None:
    """Why the gradient norms of this sharded model cannot be read (one line), or None."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    flat = [n for n, p in params if type(p).__name__ == "FlatParameter"]
    if flat:
        return (f"the noise scale cannot be measured on a model wrapped by FSDP1 "
                f"(FullyShardedDataParallel, {flat[0]}): its flat parameters hide the "
                "gradients; use torch.distributed.fsdp.fully_shard (FSDP2) or DDP")
    plain = [n for n, p in params if type(p).__name__ != "DTensor"]
    if plain:
        return (f"the noise scale cannot be measured on a model only partly sharded by FSDP "
                f"({plain[0]} is not sharded: ignored_params?): shard every trainable "
                "parameter with fully_shard, or measure with DDP")
    meshes = {p.device_mesh.ndim for _, p in params}  # type: ignore[attr-defined]
    if meshes != {1}:
        return ("the noise scale cannot be measured on a model sharded over a mesh of more than "
                "one dimension (HSDP, tensor parallelism): only 1-D fully_shard meshes are "
                "supported; use one shard dimension")
    return None


class FsdpGrads(Stateless):
    """Each rank's micro-step gradient norms and the global gradient's, for a `fully_shard`
    model (module docstring). `accumulate(examples_so_far)` closes a micro-step; `measure()`
    (every rank, the same steps: it all-reduces) returns the step's `NormPair` or None."""

    def __init__(self, gate: Gate, model: nn.Module) -> None:
        import torch.distributed as dist

        reason = fsdp_refusal(model)
        if reason is not None:
            raise ValueError(reason)
        self.gate = gate
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters to measure")
        mesh = self.params[0].device_mesh  # type: ignore[attr-defined]
        self.group = mesh.get_group()
        self.world = dist.get_world_size(self.group)
        self.divide = _divide_factor(model, self.world)
        self._sharded = {id(p) for p in model.parameters()}
        self._hooked: set[int] = set()
        self.handles: list[Any] = [
            module.register_forward_pre_hook(self._find_unsharded)
            for module in model.modules() if module._parameters]
        self.reset()

    def reset(self) -> None:
        self.current: torch.Tensor | None = None
        self.unclosed = False
        self._fired: set[int] = set()
        self.sq: list[torch.Tensor] = []
        self.counts: list[int] = []
        self._seen = 0

    def _find_unsharded(self, module: nn.Module, args: Any) -> None:
        # FSDP's own pre-forward hook (prepended) has swapped the unsharded parameters in.
        for p in module._parameters.values():
            if p is None or not p.requires_grad or id(p) in self._sharded \
                    or id(p) in self._hooked:
                continue
            if type(p).__name__ == "DTensor":
                continue  # an unsharded DTensor (2-D mesh): refused at construction
            self._hooked.add(id(p))
            self.handles.append(p.register_hook(self._capture_for(id(p))))

    def _capture_for(self, key: int) -> Any:
        def capture(grad: torch.Tensor) -> None:
            if self.gate.capturing:
                # A leaf's hook fires once a backward: twice means two backward passes in one
                # micro-step, whose sum of squares is not the squared norm of their sum.
                self.unclosed = self.unclosed or key in self._fired
                self._fired.add(key)
                value = sq(grad.detach().float())
                self.current = value if self.current is None else self.current + value
        return capture

    def accumulate(self, examples_so_far: int) -> None:
        """Close the micro-step just back-propagated (`examples_so_far`: examples this rank has
        forwarded this step)."""
        if self.current is None:
            return
        n = examples_so_far - self._seen
        if n < 1:
            raise ValueError("micro-step closed without a forward pass of the model since the "
                             "previous one: no examples to attribute")
        self.sq.append(self.current)
        self.counts.append(n)
        self.current = None
        self._fired = set()
        self._seen = examples_so_far

    def measure(self, examples_so_far: int, *, required: bool) -> NormPair | None:
        """This step's pair from one all-reduce: mean over every rank's micro-steps of the
        micro-batch-mean gradient's squared norm (b_small their harmonic mean size), and the
        global `.grad`'s squared norm (b_big all examples). `required`: raise where the step
        has one batch size only (one process, one micro-step)."""
        import torch.distributed as dist

        self.accumulate(examples_so_far)
        if self.unclosed:
            raise ValueError("two backward passes in one micro-step: with FSDP call "
                             "micro_step() (NoiseScaleMonitor: accumulate()) after each backward")
        device = self.params[0].device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        # sum_k |captured_k|^2 / n_k^2, micro-steps, sum_k 1/n_k, examples, shards' |.grad|^2
        weighted = sum((s.double() / n ** 2 for s, n in zip(self.sq, self.counts,
                                                            strict=True)), zero)
        big = sum((sq(p.grad.to_local().float()).double()  # type: ignore[attr-defined]
                   for p in self.params if p.grad is not None), zero)
        local = [float(len(self.counts)), sum(1.0 / n for n in self.counts),
                 float(sum(self.counts))]
        pack = torch.cat([weighted.reshape(1), big.to(device).reshape(1),
                          torch.tensor(local, dtype=torch.float64, device=device)])
        dist.all_reduce(pack, group=self.group)
        weighted_all, big_all, micro, inverse, examples = pack.tolist()
        if micro < 2 or examples <= 0:
            if required:
                raise ValueError(
                    "FSDP on one process with one backward per step has one batch size only: "
                    "eq. A.2 needs two; accumulate >= 2 micro-steps (calling micro_step() "
                    "after each backward) or run >= 2 processes")
            return None
        b_small = micro / inverse
        sq_small = (examples / self.divide) ** 2 * weighted_all / micro
        return NormPair(sq_small, big_all, b_small, examples)


    preconditions = False

    @property
    def splits(self) -> bool:
        """One process measures the micro-steps of gradient accumulation."""
        return self.world == 1

    def read(self, step: StepNorms) -> Reading:
        """The `Source` reading: this step's pair from its one all-reduce, unscaled."""
        if not step.plain:
            return Reading()
        part = self.measure(step.examples, required=True)
        return Reading([unscale(part, step.small_scale, step.big_scale)] if part is not None
                       else [])

    def describe(self) -> str:
        return (f"FSDP: each rank's micro-step gradients against the global one, {self.world} "
                "ranks (b_small = one rank's micro-step)")


def _divide_factor(model: nn.Module, world: int) -> float:
    """What FSDP divides the summed gradient by: `set_gradient_divide_factor`'s value, else the
    world size (the mean over ranks). Read from FSDP's parameter groups; one value for all."""
    factors = set()
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in getattr(get_state(), "_fsdp_param_groups", []):
            factor = getattr(group, "gradient_divide_factor", None)
            factors.add(float(world) if factor is None else float(factor))
    if len(factors) > 1:
        raise ValueError("FSDP modules of this model divide their gradients by different "
                         f"factors ({sorted(factors)}): the micro-step and global gradients "
                         "cannot be put on one scale; use one gradient divide factor")
    return factors.pop() if factors else float(world)


class FsdpNoiseScale:
    """B_simple (eq. 2.9) of a `fully_shard` model in a training loop with gradient
    accumulation: eq. A.2 with b_small = one rank's micro-step and b_big = the global step.

    Per step, on every rank: for each micro-step, forward, `(loss * share).backward()` with the
    share that makes `.grad` the global batch mean (`1 / K` for K equal micro-steps; FSDP
    averages over ranks), then `noise.micro_step()`; after the last one `noise.step()` (before
    clipping, before `optimizer.step()`), which returns the estimate. The gradient sync setting
    (`model.set_requires_gradient_sync(False)` on all but the last micro-step) does not matter:
    each micro-step's gradient is read before FSDP reduces it. Every rank must call `step()` at
    the same steps (one all-reduce of five scalars). Measurable with >= 2 ranks, or one rank
    with >= 2 micro-steps a step.

    The window is that of `NoiseScaleMonitor` (`ema_fraction`, default the lag-free 0.2 of
    the examples seen; `ema_steps`; `ema_examples`, `math.inf` for fixed parameters). Examples
    are counted from the first dimension of the model's first tensor input, per rank; pass
    `step(examples=...)` (this rank's examples, or any unit: tokens) for the window's clock.
    """

    method = "fsdp"

    def __init__(self, model: nn.Module, *, every: int = 1, ema_fraction: float | None = None,
                 ema_steps: float = 0.0, ema_examples: float | None = None) -> None:
        if every < 1:
            raise ValueError(f"every={every}: need >= 1")
        self.model, self.every = model, every
        window = ema_window(ema_fraction, ema_steps, ema_examples)
        self.ema = NoiseScaleEma(ema_steps=window["ema_steps"],
                                 ema_fraction=window["ema_fraction"],
                                 ema_examples=window["ema_examples"])
        self.steps = 0
        self.estimate: NoiseEstimate | None = None
        self._examples = 0
        self._since_examples, self._since_steps = 0.0, 0
        self._warned: set[str] = set()
        self._grads = FsdpGrads(self, model)
        self._handles = [*self._grads.handles,
                         model.register_forward_pre_hook(self._count, with_kwargs=True)]

    @property
    def capturing(self) -> bool:
        return self.steps % self.every == 0

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    @property
    def b_simple(self) -> float:
        return self.estimate.b_simple if self.estimate is not None else math.nan

    def _count(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return
        first = first_tensor(args) if args else None
        if first is None:
            first = first_tensor(tuple(kwargs.values()))
        if first is not None and first.dim() > 0:
            self._examples += int(first.shape[0])

    def micro_step(self) -> None:
        """Record the micro-step just back-propagated (after each backward of the step)."""
        if self.capturing:
            self._grads.accumulate(self._examples)

    @torch.no_grad()
    def step(self, *, examples: float | None = None, loss_scale: float = 1.0
             ) -> NoiseEstimate | None:
        """Fold this step in (after its last backward and `micro_step()`); returns the current
        estimate (None before the first). `loss_scale`: the factor the loss was multiplied by
        (fp16's gradient scale); the squared norms are divided by its square."""
        if not (loss_scale > 0 and math.isfinite(loss_scale)):
            raise ValueError(f"loss_scale={loss_scale}: need a finite number > 0")
        measuring = self.capturing
        self.steps += 1
        self._since_examples += self._examples if examples is None else examples
        self._since_steps += 1
        try:
            if measuring:
                pair = self._grads.measure(self._examples, required=True)
                if pair is not None:
                    s = loss_scale ** 2
                    pair = NormPair(pair.sq_small / s, pair.sq_big / s, pair.b_small,
                                    pair.b_big)
                    if all(map(math.isfinite, pair)):
                        self.estimate = self.ema.update(*pair, examples=self._since_examples,
                                                        steps=self._since_steps)
                        self._since_examples, self._since_steps = 0.0, 0
        finally:
            self._examples = 0
            self._grads.reset()
        return self.estimate

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> FsdpNoiseScale:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
