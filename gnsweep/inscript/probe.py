"""The noise probe inside a script's process: B_simple from the gradients training computes
anyway (eq. A.1-A.2), with no line of the script changed.

Installed by `boot/sitecustomize.py` once `torch.optim` is imported (`when_torch_optim`), it
patches `torch.optim.Optimizer` so that every optimizer's parameters are hooked as they are
given to it (`add_param_group`), and registers a global optimizer-step pre-hook:

- each backward pass: a hook on each parameter reads the gradient the pass computed, before
  it is accumulated into `.grad` (and before DDP all-reduces it), and adds its squared norm:
  `|g_j|^2` of micro-batch j, up to the script's own scale (the norms of a pass in one foreach
  call at its end); after the step's last pass (an autograd engine callback queued behind
  DDP's own; once the passes a step are known, after that many only) `|.grad|^2` is the whole
  batch's `|G_big|^2` (under DDP, the all-reduced mean);
- each optimizer step closes the pair of eq. A.2: b_small = B / (the passes of the step over
  all ranks), b_big = B (the run's batch size, `{batch_size}`), `|G_small|^2` the mean over
  passes and ranks of `(passes of the rank)^2 |g_j|^2` (each pass adds its micro-batch's mean
  gradient over the passes of the step to `.grad`, whose final value is the batch mean), one
  scalar all-reduce under DDP;
- B_simple is `NoiseScaleEma`'s ratio of separately smoothed estimates (eq. 2.9), never an
  average of per-step ratios, never clamped.

Every number is read before the script unscales or clips its gradients, so a factor common to
all of them (a loss divided by the passes, a loss scale) cancels in B_simple. A step the
script skips (a GradScaler's inf: `zero_grad` with passes and no step) is left out and still
counted, so that the probe's steps stay the script's. It never raises into the script: an
error turns it off, said once (under DDP every rank turns off at the same step, so no rank
waits in a collective alone).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import json
import math
import os
import sys
from typing import Any

from gnsweep.noise import NoiseScaleEma

ENV = "GNSWEEP_NOISE_PROBE"
"""The probe's settings (JSON: rows, batch_size, accumulation, ema_*); absent: no probe."""
CANNOT_MEASURE_AFTER = 2
"""Steps with one backward pass in one process after which the probe removes its hooks: such a
script has no second batch size to compare (B_simple NaN, said once)."""

_PROBE: Probe | None = None


def when_torch_optim(settings: str) -> None:
    """Install the probe now if `torch.optim` is loaded, else as soon as it is."""
    if "torch.optim.optimizer" in sys.modules:
        install(settings)
    else:
        sys.meta_path.insert(0, _Watch(settings))


class _Watch(importlib.abc.MetaPathFinder):
    """Finds `torch.optim.optimizer` like the path finder and runs `install` right after the
    module is executed (torch imports it while it is imported itself)."""

    def __init__(self, settings: str) -> None:
        self.settings = settings

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.optim.optimizer":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run, settings = loader.exec_module, self.settings

        def exec_module(module: Any) -> None:
            run(module)
            install(settings)

        loader.exec_module = exec_module
        return spec


def install(settings: str) -> Probe | None:
    """The process's probe, hooked into `torch.optim` (once); None where it cannot start
    (said on stderr)."""
    global _PROBE
    if _PROBE is None:
        try:
            _PROBE = Probe(json.loads(settings))
            _PROBE.patch()
        except Exception as err:  # never into the script
            sys.stderr.write(f"gnsweep: noise scale not measured: the probe could not start "
                             f"({err!r})\n")
            return None
    return _PROBE


