"""What the framework callbacks share: finding a batch's size, the module the monitor watches,
and the logged metric names (a public contract: `b_simple`, `b_simple_se`, `g2`,
`trace_sigma`, `b_noise`, `b_simple_precond`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gnsweep import noise

log = logging.getLogger("gnsweep.integrations")

if TYPE_CHECKING:
    from gnsweep.measure import NoiseScaleMonitor
    from gnsweep.noise import NoiseEstimate


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor with a batch dimension in a batch (tensor, tuple, list or mapping)."""
    if isinstance(value, torch.Tensor):
        return value if value.dim() > 0 else None
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


class Watched(nn.Module):
    """The module a `NoiseScaleMonitor` watches when the framework never calls the model itself.

    Lightning calls `training_step`, not `forward`, so the monitor's example count (taken from
    the inputs of the watched module's forward) would stay at zero. This module holds the
    user's model as its one child (the monitor's per-layer hooks reach every layer through it)
    and `count(batch)` marks one forward of the model with the batch's size. Its ordinary
    forward delegates to the model through `call` (used for the Hessian passes of B_noise).
    """

    def __init__(self, inner: nn.Module,
                 call: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.call = call
        self._counting = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._counting:
            return None
        if self.call is not None:
            return self.call(self.inner, *args, **kwargs)
        return self.inner(*args, **kwargs)

    def probe_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model run on what `count` was given (`gnsweep.measure.per_example.positions` runs it
        on a few examples, without gradients, to find the embeddings looked up once for the whole
        batch); a model that cannot be called so raises, and the probe gives no verdict."""
        if self.call is not None:
            return self.call(self.inner, *args, **kwargs)
        return self.inner(*args, **kwargs)

    def count(self, batch: Any) -> bool:
        """Record one forward of the model on `batch`; False when it has no batch dimension."""
        first = first_tensor(batch)
        if first is None:
            return False
        self._counting = True
        try:
            self(first)
        finally:
            self._counting = False
        return True


def metrics(estimate: NoiseEstimate | None, *, with_b_noise: bool,
            said: set[str] | None = None) -> dict[str, float]:
    """The logged values: B_simple (eq. 2.9), the ratio of the EMAs of tr(Sigma) and |G|^2 that
    the sweeps use, with its standard error `b_simple_se` and its parts `g2` and `trace_sigma`
    (EMAs, eq. A.2), and B_noise (eq. 2.8) once measured. NaN before the first measurement and
    where nothing can be measured: a callback always logs `b_simple`. While B_simple is not
    determined (`undetermined`) `b_simple` and `b_simple_se` are NaN, and the reason is said
    once per reason (`said`: the keys said so far, the callback's own)."""
    if estimate is None:
        return dict.fromkeys(("b_simple", "g2", "trace_sigma"), math.nan)
    out = {"b_simple": float(estimate.b_simple), "b_simple_se": float(estimate.b_simple_se),
           "g2": float(estimate.g2), "trace_sigma": float(estimate.trace_sigma)}
    why = undetermined(estimate)
    if why is not None:
        key, text = why
        out["b_simple"] = out["b_simple_se"] = math.nan
        if said is not None and key not in said:
            said.add(key)
            log.warning("noise scale: b_simple is logged as NaN %s", text)
    if with_b_noise and math.isfinite(estimate.b_noise):
        out["b_noise"] = float(estimate.b_noise)
    if math.isfinite(estimate.g2_precond):
        # B_simple in the optimizer's preconditioner (docs/noise.md), once measured: NaN
        # while it is not determined (`gnsweep.noise.with_preconditioned`), said once with why.
        out["b_simple_precond"] = float(estimate.b_simple_precond)
        if not math.isfinite(estimate.b_simple_precond):
            why = noise.undetermined(estimate.g2_precond, estimate.trace_sigma_precond,
                                     math.nan)
            if why is not None and said is not None and f"precond {why[0]}" not in said:
                said.add(f"precond {why[0]}")
                log.warning("noise scale: b_simple_precond is logged as NaN %s",
                            why[1].replace("|G|^2", "G^T P G").replace("tr(Sigma)",
                                                                      "tr(P Sigma)"))
    return out


def undetermined(estimate: NoiseEstimate) -> tuple[str, str] | None:
    """(key, why and until when) B_simple is not determined yet, or None when it is
    (`gnsweep.noise.undetermined`: the EMA of |G|^2 or of tr(Sigma) not positive, or a single
    measurement in the window)."""
    return noise.undetermined(estimate.g2, estimate.trace_sigma, estimate.b_simple_se)


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a framework's wrapper (accelerate's `AcceleratedOptimizer`,
    Lightning's `LightningOptimizer`), whose state holds the preconditioner; None if none."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "optimizer"):
            return optimizer
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None:
            return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        optimizer = inner
    return None


def cannot_measure(monitor: NoiseScaleMonitor, accumulation: int, setting: str) -> str | None:
    """Why a framework callback cannot measure with `monitor` under `accumulation` micro-steps a
    step (the framework's `setting`), or None when it can."""
    if monitor.method == noise.Method.FSDP:
        # The frameworks' FSDP strategies are untested with the FSDP source (which needs a
        # micro_step() after each backward): refused rather than a number not checked.
        return ("a model sharded by FSDP is not measured by this callback yet: use "
                "gnsweep.FsdpNoiseScale in the training loop (docs/integrations.md)")
    if monitor.needs_microbatches and accumulation < 2:
        # One behaviour whatever the cause (batch statistics, a broadcast input, a layer
        # without per-example norms, a parameter the hooks do not see whole): NaN, said once,
        # naming the cause.
        return (f"method {monitor.method} needs the micro-batches of gradient accumulation for "
                f"some of this model's parameters ({monitor.why_microbatches}); set {setting} "
                ">= 2")
    return None


def measure_step(monitor: NoiseScaleMonitor, accumulation: int, setting: str,
                 **step: Any) -> tuple[NoiseEstimate | None, str | None]:
    """`monitor.step(**step)`, and why measuring must stop, or None: method auto switches to
    micro-batches at its first measured step where per-example norms cannot attribute a
    layer's gradient (`NoiseScaleMonitor.unattributed`), which needs `setting` >= 2; an
    explicit per_example is refused there (ValueError)."""
    try:
        estimate = monitor.step(**step)
    except ValueError as err:
        return None, str(err)
    return estimate, cannot_measure(monitor, accumulation, setting)


TOKENS = "tokens"
"""`examples="tokens"` (the callbacks' default): B counts tokens where the batch says it is a
causal LM's (`causal_lm_tokens`), samples elsewhere."""


class Units:
    """The examples of each step in the user's unit (`examples=` of the callbacks): None counts
    samples (the batch's first dimension); an int, that many examples a sample (tokens per
    sequence); a function, the examples of the batch it is given; `"tokens"` (`TOKENS`), a
    causal LM's tokens where the batch says so (`causal_lm_tokens`), else samples, said once.
    `take()` gives the factor from samples to that unit over the step's micro-batches
    (`take`)."""

    def __init__(self, examples: int | str | Callable[[Any], int] | None) -> None:
        if examples is not None and examples != TOKENS and not callable(examples) and not (
                isinstance(examples, int) and examples >= 1):
            raise ValueError(f"examples={examples!r}: give an int >= 1 (examples a sample, "
                             "e.g. tokens per sequence), a function of the batch, "
                             f"{TOKENS!r} or None (samples)")
        self.examples = examples
        self.samples = self.units = 0
        self.tokens = False
        """`"tokens"` found a causal LM's batch: B is counted in tokens."""

    def add(self, batch: Any) -> None:
        first = first_tensor(batch)
        samples = int(first.shape[0]) if first is not None else 0
        self.samples += samples
        if self.examples == TOKENS:
            tokens = causal_lm_tokens(batch)
            if tokens is not None and not self.tokens:
                self.tokens = True
                log.warning("noise scale: B counts tokens (the batch's token-level labels "
                            "mark a causal language model; the attention mask's ones, or "
                            "input_ids, are counted): b_simple, b_noise and trace_sigma are "
                            "per token; examples=None counts sequences")
            self.units += samples if tokens is None else tokens
        elif callable(self.examples):
            self.units += int(self.examples(batch))
        else:
            self.units += samples * (self.examples if isinstance(self.examples, int) else 1)

    def take(self) -> tuple[int | None, float]:
        """The examples of the batches added since the last call in the user's unit (None
        where that is samples, the monitor's own count) and the factor from samples to it
        (1 with none)."""
        counted = self.examples is not None and (self.examples != TOKENS or self.tokens)
        factor = self.units / self.samples if counted and self.samples and self.units \
            else 1.0
        units = self.units if counted and self.units else None
        self.samples = self.units = 0
        return units, factor


def causal_lm_tokens(batch: Any) -> int | None:
    """The tokens of a causal language model's batch, or None where the batch does not say it
    is one: a mapping with 2-d `input_ids` and `labels` of the same shape (a label per token,
    as Hugging Face's causal LMs and their data collator give; a classifier's labels are one
    per sequence); the ones of its `attention_mask` where it has one of that shape, else every
    input id."""
    if not isinstance(batch, Mapping):
        return None
    ids, labels = batch.get("input_ids"), batch.get("labels")
    if not (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor)) or \
            ids.dim() != 2 or labels.shape != ids.shape:
        return None
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        return int(mask.sum())
    return int(ids.numel())
