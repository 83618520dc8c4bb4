"""The sources a method measures with (`build_sources`): the method right for the model and
the launch (`choose_method`; a method wrong for it is refused), then its `Source`s, each with
its hooks on the model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from gnsweep.measure.batchstats import choose_method
from gnsweep.measure.choice import Candidates
from gnsweep.measure.common import Gate, is_ddp, log, world_size
from gnsweep.measure.ddp import DdpHook, RankGrads
from gnsweep.measure.fsdp import FsdpGrads
from gnsweep.measure.microbatch import Increments
from gnsweep.measure.per_example import PerExample
from gnsweep.measure.source import Source
from gnsweep.noise import Method

NORM_LAYER_TYPES = (nn.LayerNorm, nn.RMSNorm)
"""The layers `method="norm_layers"` measures the parameters of (Gray et al. 2024)."""


@dataclass
class Built:
    """The method a monitor measures with, its sources and, with `timed_auto`, the two ways
    `auto` chooses between after the first measured step (`gnsweep.measure.choice`)."""

    method: str
    sources: list[Source] = field(default_factory=list)
    candidates: Candidates = field(default_factory=dict)


def norm_layer_params(module: nn.Module, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The LayerNorm / RMSNorm parameters among `params` (`method="norm_layers"`); a model
    without trainable ones is refused."""
    measured = {id(p) for p in params}
    found = [p for m in module.modules() if isinstance(m, NORM_LAYER_TYPES)
             for p in m.parameters(recurse=False) if id(p) in measured]
    if not found:
        raise ValueError("method='norm_layers' measures the LayerNorm/RMSNorm parameters, and "
                         "this model has no trainable ones: use method='per_example' (or auto)")
    return found


def distributed(model: nn.Module, all_reduced: bool) -> bool:
    """Several ranks whose `.grad` is all-reduced: a DDP model, or `all_reduced_grads`."""
    import torch.distributed as dist

    return (is_ddp(model) or all_reduced) and dist.is_available() \
        and dist.is_initialized() and dist.get_world_size() > 1


def build_sources(gate: Gate, model: nn.Module, module: nn.Module,
                  params: list[nn.Parameter], method: str, *,
                  parameters: Iterable[nn.Parameter] | None, all_reduced: bool,
                  hessian_every: int, timed_auto: bool) -> Built:
    """The method for `method` (`auto` or a name) on this model and launch, and its sources
    reporting to `gate` (the monitor). `module`: the model inside a DDP wrapper; `params`: the
    measured parameters; `parameters`: as given by the user (None: every trainable one)."""
    requested = method
    method = choose_method(model, method, distributed=distributed(model, all_reduced))
    if method == Method.DDP:
        return _ddp(gate, model, module, params, all_reduced)
    if method == Method.FSDP:
        return Built("fsdp", [_fsdp(gate, model, params, parameters, hessian_every)])
    if (is_ddp(model) and world_size(model) > 1) or distributed(model, all_reduced):
        # .grad is all-reduced while per-example / micro-batch norms stay local.
        raise ValueError(f"method={method!r} with a DistributedDataParallel model: use "
                         "method='ddp'")
    return _local(gate, module, params, method, timed_auto and requested == Method.AUTO)


def _local(gate: Gate, module: nn.Module, params: list[nn.Parameter], method: str,
           timed: bool) -> Built:
    """One process: micro-batches, or per-example norms with micro-batches for the
    parameters they do not cover; `timed`: both, the cheaper kept after the first step."""
    if method != Method.PER_EXAMPLE:
        return Built(method, [Increments(params)])
    per_example = PerExample(gate, module, params)
    rest = [p for p in params if id(p) not in per_example.covered]
    increments = Increments(rest) if rest else None
    built = Built(method, [s for s in (per_example, increments) if s is not None])
    if timed:
        # Micro-batches measure this model right too: the cheaper is kept after the first
        # measured step (`AutoChoice.choose`).
        built.candidates = {"per_example": (per_example, increments),
                            "microbatch": (None, Increments(params))}
    return built


def _ddp(gate: Gate, model: nn.Module, module: nn.Module, params: list[nn.Parameter],
         all_reduced: bool) -> Built:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("method='ddp' needs an initialised torch.distributed process group "
                         "(run under torchrun and call init_process_group first)")
    if not is_ddp(model) and not all_reduced:
        raise ValueError("method='ddp' needs the DistributedDataParallel-wrapped model: "
                         "NoiseScaleMonitor(DistributedDataParallel(model), method='ddp')")
    if dist.get_world_size() < 2:
        method = choose_method(module, "auto")
        log.warning("noise scale: world size 1 gives one batch size only; measuring with "
                    "%s instead of the DDP hook", method)
        return _local(gate, module, params, method, False)
    if not is_ddp(model):
        # A wrapper the monitor cannot hook all-reduces .grad: read each rank's own gradient
        # from hooks on the parameters.
        return Built("ddp", [RankGrads(gate, params)])
    return Built("ddp", [DdpHook.attach(gate, model, params)])


def _fsdp(gate: Gate, model: nn.Module, params: list[nn.Parameter],
          parameters: Iterable[nn.Parameter] | None, hessian_every: int) -> FsdpGrads:
    if hessian_every:
        raise ValueError("B_noise (hessian_every > 0) cannot be measured on a model sharded by "
                         "FSDP: its Hessian passes need unsharded parameters; use "
                         "hessian_every=0")
    if parameters is not None and {id(p) for p in params} != {
            id(p) for p in model.parameters() if p.requires_grad}:
        raise ValueError("parameters=: a model sharded by FSDP is measured whole (its unsharded "
                         "parameters exist only inside forward and backward)")
    return FsdpGrads(gate, model)
