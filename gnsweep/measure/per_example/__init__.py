"""Per-example gradient norms (b_small = 1) for the monitor's `per_example` method.

`hooks.PerExample` is the source: forward/backward hooks on the layers holding the measured
parameters; `layers` holds each layer kind's rule for `sum_i |g_i|^2` (Gram form or explicit
per-example gradient), `preconditioned_norms` the same in the optimizer's diagonal
preconditioner P, `tied` parameters shared by several layers. What module hooks cannot see is
measured another way: `attention` measures `nn.MultiheadAttention` whole, one example at a time;
`functional` a layer of one's own by its own forward; `broadcast` parameters broadcast over the
batch through their expanded views; `positions` the embeddings looked up once for the whole
batch. `coverage` proves at run time that what the hooks saw adds up to `.grad`.
"""

from gnsweep.measure.per_example.hooks import (
    Lookups,
    PerExample,
    positions_only,
    read_functionally,
)
from gnsweep.measure.per_example.layers import (
    CONV_CHUNK,
    GRADIENT_BYTES,
    PATCH_BYTES,
    gram_is_cheaper,
    patches_are_cheaper,
)

__all__ = ["CONV_CHUNK", "GRADIENT_BYTES", "PATCH_BYTES", "Lookups", "PerExample",
           "gram_is_cheaper", "patches_are_cheaper", "positions_only", "read_functionally"]
