"""Per-worker gradient norms under DistributedDataParallel (b_small = per-worker batch, b_big =
global batch) from a communication hook. A measured step's few numbers are summed over the
workers by riding on the next step's first gradient bucket (no collective of their own: over
gloo one costs about as much as a small model's whole step), or by one scalar all-reduce where
they cannot ride (a low-precision bucket, or no next step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from gnsweep.measure.common import Gate, grad_sq_norm, sq
from gnsweep.measure.source import Reading, Stateless, StepNorms, unscale
from gnsweep.noise import NormPair

CARRIER_DTYPES = (torch.float32, torch.float64)
"""Bucket dtypes the measured numbers ride in: a bf16 or fp16 bucket would round a squared norm
to 3 significant digits."""


Collected = tuple[list[NormPair], NormPair | None, list[NormPair] | None]
"""A DDP measurement summed over the workers: B_simple's parts, the Hessian norms (B_noise), and
the parts in the optimizer's P-norm (B_simple_P; None where not taken)."""


class DdpHook:
    """Reads each worker's gradient in DDP's buckets before the all-reduce.

    With a registered hook DDP no longer divides by the world size: the hook does. DDP lays its
    buckets out again after a process's first step (the parameters in the order their gradients
    came, not the model's): a resumed run's first step has the other layout. So the worker's
    squared norm is summed per parameter, in the model's order, never over a bucket's buffer,
    whose sum depends on where each parameter lies in it (a resumed run then measures exactly
    what the uninterrupted one does).

    A measured step's pack (this worker's squared norm, |G_big|^2, examples, Hessian norms) is
    appended to bucket 0 of the next backward (every rank has a bucket 0, of the same dtype, at
    the same steps: ranks measure at the same steps) and read back from its all-reduce; it is
    therefore summed one step late, as a pack reduced on its own would be (that reduction was
    overlapped with the next step too). A pack with no next backward to ride (`close`, a
    checkpoint) is all-reduced on its own: every rank gets there at the same step.
    """

    def __init__(self, model: nn.Module) -> None:
        import torch.distributed as dist

        self.owner: Gate | None = None
        """The monitor measuring through this hook now (None: all-reduce only)."""
        self.group = getattr(model, "process_group", None)
        self.world = dist.get_world_size(self.group)
        self.local_sq: dict[int, torch.Tensor] = {}
        """This step's squared norm of each measured parameter's worker gradient, by id
        (float64, 0-d), summed in the model's order at `measure`."""
        self.measured: set[int] | None = None
        """ids of the measured parameters (None: all)."""
        self.pending: tuple[Any, torch.Tensor] | None = None
        """An all-reduce of a pack on its own, in flight: (work, pack)."""
        self.outgoing: torch.Tensor | None = None
        """The last measured step's pack, waiting for the next backward's bucket 0."""
        self.carried: torch.Tensor | None = None
        """A pack summed over the workers in bucket 0's all-reduce (not yet read)."""
        self.can_carry = False
        """Bucket 0 holds fp32 or fp64 gradients (set by the hook; the same on every rank)."""
        self.preconditioner: Callable[[], dict[int, torch.Tensor] | None] | None = None
        """The optimizer's diagonal preconditioner P per parameter id, read once a measured
        step before its update (None: B_simple_P is not measured through this hook); the
        worker's P-norm |g|_P^2 = sum P g^2 is then summed beside |g|^2."""
        self.weights: dict[int, torch.Tensor] | None = None
        self.local_p: dict[int, torch.Tensor] = {}
        """The same for the P-norm |g|_P^2 of each parameter (`preconditioner`)."""
        self.params: list[nn.Parameter] = []
        """The owner's measured parameters (`attach`)."""
        self.handles: list[Any] = []  # DDP's hook cannot be removed
        try:
            # A lambda: DDP rejects hooks whose (postponed, string) annotations it cannot match.
            cast(Any, model).register_comm_hook(None, lambda state, bucket: self._hook(state,
                                                                                    bucket))
        except RuntimeError as err:
            raise ValueError("method='ddp': this DistributedDataParallel model already has a "
                             "communication hook of its own; DDP allows one") from err

    @classmethod
    def attach(cls, owner: Gate, model: nn.Module, measured: list[nn.Parameter]) -> DdpHook:
        """DDP takes one hook per model, for good: later monitors reuse it. `measured`: the
        owner's parameters (their block of each bucket is read; the whole bucket when they
        are all the model's trainable parameters)."""
        hook = getattr(model, "_gnsweep_comm_hook", None)
        if hook is None:
            hook = cls(model)
            model._gnsweep_comm_hook = hook  # type: ignore[assignment]
        hook.collect()  # a previous monitor's last all-reduce, if it was never closed
        hook.owner = owner
        hook.preconditioner = None  # a previous owner's preconditioner is not this one's
        every = {id(p) for p in model.parameters() if p.requires_grad}
        ids = {id(p) for p in measured}
        hook.measured = None if ids == every else ids
        hook.params = measured
        hook.reset()
        return hook

    def reset(self) -> None:
        self.local_sq, self.local_p, self.weights = {}, {}, None

    def _hook(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        import torch.distributed as dist

        buffer = bucket.buffer()
        if self.owner is not None and self.owner.capturing:
            mine = [(p, grad) for p, grad in zip(bucket.parameters(), bucket.gradients(),
                                                 strict=True)
                    if self.measured is None or id(p) in self.measured]
            if mine:
                # One norm per parameter: its value does not depend on the bucket's layout.
                norms = torch._foreach_norm([grad for _, grad in mine], 2, dtype=torch.float32)
                squares = torch.stack(norms).double().square()
                for i, (p, _) in enumerate(mine):
                    _add(self.local_sq, id(p), squares[i])
            if self.preconditioner is not None:
                self._precondition_bucket(bucket)
        buffer.div_(self.world)
        if bucket.index() == 0:
            self.can_carry = buffer.dtype in CARRIER_DTYPES
            if self.outgoing is not None and self.can_carry:
                return self._carry(buffer, self.outgoing)
        future = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
        return future.then(lambda fut: fut.value()[0])

    def _precondition_bucket(self, bucket: Any) -> None:
        """Add this worker's P-norm of the bucket's measured gradients to `local_p` (P read at
        the step's first bucket: the optimizer's state before this step's update)."""
        assert self.preconditioner is not None
        if self.weights is None:
            self.weights = self.preconditioner() or {}
        if not self.weights:
            return
        for p, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            weight = self.weights.get(id(p))
            if weight is not None and (self.measured is None or id(p) in self.measured):
                g = grad.float().reshape(-1)
                _add(self.local_p, id(p), torch.dot(weight, g * g).double())

    def _carry(self, buffer: torch.Tensor, pack: torch.Tensor
               ) -> torch.futures.Future[torch.Tensor]:
        """All-reduce `buffer` with `pack` appended (divided by the world size like the
        gradients; `collect` multiplies back); the gradients' part goes back to DDP."""
        import torch.distributed as dist

        self.outgoing = None
        n = buffer.numel()
        joined = torch.cat([buffer.reshape(-1), pack.to(buffer.dtype) / self.world])
        future = dist.all_reduce(joined, group=self.group, async_op=True).get_future()

        def split(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = fut.value()[0]
            self.carried = reduced[n:].double() * self.world
            return reduced[:n].view_as(buffer)

        return future.then(split)

    def measure(self, hess: NormPair | None, examples: int, params: list[nn.Parameter],
                unscale: float = 1.0) -> Collected:
        """Pack this step's numbers (worker norms, example counts, Hessian norms, and the
        P-norms where `preconditioner` is set) to be summed over the workers in the next backward
        (or by an all-reduce of their own started now, where bucket 0 cannot carry them) and return
        the previous pack's result. `unscale` multiplies this step's squared gradient norms
        (1 / the loss scale^2)."""
        import torch.distributed as dist

        done = self.collect()
        local = _in_order(self.local_sq, params)
        h_small, h_big, hb_small, hb_big = hess if hess is not None else (0.0, 0.0, 0.0, 0.0)
        scalars = [float(examples), float(bool(self.local_sq)),
                   h_small, h_big, hb_small, hb_big, float(hess is not None)]
        # |G_big|^2 is the same on every worker (after the all-reduce): it rides along.
        big = grad_sq_norm(params).to(local.device).reshape(1)
        weighted = self._preconditioned_pair(params, local.device)
        pack = torch.cat([local.double().reshape(1) * unscale, big * unscale,
                          torch.tensor(scalars, dtype=torch.float64, device=local.device),
                          weighted * torch.tensor([unscale, unscale, 1.0], dtype=torch.float64,
                                                  device=local.device)])
        if self.can_carry:
            self.outgoing = pack
        else:
            self.pending = (dist.all_reduce(pack, group=self.group, async_op=True), pack)
        return done

    def _preconditioned_pair(self, params: list[nn.Parameter], device: torch.device
                             ) -> torch.Tensor:
        """(this worker's |g|_P^2, |G_big|_P^2, 1) for the pack, or zeros when this step's
        P-norms were not taken (no `preconditioner`, or no P yet: before an adaptive
        optimizer's first update)."""
        if not self.local_p or not self.weights:
            return torch.zeros(3, dtype=torch.float64, device=device)
        big = params[0].new_zeros((), dtype=torch.float64)
        for p in params:
            weight = self.weights.get(id(p))
            if weight is not None and p.grad is not None:
                g = p.grad.detach().double().reshape(-1)
                big = big + torch.dot(weight.double(), g * g)
        return torch.stack([_in_order(self.local_p, params).to(device), big.to(device),
                            torch.ones((), dtype=torch.float64, device=device)])

    def _summed(self) -> torch.Tensor | None:
        """The last pack summed over the workers, or None: read from bucket 0's all-reduce,
        waited for, or all-reduced now when it has not left (every rank calls this at the same
        step: `measure`, `close`, a checkpoint's `pending_state`)."""
        import torch.distributed as dist

        if self.carried is not None:
            summed, self.carried = self.carried, None
            return summed
        if self.outgoing is not None:
            pack, self.outgoing = self.outgoing, None
            self.pending = (dist.all_reduce(pack, group=self.group, async_op=True), pack)
        if self.pending is None:
            return None
        work, summed = self.pending
        self.pending = None
        work.wait()
        return summed

    def pending_state(self) -> list[float] | None:
        """The last pack summed over the workers, or None: what a checkpoint taken between two
        steps holds so that the resumed run folds it in at its next measurement."""
        summed = self._summed()
        if summed is None:
            return None
        self.pending = (_Done(), summed)
        return [float(v) for v in summed.tolist()]

    def load_pending(self, values: list[float] | None, device: torch.device) -> None:
        """Restore `pending_state()`: the next `collect` returns it."""
        self.pending = None if values is None else (
            _Done(), torch.tensor(values, dtype=torch.float64, device=device))

    def collect(self) -> Collected:
        """The last pack's (parts, Hessian norms, P-norm parts), summed over the workers;
        nothing when no pack is pending. A pack saved in a checkpoint before P-norms rode
        along (9 numbers) has none."""
        summed = self._summed()
        if summed is None:
            return [], None, None
        w = float(self.world)
        values = [v / w for v in summed.tolist()]
        sq_small, sq_big, examples, have, *hessian, have_hessian = values[:9]
        parts = [NormPair(sq_small, sq_big, examples, examples * w)] if have == 1 else []
        p_small, p_big, have_p = values[9:12] if len(values) >= 12 else (0.0, 0.0, 0.0)
        weighted = [NormPair(p_small, p_big, examples, examples * w)] \
            if have == 1 and have_p == 1 else None
        # Every worker measured the same batch pair: their H-norms are averaged.
        return parts, (NormPair(*hessian) if have_hessian == 1 else None), weighted


    splits = False
    preconditions = True

    def accumulate(self, examples_so_far: int) -> None:
        """Nothing: the communication hook reads each bucket as it is reduced."""

    def read(self, step: StepNorms) -> Reading:
        """The `Source` reading, on every step with a measurement or a Hessian pass: this
        step's numbers (unscaled inside) leave for the workers' sum, and the last measured
        step's come back, its H-norm pair with them (`replaces_hess`)."""
        if step.grads_unscaled and step.small_scale != 1.0:
            raise ValueError("step(grads_unscaled=True) with the DDP communication hook: "
                             "call step() before unscaling the gradients")
        parts, hess, weighted = self.measure(step.hess, step.examples, self.params,
                                             1 / step.small_scale)
        return Reading(parts, preconditioned=weighted, hess=hess, replaces_hess=True)

    def state_dict(self) -> dict[str, Any]:
        """`ddp_pending`: the last measured step's pack (its all-reduce waited for here)."""
        return {"ddp_pending": self.pending_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_pending(state.get("ddp_pending"), self.params[0].device)

    def close(self, owner: Gate) -> Reading | None:
        """The last measurement's all-reduce, for the monitor that owns the hook now (the
        hook stays, all-reducing without measuring)."""
        if self.owner is not owner:
            return None
        parts, hess, weighted = self.collect()
        self.owner = None
        return Reading(parts, preconditioned=weighted, hess=hess, replaces_hess=True)

    def describe(self) -> str:
        return (f"DDP's communication hook: each worker's gradient before the all-reduce, "
                f"{self.world} workers (b_small = per-worker batch)")


class RankGrads(Stateless):
    """Each rank's own gradient (b_small = this rank's examples of the step) under a data-parallel
    wrapper the monitor cannot hook (the Trainers' DDP, accelerate): a hook on each measured
    parameter sees the gradient of this backward before it is accumulated into `.grad` and
    all-reduced, and `.grad` still holds this rank's own sum of the step's earlier micro-batches
    (they run without synchronisation), so `|.grad + grad|^2` is this rank's squared norm so far.
    After the step's last backward `.grad` is the global mean: |G_big|^2 (b_big = all ranks'
    examples). One scalar all-reduce per measured step, at `measure()`, which every rank must
    reach at the same steps. With `preconditioner` set (an adaptive optimizer's P, as for `DdpHook`)
    the same sums are also taken in the P-norm, in the same all-reduce."""

    def __init__(self, gate: Gate, params: list[nn.Parameter]) -> None:
        self.gate = gate
        self.params = params
        self.preconditioner: Callable[[], dict[int, torch.Tensor] | None] | None = None
        self.handles = [p.register_hook(self._hook_for(i)) for i, p in enumerate(params)]
        self.reset()

    def reset(self) -> None:
        self.local: dict[int, torch.Tensor] = {}
        self.local_p: dict[int, torch.Tensor] = {}
        self.weights: dict[int, torch.Tensor] | None = None

    def _hook_for(self, i: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self.gate.capturing:
                before = self.params[i].grad
                total = grad.float() if before is None else before.float() + grad.float()
                self.local[i] = sq(total)
                if self.preconditioner is not None:
                    if self.weights is None:  # P before this step's update, read once
                        self.weights = self.preconditioner() or {}
                    weight = self.weights.get(id(self.params[i]))
                    if weight is not None:
                        flat = total.reshape(-1)
                        self.local_p[i] = torch.dot(weight, flat * flat)
        return hook

    def measure(self, examples: int) -> tuple[NormPair | None, NormPair | None]:
        """(B_simple's pair, B_simple_P's pair or None) of this step, summed over the ranks."""
        import torch.distributed as dist

        device = self.params[0].device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        local = torch.stack(list(self.local.values())).sum().double() if self.local else zero
        weighted = bool(self.weights) and len(self.local_p) == len(self.local) > 0
        local_p = torch.stack(list(self.local_p.values())).sum().double() if weighted else zero
        pack = torch.stack([local.to(device), torch.tensor(float(examples),
                                                           dtype=torch.float64, device=device),
                            torch.tensor(float(bool(self.local)), dtype=torch.float64,
                                         device=device),
                            local_p.to(device),
                            torch.tensor(float(weighted), dtype=torch.float64, device=device)])
        dist.all_reduce(pack)
        world = dist.get_world_size()
        sq_small, examples_all, have, p_small, have_p = pack.tolist()
        if have < world or examples_all <= examples_all / world:
            return None, None
        big = float(grad_sq_norm(self.params))
        pair = NormPair(sq_small / world, big, examples_all / world, examples_all)
        if have_p < world or not self.weights:
            return pair, None
        big_p = 0.0
        for p in self.params:
            weight = self.weights.get(id(p))
            if weight is not None and p.grad is not None:
                g = p.grad.detach().float().reshape(-1)
                big_p += float(torch.dot(weight, g * g))
        return pair, NormPair(p_small / world, big_p, examples_all / world, examples_all)


    splits = False
    preconditions = True

    def accumulate(self, examples_so_far: int) -> None:
        """Nothing: the parameter hooks read each backward as it runs."""

    def read(self, step: StepNorms) -> Reading:
        """The `Source` reading: this step's pair and its P-norm pair, summed over the ranks
        (every rank reads at the same steps), unscaled."""
        if not step.plain:
            return Reading(preconditioned=None)
        part, rank_p = self.measure(step.examples)
        small, big = step.small_scale, step.big_scale
        return Reading([unscale(part, small, big)] if part is not None else [],
                       preconditioned=[unscale(rank_p, small, big)] if rank_p is not None else None)

    def describe(self) -> str:
        return ("each rank's own gradient from hooks on the parameters, before a wrapper's "
                "all-reduce (b_small = per-worker batch)")


def _add(parts: dict[int, torch.Tensor], key: int, value: torch.Tensor) -> None:
    parts[key] = value if key not in parts else parts[key] + value


def _in_order(parts: dict[int, torch.Tensor], params: list[nn.Parameter]) -> torch.Tensor:
    """The sum of `parts` (float64, 0-d) in the order of `params`: the same sum whatever order
    the buckets brought them in."""
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=params[0].device)
    return torch.stack([parts[id(p)] for p in params if id(p) in parts]).sum()


class _Done:
    """A finished all-reduce (one restored from a checkpoint)."""

    def wait(self) -> bool:
        return True
