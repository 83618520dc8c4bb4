"""The choice of method of `NoiseScaleMonitor(method="auto", timed_auto=True)`: between
per-example norms and micro-batches, where both measure the model right, the cheaper by
`cheaper_method` after the first measured step (micro-batches where the step is cut into them
anyway: layers without per-example norms, or an adaptive optimizer's preconditioned pair
where some layer has no P-weighted per-example norms,
`gnsweep.measure.per_example.preconditioned_norms`; else the crossovers `MICROBATCH_FROM` and
`SEQUENCE_MICROBATCH_TOKENS`), its next `TIMED_STEPS` measured steps timed; and the fallbacks
(a batch that cannot be cut, layers per-example norms cannot attribute to examples).

The numbers behind the crossovers (`gnsweep bench noise`) are in docs/noise.md, "The
crossovers of method auto".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from gnsweep.measure.common import Gate, say_once
from gnsweep.measure.microbatch import Increments
from gnsweep.measure.per_example import PerExample
from gnsweep.measure.source import InUse
from gnsweep.noise import Method

MICROBATCH_FROM = 192
"""`timed_auto`: from this batch on, a model with convolutions is measured with micro-batches
(`cheaper_method`); the bench's numbers: docs/noise.md, "The crossovers of method auto"."""
SEQUENCE_MICROBATCH_TOKENS = 3072
"""`timed_auto`: the same for a model with sequence layers (Linear, transformers' Conv1D,
Embedding over positions), from this many tokens a batch (batch x positions per example): the
crossover is a number of tokens, not of examples (docs/noise.md, "The crossovers of method
auto")."""
CONVOLUTIONS = ("Conv1d", "Conv2d")
TIMED_STEPS = 3
"""`timed_auto`: measured steps timed after the choice (the fastest is reported)."""
FALLBACK_METHOD = "per_example"
"""What a monitor measures with when the batch cannot be cut into micro-batches."""

Candidates = dict[str, tuple[PerExample | None, Increments | None]]
"""`timed_auto`'s two ways to measure, by method: (per-example source, micro-batch source)."""


def cheaper_method(positional: list[str], batch: int, rest: bool, positions: int,
                   split: bool = False, in_hooks: bool = False) -> tuple[str, str]:
    """(per_example or microbatch, why) for a model both measure right: micro-batches where
    per-example norms need them anyway (`rest`: layers without per-example norms; `split`:
    each measured step is cut into micro-batches anyway, for the preconditioned pair of an
    adaptive optimizer, where some measured parameter's layer has no P-weighted per-example
    norms (`PerExample.preconditions` false: parameters tied across layers, nn.MultiheadAttention
    measured whole, parameters left to micro-batches); the hooks then only add), or where
    some layer's per-example norm needs per-position work (`positional`: its kinds) and the
    batch is large enough for micro-batches to cost less: at least `MICROBATCH_FROM` examples
    with convolutions, or at least `SEQUENCE_MICROBATCH_TOKENS` tokens (batch x `positions`,
    the most positions per example of a sequence layer) with sequence layers, or with any such
    layer where the hooks weigh by an adaptive optimizer's P themselves (`in_hooks`: their
    P-norms have no Gram form, so each of these layers builds its explicit per-example
    gradients, and the bench's sequence models cost more so than with the split: docs/noise.md,
    "Adam's noise scale"); else per-example norms (under an adaptive optimizer too, where no
    layer needs per-position work: a linear layer's P-norms on rows need no per-example
    gradient)."""
    if rest:
        return "microbatch", "layers without per-example norms need micro-batches anyway"
    if split:
        return "microbatch", ("the optimizer's preconditioned noise scale (b_simple_precond) "
                              "needs each measured step in micro-batches anyway, and "
                              "per-example hooks would only add to them")
    if not positional:
        return "per_example", "no layer needs per-position work for its per-example norms"
    kinds = ", ".join(positional)
    if in_hooks:
        return "microbatch", (f"{kinds} need per-position work, and explicit per-example "
                              "gradients for the optimizer's preconditioned noise scale "
                              "(b_simple_precond): micro-batches cost less")
    sizes = []  # (unit, size, where micro-batches start to cost less)
    if set(positional) & set(CONVOLUTIONS):
        sizes.append(("batch", batch, MICROBATCH_FROM))
    if set(positional) - set(CONVOLUTIONS):
        sizes.append(("tokens", batch * max(positions, 1), SEQUENCE_MICROBATCH_TOKENS))
    for unit, size, start in sizes:
        if size >= start:
            return "microbatch", (f"{kinds} need per-position work for per-example norms, and "
                                  f"at {unit} {size} >= {start} micro-batches cost less")
    said = ", ".join(f"{unit} {size} < {start}" for unit, size, start in sizes)
    return "per_example", (f"{kinds} need per-position work for per-example norms, but at "
                           f"{said} they cost less than micro-batches")




