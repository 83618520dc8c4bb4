"""What the monitor asks of a measurement source: the `Source` protocol, and what it is told
(`StepNorms`) and hands back (`Reading`) at each step.

A source yields pairs `(|G_small|^2, |G_big|^2)` of eq. A.2 (`NormPair`) at the parameters of
the current step: per-example norms (`PerExample`, b_small = 1), micro-batch increments
(`Increments`, b_small = B / k), DDP's communication hook or parameter hooks (`DdpHook`,
`RankGrads`, b_small = per-worker batch), FSDP's unsharded gradients (`FsdpGrads`). The monitor
holds its sources in a list (`NoiseScaleMonitor.sources`) and sums their pairs
(`gnsweep.noise.combine_parts`): it asks them, it does not branch on which they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from gnsweep.measure.common import Gate
from gnsweep.noise import NormPair

S = TypeVar("S")


@dataclass(frozen=True)
class StepNorms:
    """What a source is told when the monitor folds a step in (`step()`)."""

    examples: int
    """The batch dimension summed over the step's forward calls."""
    plain: bool
    """B_simple is measured on this step (else only a Hessian pass may be due)."""
    small_scale: float
    """The square of the loss scale that norms captured during backward carry (fp16)."""
    big_scale: float
    """The same for |G_big|^2 read from `.grad` now (1 where `.grad` was already unscaled)."""
    required: bool = False
    """Micro-batches were asked for by name: a step in one piece is an error, not a NaN."""
    hess: NormPair | None = None
    """This step's H-norm pair (B_noise), where one was measured."""
    grads_unscaled: bool = False
    """`.grad` was divided by the loss scale before `step()`."""
    why: Callable[[], str] = str
    """Why the monitor needs micro-batches (`why_microbatches`), asked only to say it."""
    hint: str = ""
    """How the driving loop gives a step in micro-batches (`accumulation_hint`)."""


@dataclass
class Reading:
    """What a source hands back for one step."""

    parts: list[NormPair] = field(default_factory=list)
    """Its pairs, unscaled; summed with the other sources' (`combine_parts`)."""
    complete: bool = True
    """False: the source had to skip this step, so no estimate is made from any part of it."""
    preconditioned: list[NormPair] | None = None
    """The P-norm pairs for B_simple_P, for a source that weighs by P itself (`preconditions`)."""
    hess: NormPair | None = None
    replaces_hess: bool = False
    """The source folds the H-norm pair itself (DDP all-reduces it with its own, one step
    late): `hess` is then the pair to fold now."""
    warning: tuple[str, str] | None = None
    """(key, message) to say once: why the step was not measured."""


class Source(Protocol):
    """A source of `NormPair`s for the monitor: hooks while measuring, a reading per step."""

    handles: list[Any]
    """Its hooks (removed by the monitor's `close()`)."""

    @property
    def splits(self) -> bool:
        """It needs each measured step in micro-batches, `accumulate()` after each."""

    @property
    def preconditions(self) -> bool:
        """It can weigh each gradient by the optimizer's P in its own hooks (`preconditioner`)."""

    def accumulate(self, examples_so_far: int) -> None:
        """A micro-batch was just back-propagated (called only on measured steps)."""

    def read(self, step: StepNorms) -> Reading:
        """This step's pairs (unscaled), read after its backward."""

    def reset(self) -> None:
        """Forget this step's captures (after every step, measured or not)."""

    def state_dict(self) -> dict[str, Any]:
        """What must be checkpointed with the monitor (keys of the monitor's state)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` (given the monitor's whole state)."""

    def close(self, owner: Gate) -> Reading | None:
        """Stop measuring for `owner` (the monitor); a last reading still owed (DDP's pending
        all-reduce, where `owner` still owns the hook), or None."""

    def describe(self) -> str:
        """One line: what it measures, and how."""


class Stateless:
    """The protocol's defaults for a source with nothing to checkpoint and no reading owed when
    the monitor closes."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self, owner: Gate) -> Reading | None:
        return None


def read_all(sources: list[Source], step: StepNorms, warn: Callable[[str, str], None]
             ) -> tuple[Reading, bool]:
    """Every source's reading of this step in one: their pairs (none where any source had to
    skip the step), the H-norm pair (a source's own where it folds it), the P-norm pairs of
    the source that weighs by P, each warning said by `warn`; and whether a source weighs by P
    itself (`preconditions`)."""
    total, preconditions = Reading(hess=step.hess), False
    for source in sources:
        reading = source.read(step)
        total.parts += reading.parts
        total.complete = total.complete and reading.complete
        if reading.replaces_hess:
            total.hess = reading.hess
        if source.preconditions:
            preconditions, total.preconditioned = True, reading.preconditioned
        if reading.warning is not None:
            warn(*reading.warning)
    if not total.complete:
        total.parts = []
    return total, preconditions


def unscale(part: NormPair, small: float, big: float) -> NormPair:
    """`part` with |G_small|^2 divided by `small` and |G_big|^2 by `big` (the squared loss
    scales their gradients carried)."""
    if small == big == 1.0:  # no loss scale (fp32, bf16)
        return part
    return NormPair(part.sq_small / small, part.sq_big / big, part.b_small, part.b_big)


@dataclass
class InUse:
    """What a monitor measures with now, the one record its parts share: the method's name,
    its sources, and every hook handle the monitor holds. `AutoChoice` may switch it (to
    micro-batches, or to the method it keeps); `PreconditionedEstimate` reads it."""

    method: str
    sources: list[Any] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)

    def find(self, kind: type[S]) -> S | None:
        """The source of that class in use, or None."""
        return next((s for s in self.sources if isinstance(s, kind)), None)
