"""Per-worker gradient norms under DistributedDataParallel (b_small = per-worker batch, b_big =
global batch) from a communication hook; one scalar all-reduce per measured step, overlapped
with the next step."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from gnsweep.measure.common import Gate, grad_sq_norm, sq
from gnsweep.noise import NormPair


class DdpHook:
    """Reads each worker's gradient in DDP's buckets before the all-reduce.

    With a registered hook DDP no longer divides by the world size: the hook does. Buckets are
    rebuilt after the first step; summing squared norms over whatever buckets pass through is
    indifferent to that.
    """

    def __init__(self, model: nn.Module) -> None:
        import torch.distributed as dist

        self.owner: Gate | None = None
        """The monitor measuring through this hook now (None: all-reduce only)."""
        self.group = getattr(model, "process_group", None)
        self.world = dist.get_world_size(self.group)
        self.local_sq: torch.Tensor | None = None
        self.measured: set[int] | None = None
        """ids of the measured parameters (None: all)."""
        self.pending: tuple[Any, torch.Tensor] | None = None
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
        every = {id(p) for p in model.parameters() if p.requires_grad}
        ids = {id(p) for p in measured}
        hook.measured = None if ids == every else ids
        hook.reset()
        return hook

    def reset(self) -> None:
        self.local_sq = None

    def _hook(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        import torch.distributed as dist

        buffer = bucket.buffer()
        if self.owner is not None and self.owner.capturing:
            if self.measured is None:
                local = sq(buffer.float())
            else:
                local = buffer.new_zeros((), dtype=torch.float32)
                for p, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                    if id(p) in self.measured:
                        local = local + sq(grad.float())
            self.local_sq = local if self.local_sq is None else self.local_sq + local
        buffer.div_(self.world)
        future = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
        return future.then(lambda fut: fut.value()[0])

    def measure(self, hess: NormPair | None, examples: int, params: list[nn.Parameter],
                unscale: float = 1.0) -> tuple[list[NormPair], NormPair | None]:
        """Start this step's one scalar all-reduce (worker norms, example counts, Hessian
        norms) and return the previous one's result: the reduction overlaps the next step.
        `unscale` multiplies this step's squared gradient norms (1 / the loss scale^2)."""
        import torch.distributed as dist

        done = self.collect()
        local = self.local_sq if self.local_sq is not None else params[0].new_zeros(())
        h_small, h_big, hb_small, hb_big = hess if hess is not None else (0.0, 0.0, 0.0, 0.0)
        scalars = [float(examples), float(self.local_sq is not None),
                   h_small, h_big, hb_small, hb_big, float(hess is not None)]
        # |G_big|^2 is the same on every worker (after the all-reduce): it rides along.
        big = grad_sq_norm(params).to(local.device).reshape(1)
        pack = torch.cat([local.double().reshape(1) * unscale, big * unscale,
                          torch.tensor(scalars, dtype=torch.float64, device=local.device)])
        work = dist.all_reduce(pack, group=self.group, async_op=True)
        self.pending = (work, pack)
        return done

    def pending_state(self) -> list[float] | None:
        """The pending all-reduce's result (waited for), or None: what a checkpoint taken
        between two steps holds so that the resumed run folds it in at its next measurement."""
        if self.pending is None:
            return None
        work, pack = self.pending
        work.wait()
        return [float(v) for v in pack.tolist()]

    def load_pending(self, values: list[float] | None, device: torch.device) -> None:
        """Restore `pending_state()`: the next `collect` returns it."""
        self.pending = None if values is None else (
            _Done(), torch.tensor(values, dtype=torch.float64, device=device))

    def collect(self) -> tuple[list[NormPair], NormPair | None]:
        """Wait for the pending all-reduce, if any; its (parts, Hessian norms)."""
        if self.pending is None:
            return [], None
        work, pack = self.pending
        self.pending = None
        work.wait()
        w = float(self.world)
        sq_small, sq_big, examples, have, *hessian, have_hessian = (v / w for v in pack.tolist())
        parts = [NormPair(sq_small, sq_big, examples, examples * w)] if have == 1 else []
        # Every worker measured the same batch pair: their H-norms are averaged.
        return parts, (NormPair(*hessian) if have_hessian == 1 else None)


class RankGrads:
    """Each rank's own gradient (b_small = this rank's examples of the step) under a data-parallel
    wrapper the monitor cannot hook (the Trainers' DDP, accelerate): a hook on each measured
    parameter sees the gradient of this backward before it is accumulated into `.grad` and
    all-reduced, and `.grad` still holds this rank's own sum of the step's earlier micro-batches
    (they run without synchronisation), so `|.grad + grad|^2` is this rank's squared norm so far.
    After the step's last backward `.grad` is the global mean: |G_big|^2 (b_big = all ranks'
    examples). One scalar all-reduce per measured step, at `measure()`, which every rank must
    reach at the same steps."""

    def __init__(self, gate: Gate, params: list[nn.Parameter]) -> None:
        self.gate = gate
        self.params = params
        self.handles = [p.register_hook(self._hook_for(i)) for i, p in enumerate(params)]
        self.reset()

    def reset(self) -> None:
        self.local: dict[int, torch.Tensor] = {}

    def _hook_for(self, i: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self.gate.capturing:
                before = self.params[i].grad
                total = grad.float() if before is None else before.float() + grad.float()
                self.local[i] = sq(total)
        return hook

    def measure(self, examples: int) -> NormPair | None:
        import torch.distributed as dist

        device = self.params[0].device
        local = torch.stack(list(self.local.values())).sum().double() if self.local \
            else torch.zeros((), dtype=torch.float64, device=device)
        pack = torch.stack([local.to(device), torch.tensor(float(examples),
                                                           dtype=torch.float64, device=device),
                            torch.tensor(float(bool(self.local)), dtype=torch.float64,
                                         device=device)])
        dist.all_reduce(pack)
        world = dist.get_world_size()
        sq_small, examples_all, have = pack.tolist()
        if have < world or examples_all <= examples_all / world:
            return None
        big = float(grad_sq_norm(self.params))
        return NormPair(sq_small / world, big, examples_all / world, examples_all)


class _Done:
    """A finished all-reduce (one restored from a checkpoint)."""

    def wait(self) -> bool:
        return True