class Probe:
    """The hooks, this step's numbers, the EMAs and the rows file of one process."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.rows_path = str(settings["rows"])
        self.batch = float(settings["batch_size"])
        self.declared = int(settings.get("accumulation", 1))
        self.ema = NoiseScaleEma(ema_fraction=float(settings.get("ema_fraction", 0.2)),
                                 ema_steps=float(settings.get("ema_steps", 0.0)),
                                 ema_examples=float(settings.get("ema_examples", 2048.0)))
        self.on = True
        self.broken: str | None = None
        self.params: dict[int, Any] = {}
        self.optimizers: set[int] = set()
        """ids of the optimizers whose parameters are hooked: another one's step is not this
        probe's (an optimizer built before the probe started)."""
        self.handles: list[Any] = []
        self.primary: Any = None
        self.base = 0
        """The optimizer's own count of steps before this process's first (a resumed run)."""
        self.steps = 0
        """Steps this process took or skipped."""
        self.measured = 0
        self.one_pass = 0
        self.passes: list[Any] = []
        """This step's backward passes: each one's gradient norms, a tensor a parameter."""
        self.pass_grads: list[Any] = []
        self.in_pass = False
        self.big: Any = None
        self.expected: int | None = None
        """Passes a step, once two steps in a row had as many: `|.grad|^2` is read after that
        many only (a step with fewer is left out, and every pass is read again)."""
        self.last_count = 0
        self.said: set[str] = set()
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.file: Any = None

    # ---- wiring ----------------------------------------------------------------------------

    def patch(self) -> None:
        """Hook `Optimizer.add_param_group` (every optimizer's parameters, as given),
        `Optimizer.zero_grad` (a step skipped) and a global step pre-hook."""
        from torch.optim import optimizer as module

        cls = module.Optimizer
        add, zero = cls.add_param_group, cls.zero_grad
        probe = self

        @functools.wraps(add)
        def add_param_group(optimizer: Any, group: Any) -> Any:
            out = add(optimizer, group)
            probe._guard(probe.watch, optimizer)
            return out

        @functools.wraps(zero)
        def zero_grad(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            probe._guard(probe.skipped, optimizer)
            return zero(optimizer, *args, **kwargs)

        cls.add_param_group = add_param_group  # type: ignore[method-assign,assignment]
        cls.zero_grad = zero_grad  # type: ignore[method-assign,assignment]
        module.register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: self._guard(self.before_step, optimizer))

    def _guard(self, fn: Any, *args: Any) -> None:
        if not self.on:
            return
        try:
            fn(*args)
        except Exception as err:
            self.fail(err)

    def watch(self, optimizer: Any) -> None:
        """Hook each trainable parameter of `optimizer` not hooked yet."""
        self.optimizers.add(id(optimizer))
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in self.params or not getattr(p, "requires_grad", False):
                    continue
                kind = type(p).__name__
                if kind == "DTensor" or getattr(p, "_is_flat_param", False) or \
                        getattr(p, "is_sparse", False):
                    self.off(f"the optimizer's parameters are {kind} shards or sparse (FSDP): "
                             "their gradients are no batch's gradient")
                    return
                self.params[id(p)] = p
                self.handles.append(p.register_hook(self._on_grad))

    def _on_grad(self, grad: Any) -> None:
        """A parameter's gradient of this backward pass, before it is accumulated."""
        if not self.on or self.broken is not None:
            return
        try:
            import torch

            if not self.in_pass:
                self.in_pass = True
                torch.autograd.Variable._execution_engine.queue_callback(self._pass_ended)
            # Kept, not measured here: the pass's end takes every norm in one foreach call
            # (a kernel and a Python call a parameter cost 1.5x a small model's step). Held,
            # the tensor is copied into `.grad`, not taken as it, so nothing writes to it
            # before then; the copy lives until the pass ends.
            self.pass_grads.append(grad)
        except Exception as err:
            self.fail(err)

    def _pass_ended(self) -> None:
        """End of a backward pass (the engine's callback): its squared norm; then, from a
        callback queued behind DDP's (which averages `.grad` over the ranks), `|.grad|^2`."""
        try:
            import torch

            self.in_pass = False
            grads, self.pass_grads = self.pass_grads, []
            if grads:  # summed at the step, with the other passes' (fewer small ops)
                self.passes.append(_norms(grads))
            if self.expected is None or len(self.passes) >= self.expected:
                torch.autograd.Variable._execution_engine.queue_callback(self._after_pass)
        except Exception as err:
            self.fail(err)

    def _after_pass(self) -> None:
        # After the pass, not at the step: the script may unscale or clip `.grad` in place
        # before its step (a GradScaler's unscale leaves no trace in the tensors' version
        # counters), and the pair must be read in the passes' own scale. Once two steps in a
        # row had the same passes, only from the last expected one on (`expected`).
        try:
            self.big = _sq_sum(self._grads())
        except Exception as err:
            self.fail(err)

    def _grads(self) -> list[Any]:
        return [p.grad for p in self.params.values() if p.grad is not None]

    # ---- steps -----------------------------------------------------------------------------

    def skipped(self, optimizer: Any) -> None:
        """`zero_grad` with backward passes since the last step and no step: a step the script
        skipped (a GradScaler's inf), left out and counted."""
        if self.passes and not self.in_pass and optimizer is (self.primary or optimizer) \
                and id(optimizer) in self.optimizers:
            self.steps += 1
            self._clear()

    def _clear(self) -> None:
        self.passes, self.big = [], None

    def before_step(self, optimizer: Any) -> None:
        """Close this step's pair (eq. A.2) and fold it into the EMAs; a row to the file."""
        import torch

        if id(optimizer) not in self.optimizers:
            return
        if self.primary is None:
            self.primary = optimizer
            self.base = _optimizer_steps(optimizer)
            self.ema.seen_examples = self.base * self.batch
        elif optimizer is not self.primary:
            self.off("the script steps more than one optimizer; the probe measures a script "
                     "with one")
            return
        self.steps += 1
        passes, big = self.passes, self.big
        self._clear()
        self.expected = len(passes) if len(passes) == self.last_count and passes else None
        self.last_count = len(passes)
        world, dist = _world()
        ok = self.broken is None and big is not None and bool(passes)
        own = float(len(passes))
        local: Any = None
        if ok:  # every pass of this rank has the factor own^2: one sum over all their norms
            local = torch.stack([n for norms in passes for n in norms]).square().sum() \
                * own * own
        if world > 1:
            device = big.device if big is not None else next(iter(self.params.values())).device
            pack = torch.stack([local.double().to(device) if ok else
                                torch.zeros((), dtype=torch.float64, device=device),
                                torch.tensor(own if ok else 0.0, dtype=torch.float64,
                                             device=device),
                                torch.tensor(1.0 if ok else 0.0, dtype=torch.float64,
                                             device=device),
                                torch.tensor(0.0 if self.broken is None else 1.0,
                                             dtype=torch.float64, device=device)])
            dist.all_reduce(pack)
            total_sq, total, oks, broken = pack.tolist()
            if broken:
                self.off(self.broken or "another rank's probe failed")
                return
            if oks < world:
                return
        elif not ok:
            if self.broken is not None:
                self.off(self.broken)
            return
        else:
            total_sq, total = float(local), own
        if total < 2:
            self.one_pass += 1
            if self.one_pass >= CANNOT_MEASURE_AFTER:
                self.off("each optimizer step had one backward pass, in one process: no "
                         "second batch size to compare (set task.accumulation=k with a script "
                         "that accumulates k micro-batches a step, or run it under "
                         "executor=torchrun); B_simple is NaN", error=False)
            return
        if self.declared > 1 and total not in (self.declared, self.declared * world):
            self.say("declared", f"task.accumulation={self.declared}, but the script ran "
                     f"{total:g} backward passes a step over {world} process(es): b_small is "
                     f"B / {total:g}, from what it ran")
        sq_big = float(big)
        sq_small = total_sq / total
        if not (math.isfinite(sq_big) and math.isfinite(sq_small)):
            return  # an overflow the script did not skip: left out
        estimate = self.ema.update(sq_small, sq_big, self.batch / total, self.batch,
                                   examples=self.batch)
        self.measured += 1
        self.write({"step": self.base + self.steps, **vars(estimate)})

    # ---- output ----------------------------------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        """One JSON line to the rows file (rank 0 only)."""
        if self.rank != 0:
            return
        if self.file is None:
            self.file = open(self.rows_path, "a", encoding="utf-8")  # noqa: SIM115
        self.file.write(json.dumps(record, allow_nan=True) + "\n")
        self.file.flush()

    def say(self, key: str, text: str) -> None:
        """Once per process: on stderr and, for the runner, in the rows file."""
        if key in self.said:
            return
        self.said.add(key)
        with contextlib.suppress(Exception):
            if self.rank == 0:
                sys.stderr.write(f"gnsweep: noise scale: {text}\n")
                self.write({"note": text})

    def fail(self, err: BaseException) -> None:
        """An error in a hook: off (under DDP at the next step, with every rank)."""
        why = f"the in-script probe failed ({err!r}) and turned itself off; the script runs on"
        world, _ = _world() if self.on else (1, None)
        if world > 1 and self.broken is None:
            self.broken = why
            return
        self.off(why)

    def off(self, why: str, error: bool = True) -> None:
        """Remove every hook and say why, once."""
        if not self.on:
            return
        self.on = False
        for handle in self.handles:
            with contextlib.suppress(Exception):
                handle.remove()
        self.handles, self.passes, self.pass_grads = [], [], []
        self.say("off", why if not error or "probe" in why else f"not measured: {why}")


def _norms(grads: list[Any]) -> Any:
    """The norms of `grads` (fp32 whatever their dtype), in one foreach call where it can."""
    import torch

    try:
        return torch._foreach_norm(grads, 2, dtype=torch.float32)
    except (RuntimeError, TypeError):  # an older torch, or tensors it cannot group
        return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]


def _sq_sum(grads: list[Any]) -> Any:
    """Sum of the squared norms of `grads`."""
    import torch

    return torch.stack(list(_norms(grads))).square().sum() if grads else None


def _world() -> tuple[int, Any]:
    """(world size, torch.distributed): 1 outside an initialised process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist
    return 1, dist


def _optimizer_steps(optimizer: Any) -> int:
    """The steps an optimizer has taken by its own state (Adam's `step`, restored with a
    checkpoint); 0 where it keeps no count (plain SGD)."""
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if step is not None:
            with contextlib.suppress(TypeError, ValueError):
                return int(float(step))
    return 0
