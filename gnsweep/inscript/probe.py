"""The noise probe inside a script's process: B_simple from the gradients training computes
anyway (eq. A.1-A.2), with no line of the script changed.

Installed by `boot/sitecustomize.py` once `torch.optim` is imported (`when_torch_optim`), it
patches `torch.optim.Optimizer` so that every optimizer's parameters are hooked as they are
given to it (`add_param_group`), and registers a global optimizer-step pre-hook:

- each backward pass of a measured step: a hook on each parameter keeps the gradient the pass
  computed, before it is accumulated into `.grad` (and before DDP all-reduces it), and at the
  pass's end (an autograd engine callback) the squared norms of the pass are summed: `|g_j|^2`
  of micro-batch j, up to the script's own scale. In one process a parameter whose `.grad` is
  still None is not kept: autograd then makes the pass's gradient its `.grad`, read there at
  the pass's end (held, autograd would have to copy it). After the step's last pass (a
  callback queued behind DDP's; once the passes a step are known, after that many only)
  `|.grad|^2` is the whole batch's `|G_big|^2` (under DDP, the all-reduced mean);
- each optimizer step closes the pair of eq. A.2: b_small = B / (the passes of the step over
  all ranks), b_big = B (the run's batch size, `{batch_size}`), `|G_small|^2` the mean over
  passes and ranks of `(passes of the rank)^2 |g_j|^2` (each pass adds its micro-batch's mean
  gradient over the passes of the step to `.grad`, whose final value is the batch mean), one
  small all-reduce under DDP;
- B_simple is `NoiseScaleEma`'s ratio of separately smoothed estimates (eq. 2.9), never an
  average of per-step ratios, never clamped;
- which steps are measured is `noise.every`'s `MeasureSchedule` (every k-th step, or auto);
  on the others the hooks return at their first check and the step only counts.

Every number is read before the script unscales or clips its gradients, so a factor common to
all of them (a loss divided by the passes, a loss scale) cancels in B_simple. A step the
script skips (a GradScaler's inf: `zero_grad` with passes and no step) is left out and still
counted, so that the probe's steps stay the script's. On the CPU the squared norms are numpy
dot products (about half the time of torch's reduction there on a small model's gradients),
summed as Python floats, a small fp32 model's in one dot over a buffer its gradients are
copied into (`FlatNorms`); on a device they stay tensors until the step, read with one sync.
It never raises into the script: an error turns it off, said once (under DDP every rank turns
off at the same step, so no rank waits in a collective alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.abc
import importlib.machinery
import json
import math
import os
import sys
from typing import Any

from gnsweep.noise import (
    AUTO_MAX_EVERY,
    EVERY_AUTO,
    MeasureSchedule,
    NoiseEstimate,
    NoiseScaleEma,
)

ENV = "GNSWEEP_NOISE_PROBE"
"""The probe's settings (JSON: rows, batch_size, accumulation, every, ema_*); absent: no
probe."""
RESUME_STEP = "GNSWEEP_RESUME_STEP"
"""The `{resume_step}` placeholder as gnsweep puts it in the script's environment: the last
step on record when the attempt started (0 on a first attempt)."""
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
        every = settings.get("every", 1)
        # pooled: the batch sizes whose median this run's B_simple is one of (noise.pooled).
        self.schedule = MeasureSchedule(every if every == EVERY_AUTO else int(every),
                                        max(1, int(settings.get("pooled", 1))))
        self.span = AUTO_MAX_EVERY if every == EVERY_AUTO else int(every)
        """The most steps a row stands for before the schedule measures again (the reader
        carries the last row's estimate that far)."""
        self.ema = NoiseScaleEma(ema_fraction=float(settings.get("ema_fraction", 0.2)),
                                 ema_steps=float(settings.get("ema_steps", 0.0)),
                                 ema_examples=float(settings.get("ema_examples", 2048.0)))
        self.resumed_at = _whole(os.environ.get(RESUME_STEP, ""))
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
        self.scheduled = True
        """This step is one the schedule measures (every rank alike: under DDP each one's
        all-reduce at the step depends on it)."""
        self.capturing = True
        """The hooks' gate: scheduled, and nothing broken."""
        self.saw_pass = False
        """A backward pass since the last step (measured or not): `zero_grad` then means a
        skipped step."""
        self.small: Any = 0.0
        """This step's sum over its passes of the squared norms (a float, or a tensor on a
        device until the step)."""
        self.count = 0
        """This step's backward passes that reached a hooked parameter."""
        self.pass_grads: list[Any] = []
        self.pass_params: list[Any] = []
        """This pass's gradients held, and their parameters."""
        self.fresh: list[Any] = []
        """This pass's parameters whose `.grad` was None: read from `.grad` at the pass's end."""
        self.in_pass = False
        self.big: Any = None
        self.expected: int | None = None
        """Passes a step, once two measured steps in a row had as many: `|.grad|^2` is read
        after that many only (a step with fewer is left out, and every pass is read again)."""
        self.last_count = 0
        self.since_examples = 0.0
        self.since_steps = 0
        """Examples and steps trained since the last measurement folded in (what it stands
        for in the EMA: `noise.every`, steps left out)."""
        self.world: int | None = None
        """The process group's size, read at the first backward pass (None before)."""
        self.dist: Any = None
        self.said: set[str] = set()
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.file: Any = None
        self.torch: Any = None
        self.engine: Any = None
        self.flat: FlatNorms | None = None
        self.flat_for = -1
        """How many parameters were hooked when `flat` was made (more since: made again)."""

    # ---- wiring ----------------------------------------------------------------------------

    def patch(self) -> None:
        """Hook `Optimizer.add_param_group` (every optimizer's parameters, as given),
        `Optimizer.zero_grad` (a step skipped) and a global step pre-hook."""
        import torch
        from torch.optim import optimizer as module

        self.torch, self.engine = torch, torch.autograd.Variable._execution_engine
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
            if probe.saw_pass:  # else nothing to tell: a step's zero_grad before its passes
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
                self.handles.append(p.register_hook(functools.partial(self._on_grad, p)))

    def _on_grad(self, param: Any, grad: Any) -> None:
        """A parameter's gradient of this backward pass, before it is accumulated."""
        if not self.capturing:  # a step not measured (or broken): only that a pass ran
            self.saw_pass = True
            return
        try:
            if not self.in_pass:
                self.in_pass = self.saw_pass = True
                if self.world is None:
                    self.world, self.dist = _world()
                self.engine.queue_callback(self._pass_ended)
            if param.grad is None and self.world == 1:
                # Autograd will make this gradient `.grad` (taking the tensor where it can):
                # read there at the pass's end. Held here, it would be copied instead.
                self.fresh.append(param)
            else:
                # Kept, not measured here: the pass's end takes every norm at once (a kernel
                # and a Python call a parameter cost 1.5x a small model's step). It is added
                # into `.grad`, so nothing writes to it before then.
                self.pass_grads.append(grad)
                self.pass_params.append(param)
        except Exception as err:
            self.fail(err)

    def _pass_ended(self) -> None:
        """End of a backward pass (the engine's callback): its squared norm; then, from a
        callback queued behind DDP's (which averages `.grad` over the ranks), `|.grad|^2`."""
        try:
            self.in_pass = False
            grads, params = self.pass_grads, self.pass_params
            self.pass_grads, self.pass_params = [], []
            if self.fresh:
                for p in self.fresh:
                    if p.grad is not None:
                        grads.append(p.grad)
                        params.append(p)
                self.fresh = []
            if grads:
                self.small = self.small + self._sq_sum(params, grads)
                self.count += 1
            if self.expected is None or self.count >= self.expected:
                self.engine.queue_callback(self._after_pass)
        except Exception as err:
            self.fail(err)

    def _after_pass(self) -> None:
        # After the pass, not at the step: the script may unscale or clip `.grad` in place
        # before its step (a GradScaler's unscale leaves no trace in the tensors' version
        # counters), and the pair must be read in the passes' own scale. Once two steps in a
        # row had the same passes, only from the last expected one on (`expected`).
        try:
            params = [p for p in self.params.values() if p.grad is not None]
            self.big = self._sq_sum(params, [p.grad for p in params]) if params else None
        except Exception as err:
            self.fail(err)

    def _sq_sum(self, params: list[Any], grads: list[Any]) -> Any:
        """The squared norm of `grads` (those of `params`): in one dot where the model is
        small and on the CPU (`FlatNorms`), else tensor by tensor."""
        if self.flat_for != len(self.params):
            self.flat_for = len(self.params)
            self.flat = FlatNorms.make(self.torch, list(self.params.values()))
        if self.flat is not None:
            try:
                return self.flat.sq_sum(params, grads)
            except (RuntimeError, TypeError, ValueError, KeyError):  # a sparse gradient...
                self.flat = None  # tensor by tensor from now on
        return _sq_sum(self.torch, grads)

    # ---- steps -----------------------------------------------------------------------------

    def skipped(self, optimizer: Any) -> None:
        """`zero_grad` with backward passes since the last step and no step: a step the script
        skipped (a GradScaler's inf), left out and counted."""
        if self.saw_pass and not self.in_pass and optimizer is (self.primary or optimizer) \
                and id(optimizer) in self.optimizers:
            self.steps += 1
            self._clear()
            self._advance(False)  # no update: the EMA's clock (examples trained) stands

    def _clear(self) -> None:
        self.small, self.count, self.big, self.saw_pass = 0.0, 0, None, False

    def _advance(self, measured: bool) -> None:
        """The schedule's decision for the next step (`noise.every`)."""
        self.schedule.advance(measured, self.ema, self.since_examples, self.batch)
        self.scheduled = self.schedule.next
        self.capturing = self.scheduled and self.broken is None

    def _start(self, optimizer: Any) -> bool:
        """The process's first step: the optimizer it measures, and the script's step before
        it (False: the probe cannot tell it, and is off)."""
        self.primary = optimizer
        self.base = _optimizer_steps(optimizer)
        if self.base == 0 and self.resumed_at > 0:
            self.off(f"the script resumed (the last step on record is {self.resumed_at}) and "
                     "its optimizer keeps no count of its steps (plain SGD, or a state not "
                     "restored): the probe cannot tell which step it is at, so this attempt is "
                     "not measured (its rows' B_simple is NaN; an optimizer with a step count, "
                     "such as Adam's, is measured on a resume)", error=False)
            return False
        self.ema.seen_examples = self.base * self.batch
        # Steps counted from the script's first: noise.every=k measures steps 1, k+1, ...
        # of the run whichever attempt takes them (the process's first is always measured).
        self.schedule.steps = self.base + self.steps
        return True

    def before_step(self, optimizer: Any) -> None:
        """Close this step's pair (eq. A.2) if the schedule measured it, fold it into the
        EMAs and write its row; then decide the next step."""
        if id(optimizer) not in self.optimizers:
            return
        if self.primary is None:
            if not self._start(optimizer):
                return
        elif optimizer is not self.primary:
            self.off("the script steps more than one optimizer; the probe measures a script "
                     "with one")
            return
        self.steps += 1
        self.since_examples += self.batch
        self.since_steps += 1
        scheduled, small, count, big = self.scheduled, self.small, self.count, self.big
        self._clear()
        folded = False
        if scheduled:
            self.expected = count if count == self.last_count and count else None
            self.last_count = count
            folded = self._close(small, count, big)
        if self.on:
            self._advance(folded)

    def _close(self, small: Any, own: int, big: Any) -> bool:
        """The pair of a measured step, folded into the EMAs and written: True if it was."""
        world, dist = (self.world, self.dist) if self.world is not None else _world()
        ok = self.broken is None and big is not None and own > 0
        if world > 1:
            torch = self.torch
            device = big.device if isinstance(big, torch.Tensor) else \
                next(iter(self.params.values())).device
            values = [small * own * own, own, 1.0, 0.0, big] if ok else \
                [0.0, 0.0, 0.0, float(self.broken is not None), 0.0]
            pack = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device)
                                for v in values])
            dist.all_reduce(pack)
            total_sq, total, oks, broken, big_sum = pack.tolist()
            if broken:
                self.off(self.broken or "another rank's probe failed")
                return False
            if oks < world:
                return False
            sq_big = big_sum / world  # the same on every rank: so are the EMAs and `every`
        elif not ok:
            if self.broken is not None:
                self.off(self.broken)
            return False
        else:
            small_f, sq_big = _floats(self.torch, small, big)  # one device sync at most
            total_sq, total = small_f * own * own, float(own)
        if total < 2:
            self.one_pass += 1
            if self.one_pass >= CANNOT_MEASURE_AFTER:
                self.off("each optimizer step had one backward pass, in one process: no "
                         "second batch size to compare (set task.accumulation=k with a script "
                         "that accumulates k micro-batches a step, or run it under "
                         "executor=torchrun); B_simple is NaN", error=False)
            return False
        if self.declared > 1 and total not in (self.declared, self.declared * world):
            self.say("declared", f"task.accumulation={self.declared}, but the script ran "
                     f"{total:g} backward passes a step over {world} process(es): b_small is "
                     f"B / {total:g}, from what it ran")
        sq_small = total_sq / total
        if not (math.isfinite(sq_big) and math.isfinite(sq_small)):
            return False  # an overflow the script did not skip: left out
        # The share of training this measurement stands for, in steps' worth (1 when every
        # step is measured): the window averages over training progress (as the monitor).
        weight = self.since_examples / self.batch
        estimate = self.ema.update(sq_small, sq_big, self.batch / total, self.batch,
                                   examples=self.since_examples, steps=self.since_steps,
                                   weight=max(weight, 1.0))
        self.since_examples, self.since_steps = 0.0, 0
        self.measured += 1
        self.write({"step": self.base + self.steps, "span": self.span,
                    **{k: v for k, v in vars(estimate).items() if v == v or k in _REQUIRED}})
        return True

    # ---- output ----------------------------------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        """One JSON line to the rows file (rank 0 only), on disk before the step is taken:
        the runner may end the script at any row it prints after it."""
        if self.rank != 0:
            return
        if self.file is None:  # one write call a line, appended whole: no buffer to lose
            self.file = os.open(self.rows_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self.file, _json_line(record))

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
            self.capturing = False
            return
        self.off(why)

    def off(self, why: str, error: bool = True) -> None:
        """Remove every hook and say why, once."""
        if not self.on:
            return
        self.on = self.capturing = False
        for handle in self.handles:
            with contextlib.suppress(Exception):
                handle.remove()
        self.handles, self.pass_grads, self.pass_params, self.fresh = [], [], [], []
        self._clear()
        self.say("off", why if not error or "probe" in why else f"not measured: {why}")


FLAT_MAX = 1 << 20
"""`FlatNorms` serves a model of at most this many parameters (4 MiB in fp32); a larger one's
reads are bound by memory, where a copy would add to them."""


class FlatNorms:
    """The squared norm of a small CPU fp32 model's gradients as one dot: they are copied (one
    foreach call) into their parameters' places in one buffer. On a small model the Python call
    a tensor costs, not the arithmetic, is a read's time: 6 tensors read in about a third of
    the time tensor by tensor."""

    def __init__(self, torch: Any, params: list[Any]) -> None:
        self.torch = torch
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
        self.array = self.buffer.numpy()
        self.views: dict[int, Any] = {}
        offset = 0
        for p in params:
            self.views[id(p)] = self.buffer[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()

    @classmethod
    def make(cls, torch: Any, params: list[Any]) -> FlatNorms | None:
        """One for `params` where each is a dense fp32 CPU tensor and they are few enough;
        else None."""
        if not params or sum(p.numel() for p in params) > FLAT_MAX or not all(
                p.is_cpu and p.dtype is torch.float32 and p.layout is torch.strided
                for p in params):
            return None
        return cls(torch, params)

    def sq_sum(self, params: list[Any], grads: list[Any]) -> float:
        """The squared norm of `grads`, those of `params` (each at most once)."""
        if len(params) < len(self.views):
            self.buffer.zero_()  # a parameter without a gradient this time counts 0
        self.torch._foreach_copy_([self.views[id(p)] for p in params], grads)
        return float(self.array.dot(self.array))


_REQUIRED = frozenset(f.name for f in dataclasses.fields(NoiseEstimate)
                     if f.default is dataclasses.MISSING)
"""The estimate's fields a row always has; the others are left out where NaN (the reader
fills them in): fewer numbers to format on a measured step."""
_JSON_NUMBER = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _json_line(record: dict[str, Any]) -> bytes:
    """`record` (numbers, or a string note) as one JSON line, as `json.dumps` writes it with
    NaN allowed; numbers formatted by hand: on a small model's step, json.dumps of a row costs
    as much as a quarter of the probe's work."""
    if any(isinstance(v, str) for v in record.values()):
        return (json.dumps(record, allow_nan=True) + "\n").encode()
    parts = []
    for key, value in record.items():
        text = "NaN" if value != value else _JSON_NUMBER.get(value) or repr(value)
        parts.append(f'"{key}": {text}')
    return ("{" + ", ".join(parts) + "}\n").encode()


