"""Squared gradient norms from a live model, fed to the pure estimators in `gnsweep.noise`.

Each source of the pair `(|G_small|^2, |G_big|^2)` of eq. A.2 (a `NormPair`) implements the
`Source` protocol of `source`: `per_example` (a package: the hooks and what they need,
b_small = 1), `microbatch` (gradient accumulation, b_small = B / k), `ddp` (a communication
hook, b_small = per-worker batch) and `fsdp` (a model sharded by `fully_shard`, b_small = one
rank's micro-step); `build` builds a method's sources, `hessian` takes the H-norms of B_noise
(eq. 2.8). `monitor` drives them inside a training loop (`NoiseScaleMonitor`, which holds its
parts: `choice.AutoChoice` keeps the cheaper method, `preconditioned.PreconditionedEstimate`
measures B_simple_P in the optimizer's preconditioner, read by `preconditioner`), `offline`
once at fixed parameters (`measure_noise_scale`); `FsdpNoiseScale` is the FSDP source alone,
for a user's own accumulation loop.
"""

from gnsweep.measure.fsdp import FsdpNoiseScale
from gnsweep.measure.hessian import hessian_norms
from gnsweep.measure.monitor import PAIR_METHOD_NAMES, NoiseScaleMonitor
from gnsweep.measure.offline import measure_noise_scale
from gnsweep.noise import NormPair

__all__ = ["PAIR_METHOD_NAMES", "FsdpNoiseScale", "NoiseScaleMonitor", "NormPair",
           "hessian_norms", "measure_noise_scale"]
