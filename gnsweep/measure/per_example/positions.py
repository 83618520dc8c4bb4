"""Embeddings looked up once for the whole batch and broadcast over it: positions
`pos = wpe(torch.arange(T)); x = wte(idx) + pos` (nanoGPT). The lookup's output (T, C) has no
batch dimension, so its gradient arrives summed over the examples. Its per-example gradient is
what its broadcast output receives per example: on a measured step the output is replaced by
its view expanded along a new batch dimension, `out.expand(B, T, C)` (the same values; the same
computation wherever the model broadcasts it over the batch), whose gradient row i is example
i's own; autograd sums it into the weight's `.grad` as before.

Which lookups are shared, and that the expanded view computes the same, is checked once, never
assumed (`shared_lookups`), when a measured forward first looks an embedding up with a 1-d index
(before its output is used): the model is run again, inside that forward, without gradients (no
hook of the monitor captures then), on two small batch sizes; an
embedding whose index has no batch dimension (the same 1-D index at both sizes) is a shared
lookup, and the model is run once more with its output expanded: a lookup whose expanded
output changes the model's output (a use along another dimension) is refused, and its weight
measured with micro-batches, said with the reason. The coverage check
(`coverage`) then holds the examples' gradients against `.grad` like any
other layer's.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from gnsweep.measure.per_example.broadcast import first_examples, same_values

PROBE_FORWARD = "probe_forward"
"""A method a watched module may have that runs the model on the arguments its forward was
counted with (the framework callbacks' `Watched`, whose own forward only counts examples): the
probe runs it instead of the module's forward."""


def _sizes(batch: int) -> tuple[int, int]:
    """Two batch sizes to run the model on (a shared index has the same length at both)."""
    return (1, 2) if batch == 2 else (2, 3)


def _run(model: nn.Module, args: tuple, kwargs: dict, batch: int, n: int,
         hooks: list[tuple[nn.Module, Any]], state: torch.Tensor) -> Any:
    """The model's own forward (without its hooks) on its first `n` examples, no gradients,
    the random state `state`, with `hooks` (module, forward hook) registered meanwhile."""
    handles = [m.register_forward_hook(h) for m, h in hooks]
    forward = getattr(model, PROBE_FORWARD, None) or partial(type(model).forward, model)
    try:
        torch.set_rng_state(state)
        return forward(*first_examples(args, batch, n), **first_examples(kwargs, batch, n))
    finally:
        for handle in handles:
            handle.remove()


def shared_lookups(model: nn.Module, embeddings: dict[int, tuple[str, nn.Module]], args: tuple,
                   kwargs: dict, batch: int) -> tuple[set[int], dict[int, str]] | None:
    """(ids of the embeddings in `embeddings` (id -> (name, module)) looked up without a batch
    dimension whose output may be expanded over the batch, id -> why for those whose expanded
    output changes the model's output), from the model's call (`args`, `kwargs`, `batch`
    examples); None where the model cannot be run on a few examples or its call did not reach
    the embeddings (no verdict)."""
    small, large = _sizes(batch)
    seen: dict[int, dict[int, list[torch.Size]]] = {small: {}, large: {}}

    def record(n: int) -> Any:
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            if inputs and isinstance(inputs[0], torch.Tensor):
                seen[n].setdefault(id(module), []).append(inputs[0].shape)
        return hook

    devices = sorted({p.device.index or 0 for p in model.parameters()
                      if p.device.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            state = torch.get_rng_state()
            plain = _run(model, args, kwargs, batch, small,
                         [(m, record(small)) for _, m in embeddings.values()], state)
            _run(model, args, kwargs, batch, large,
                 [(m, record(large)) for _, m in embeddings.values()], state)
            if not seen[small] or seen[small].keys() != seen[large].keys():
                return None  # the embeddings were not called (a wrapper's counting call)
            shared = {key for key, shapes in seen[small].items()
                      if all(len(s) == 1 for s in shapes) and shapes == seen[large].get(key)}
            refused: dict[int, str] = {}
            for key in sorted(shared):
                name, module = embeddings[key]

                def expand(module: nn.Module, inputs: tuple, output: Any) -> Any:
                    return output.unsqueeze(0).expand(small, *output.shape)

                try:
                    expanded = _run(model, args, kwargs, batch, small, [(module, expand)], state)
                except Exception as err:
                    expanded = err
                if isinstance(expanded, Exception) or not same_values(plain, expanded):
                    refused[key] = (f"{name} is looked up without a batch dimension and the "
                                    "model does not compute the same with its output "
                                    "expanded along the batch, so it is not broadcast over "
                                    "the examples")
    except Exception:  # the model cannot be run on a few examples: no verdict
        return None
    return shared - set(refused), refused