def _sq_sum(torch: Any, grads: list[Any]) -> Any:
    """Sum of the squared norms of `grads` (non-empty), accumulated in at least fp32: a float
    where every one is on the CPU in fp32/fp64 (numpy's dot: no tensor made, about half the
    time of torch's reduction on a small model), else a 0-d tensor on their device (one
    foreach call)."""
    total = 0.0
    rest = []
    single, double = torch.float32, torch.float64
    for g in grads:
        # Half precisions stay with torch: numpy would accumulate in their own, and overflow
        # under a loss scale.
        if g.is_cpu and (g.dtype is single or g.dtype is double) and g.layout is torch.strided:
            try:  # no detach: a gradient needs none (a tenth of this call's time on a small model)
                flat = g.numpy().reshape(-1)
            except (RuntimeError, TypeError, ValueError):  # a torch without numpy, or a
                rest.append(g)  # gradient that requires grad (create_graph): torch reads it
                continue
            total += float(flat.dot(flat))
        else:
            rest.append(g)
    if not rest:
        return total
    try:
        norms = torch._foreach_norm(rest, 2, dtype=torch.float32)
    except (RuntimeError, TypeError):  # an older torch, or tensors it cannot group
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in rest]
    device = rest[0].device  # a model spread over devices: summed on its first
    return torch.stack([n.to(device) for n in norms]).square().sum() + total


def _floats(torch: Any, *values: Any) -> list[float]:
    """`values` (floats or 0-d tensors) as floats, with one device sync for all tensors."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    # fp32, as they were summed (a device without fp64, such as MPS, reads them too)
    read = iter(torch.stack([t.float().to(tensors[0].device) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def _whole(text: str) -> int:
    """An environment variable's whole number (0 where absent or not one)."""
    try:
        return int(text)
    except ValueError:
        return 0


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