class AutoChoice:
    """The choice of method, a part `NoiseScaleMonitor` holds (`monitor.auto`): `timed_auto`'s
    choice after the first measured step, `auto`'s move to micro-batches for layers
    per-example norms cannot attribute, and the fallback for a batch that cannot be cut. It
    changes what the monitor measures with (`in_use`: the method, its sources and hooks, shared
    with the monitor) and is told everything else it needs.

    `timed_auto` (with `method="auto"`, for a loop that splits its batch when
    `needs_microbatches` says so, as gnsweep's does): where both per-example norms and
    micro-batches measure this model right (one process, no batch statistics), the first
    measured step uses per-example norms, whose hooks see each layer's shapes; from then on the
    cheaper by `cheaper_method` (a rule `gnsweep bench noise` justifies) is kept (`choice`),
    and its next `TIMED_STEPS` measured steps are timed, from the model's first forward to the
    end of `step()`. Both give unbiased pairs for the same `|G|^2` and `tr(Sigma)`, and the
    gradient trained on is the batch mean either way (as the micro-batches' weighted sum: equal
    up to rounding). The choice is a function of the model and the first batch, never of a
    clock, so that a run trained twice, or resumed, gives the same numbers.
    """

    def __init__(self, in_use: InUse, *, requested: str, gate: Gate, module: nn.Module,
                 params: list[Any], batch_stats: list[nn.Module],
                 warn: Callable[[str, str], None], hint: Callable[[], str]) -> None:
        """`requested`: the method asked for (`auto` or a name); `gate`: what the sources
        built here report to (the monitor); `module`, `params`: the model (inside any DDP
        wrapper) and its measured parameters; `batch_stats`: its layers with batch
        statistics; `warn`: says a line once by key; `hint`: how the driving loop gives a step
        in micro-batches (`NoiseScaleMonitor.accumulation_hint`)."""
        self.in_use, self.requested, self.gate = in_use, requested, gate
        self.module, self.params, self.batch_stats = module, params, batch_stats
        self.warn, self.hint = warn, hint
        self.choice: dict[str, Any] | None = None
        """With `timed_auto`: {"method", "reason", "batch", "step_seconds": the fastest measured
        step after the choice}; auto's switch to micro-batches too. None before any."""
        self.candidates: Candidates = {}
        """`timed_auto`'s two ways to measure, where both are right (else empty)."""
        self.timing: list[float] | None = None
        """The measured steps timed so far after the choice (None: not timing)."""
        self.redo = False
        """The last step's measurement was discarded because the method or the per-example
        coverage changed there (`measure_noise_scale` measures that batch again)."""

    def _unhook(self, source: PerExample) -> None:
        """Remove a per-example source's hooks (they cost even idle) and disarm its checks."""
        source.coverage.disarm()
        for handle in source.handles:
            handle.remove()
        self.in_use.handles = [h for h in self.in_use.handles if h not in source.handles]

    @property
    def needs_microbatches(self) -> bool:
        """True when the batch must be back-propagated in micro-batches with `accumulate()`
        after each: method microbatch, or per_example with layers it cannot handle, or fsdp on
        one process."""
        return any(source.splits for source in self.in_use.sources)

    @property
    def why_microbatches(self) -> str:
        """Why the monitor needs each measured step in micro-batches (one line naming the
        layers or the method and the cause), or "" when it does not."""
        if not self.needs_microbatches:
            return ""
        method = self.in_use.method
        if method == Method.FSDP:
            return "FSDP on one process measures the micro-steps of gradient accumulation"
        if self.choice is not None and self.choice.get("method") == Method.MICROBATCH:
            return str(self.choice["reason"])
        stats = [m for m in self.batch_stats if m.training]
        if method == Method.MICROBATCH and stats:
            return (f"{type(stats[0]).__name__} normalises with statistics of the batch, so "
                    "per-example norms are not its noise")
        per_example = self.in_use.find(PerExample)
        if per_example is not None and per_example.skipped:
            return f"no per-example norms for {', '.join(per_example.skipped)}"
        return f"method {method} measures with micro-batches"

    @property
    def timed(self) -> bool:
        """Built with `timed_auto` where both per-example norms and micro-batches are right."""
        return bool(self.candidates)

    def keep(self, method: str, reason: str = "the batch cannot be split") -> None:
        """`timed_auto`: measure with `method` from the next step on, without choosing (the
        loop's batch cannot be split: per-example norms; the loop accumulates micro-batches
        anyway: micro-batches, whose pair then costs a few norms)."""
        if self.timed and self.choice is None:
            self._commit({"method": method, "reason": reason, "batch": None,
                          "step_seconds": None})

    def rides_pieces(self, reason: str) -> None:
        """The loop cuts every step into micro-batches anyway (`reason`: why, for the run's
        status): `auto` measures from them from the first step on, a few norms a step."""
        self.keep("microbatch", reason)

    def unsplittable(self) -> str | None:
        """The run's first batch cannot be cut along dim 0: the monitor's fallback. With
        `timed_auto` it keeps per-example norms (micro-batches are no candidate) and needs
        nothing more; with method microbatch it says so once and returns the method to rebuild
        it with (`FALLBACK_METHOD`: per-example norms need no split, except for layers they
        do not cover; a batch of one sample they leave unmeasured, NaN); otherwise None."""
        if self.timed:
            self.keep(FALLBACK_METHOD)
            return None
        if self.in_use.method != Method.MICROBATCH:
            return None
        self.warn("nosplit", "noise scale: this task's batch cannot be split along dim 0 "
                  "(no tensor, tensors of different lengths, or one sample): measuring "
                  "with per-example norms instead of micro-batches")
        return FALLBACK_METHOD

    def resumed_method(self, saved: dict[str, Any]) -> str | None:
        """The method to rebuild the monitor with before `load_state_dict(saved)`: the saved
        run fell back at its first step (`unsplittable`), so does this one; None: as built."""
        if saved["method"] != self.in_use.method and not self.timed:
            if self.requested == Method.AUTO and saved.get("choice") is not None:
                return None  # auto's own switch (`unattributable`): load_state_dict redoes it
            return FALLBACK_METHOD
        return None

    def unattributable(self, batch: int) -> None:
        """Per-example norms met a layer whose gradient they cannot attribute to examples
        (`PerExample.unattributed`: an input without the batch dimension, or examples along
        dim 1). `auto` measures with micro-batches from the next step on, said once; an
        explicit `per_example` is refused, a ValueError saying why."""
        per_example = self.in_use.find(PerExample)
        assert per_example is not None
        layers = ", ".join(f"{name} ({seen})"
                           for name, seen in per_example.unattributed.items())
        reason = f"per-example norms cannot attribute the gradient of {layers} to examples"
        self.redo = True
        if self.requested != Method.AUTO:
            raise ValueError(f"noise scale: method={self.requested!r}: {reason}; use "
                             "method='auto' or 'microbatch'")
        choice = {"method": "microbatch", "reason": reason, "batch": batch,
                  "step_seconds": None}
        if self.timed:
            self._commit(choice)
            self.timing = []  # said once timed (`timed_step`)
            return
        self._switch_to_microbatches(choice)
        say_once("auto unattributed", f"noise scale: method auto measures with micro-batches "
                 f"from the next step on ({reason}); micro-batches need gradient accumulation: "
                 f">= 2 micro-batches a step ({self.hint()})", per_launch=True)

    def _switch_to_microbatches(self, choice: dict[str, Any]) -> None:
        """Without `timed_auto`: drop the per-example hooks, measure with micro-batches."""
        per_example = self.in_use.find(PerExample)
        assert per_example is not None
        self._unhook(per_example)
        self.in_use.sources = [Increments(self.params)]
        self.in_use.method = "microbatch"
        self.choice = dict(choice)

    def choose(self, batch: int, split: bool) -> None:
        """After the first measured step (per-example norms): `cheaper_method` for the layers
        the hooks saw and this batch. `split`: the preconditioned pair of an adaptive optimizer
        cuts every measured step into micro-batches anyway, unless the per-example hooks weigh
        by P themselves (`PreconditionedEstimate.wants_microbatches`): where it splits,
        micro-batches cost nothing more, per-example hooks do."""
        per_example = self.in_use.find(PerExample)
        assert per_example is not None
        rest = self.in_use.find(Increments) is not None
        in_hooks = per_example.preconditions and per_example.preconditioner is not None
        method, reason = cheaper_method(sorted(per_example.positional), batch, rest,
                                        per_example.positions, split, in_hooks)
        if rest and per_example.skipped:  # name them: the reason kept in status.json
            reason = f"micro-batches are needed anyway, for {', '.join(per_example.skipped)}"
        elif method == Method.PER_EXAMPLE and per_example.routes:
            reason = f"{reason}; {per_example.routes}"  # what was measured how
        self._commit({"method": method, "reason": reason, "batch": batch, "step_seconds": None})
        self.timing = []

    def timed_step(self, seconds: float) -> None:
        """One measured step after the choice took `seconds`; the fastest of `TIMED_STEPS` is
        kept in `choice` and said once."""
        assert self.timing is not None and self.choice is not None
        self.timing.append(seconds)
        if len(self.timing) < TIMED_STEPS:
            return
        self.choice["step_seconds"] = min(self.timing)
        self.timing = None
        choice = self.choice
        say_once(f"auto {choice['method']}", f"noise scale: method auto measures with "
                 f"{choice['method']} ({choice['reason']}): {choice['step_seconds'] * 1e3:.3g} "
                 f"ms a measured step at batch {choice['batch']} (the fastest of "
                 f"{TIMED_STEPS}; each run's choice is in its status.json, noise_method)",
                 per_launch=True)

    def _commit(self, choice: dict[str, Any]) -> None:
        method = choice["method"]
        self.in_use.sources = [s for s in self.candidates[method] if s is not None]
        self.in_use.method = method
        for name, (per_example, _) in self.candidates.items():
            if name != method and per_example is not None:  # its hooks cost even idle
                self._unhook(per_example)
        self.choice = dict(choice)

    def uncover(self, uncovered: dict[int, str]) -> None:
        """Parameters whose `.grad` the per-example hooks do not account for (`uncovered`: id ->
        why) are measured with micro-batches from the next step on, with the other parameters
        of their layers, the rest staying per-example (the two parts are summed,
        `gnsweep.noise.combine_parts`); the new split is said once, naming them and why."""
        old = self.in_use.find(PerExample)
        assert old is not None
        self._unhook(old)
        source = PerExample(self.gate, self.module, self.params, old.excluded | uncovered)
        # It weighs by P only where it still covers every parameter (`preconditions`).
        source.preconditioner = old.preconditioner
        source.coverage.measured, source.coverage.probed = old.coverage.measured, \
            old.coverage.probed
        source.coverage.after_step(False)
        self.in_use.handles += source.handles
        rest = [p for p in self.params if id(p) not in source.covered]
        increments = Increments(rest) if rest else None
        if self.candidates:
            self.candidates["per_example"] = (source, increments)
        self.in_use.sources = [s for s in (source, increments) if s is not None]
        self.redo = True

    def state_dict(self) -> dict[str, Any]:
        """The monitor's keys of the choice: the steps timed so far and the choice made."""
        return {"timing": None if self.timing is None else list(self.timing),
                "choice": self.choice}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The choice a saved monitor had made (the monitor's whole state): committed again,
        with the steps timed so far, or auto's switch to micro-batches redone."""
        if self.timed and state.get("choice") is not None:
            self._commit(state["choice"])
            timing = state.get("timing")
            self.timing = None if timing is None else list(timing)
        elif state.get("choice") is not None and state["method"] == Method.MICROBATCH \
                and self.in_use.method == Method.PER_EXAMPLE and self.requested == Method.AUTO:
            self._switch_to_microbatches(state["choice"])  # switched before the save
