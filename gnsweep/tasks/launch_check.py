"""The check `gnsweep launch` makes before anything runs: the task builds, samples a batch of 2
(or takes 2 items of its Dataset and collates them), and its loss is a finite scalar with
gradients on the model's trainable parameters.

Every problem is a ConfigError naming it in one line (exit code 2): a user's task that cannot
train is refused before a sweep folder is written or a run started.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import default_collate

from gnsweep.errors import ConfigError
from gnsweep.noise import Method
from gnsweep.stall import bounded
from gnsweep.tasks import CUSTOM, TARGET, Task, examples_of, make_task
from gnsweep.tasks.datasets import as_dataset
from gnsweep.tasks.protocol import first_dim


class TaskCheck(NamedTuple):
    """What the check learnt about the task."""

    unit: str | None
    """The unit the task object declares (its `unit` attribute: what its batch sizes count,
    e.g. "tokens"), or None."""
    per_sample: float
    """Examples a sample: `examples(batch)` over the batch's first dimension (a language
    model's tokens a sequence; 1 for a task counting its samples)."""
    params: int = 0
    """The model's trainable parameters."""
    params_non_embedding: int = 0
    """The same without those of its embedding layers (nn.Embedding, nn.EmbeddingBag): the N
    of scaling laws (Kaplan et al. 2020; Li et al. 2025)."""


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, trainable parameters outside embedding layers); a tied weight
    counts once."""
    seen: set[int] = set()
    embedding: set[int] = set()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            embedding.update(id(p) for p in module.parameters(recurse=False))
    total = non_embedding = 0
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if id(p) not in embedding:
            non_embedding += p.numel()
    return total, non_embedding


def check_task(name: str, options: dict[str, Any], seed: int = 0,
               stall_seconds: float = 0.0, *, noise_method: str = "auto") -> TaskCheck:
    """Build the task, draw a batch of 2 and back-propagate its loss once; ConfigError if any
    part of the protocol (docs/tasks.md) fails, `stall.Stalled` (a ConfigError) if the task's
    code has not answered after `stall_seconds` (`sweep.stall_seconds`; 0: no bound). Returns
    its unit and examples a sample. `noise_method="per_example"` (asked for explicitly):
    refused where per-example norms cannot measure this model (a layer whose input has no
    batch dimension, batch statistics), as a run would fail on its first step."""
    label = _label(name, options)
    return bounded(stall_seconds, f"{label}: the pre-launch check (build, a batch of 2, its "
                   "loss and gradient)",
                   lambda: _check_task(label, name, options, seed, noise_method))


def _label(name: str, options: dict[str, Any]) -> str:
    return f"task {options.get(TARGET)}" if name == CUSTOM else f"task {name}"


def _check_task(label: str, name: str, options: dict[str, Any], seed: int,
                noise_method: str) -> TaskCheck:
    task: Task = _call(label, "building it", lambda: make_task(name, options, seed))
    for method in ("model", "loss"):
        if not callable(getattr(task, method, None)):
            raise ConfigError(f"{label}: the object it builds ({type(task).__name__}) has no "
                              f"{method}() method; see docs/tasks.md")
    if not any(callable(getattr(task, m, None)) for m in ("dataset", "sample")):
        raise ConfigError(f"{label}: the object it builds ({type(task).__name__}) has neither "
                          "dataset() nor sample(batch_size, generator): give it one (a "
                          "map-style Dataset, or i.i.d. draws); see docs/tasks.md")
    model = _call(label, "model()", task.model)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{label}: model() returned a {type(model).__name__}, not a "
                          "torch.nn.Module")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError(f"{label}: the model has no trainable parameters (nothing to train)")
    batch = _first_batch(label, task, seed)
    loss = _call(label, "loss(model, batch)", lambda: task.loss(model, batch))
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
               else f"a {type(loss).__name__}")
        raise ConfigError(f"{label}: loss(model, batch) must return a scalar tensor (the "
                          f"batch-mean loss), got {got}; reduce it with .mean()")
    if not math.isfinite(float(loss.detach())):
        raise ConfigError(f"{label}: the loss of a batch of 2 is {float(loss.detach())} at "
                          "initialisation")
    if not loss.requires_grad:
        raise ConfigError(f"{label}: the loss does not depend on the model's parameters (no "
                          "gradient); compute it from model(...) inside loss()")
    _call(label, "loss.backward()", loss.backward)
    if all(p.grad is None for p in params):
        raise ConfigError(f"{label}: the loss has no gradient on the model's trainable "
                          "parameters; compute it from the model loss() is given")
    count = _call(label, "examples(batch)", lambda: examples_of(task, batch))
    if count < 1:
        raise ConfigError(f"{label}: examples(batch) is {count} for a batch of 2; must be >= 1")
    if hasattr(task, "noise_parameters"):
        _check_noise_parameters(label, task, model, params)
    if noise_method == Method.PER_EXAMPLE:
        _check_per_example(label, task, model, batch)
    unit = getattr(task, "unit", None)
    if unit is not None and (not isinstance(unit, str) or not unit.strip()):
        raise ConfigError(f"{label}: its unit is {unit!r}; give a word naming what a batch "
                          "size counts, e.g. unit = \"tokens\"")
    samples = first_dim(batch)
    return TaskCheck(unit, count / samples if samples else 1.0, *count_parameters(model))


def _first_batch(label: str, task: Any, seed: int) -> Any:
    """A batch of 2: the first two items of `dataset()` collated, else `sample(2, generator)`.
    `eval_dataset()`, where the task has one, must be a map-style Dataset too."""
    if hasattr(task, "eval_dataset"):
        _dataset(label, task, "eval_dataset")
    if not hasattr(task, "dataset"):
        return _call(label, "sample(2, generator)",
                     lambda: task.sample(2, torch.Generator().manual_seed(seed)))
    dataset = _dataset(label, task, "dataset")
    collate = getattr(task, "collate", None) or default_collate
    items = [_call(label, f"dataset()[{i}]", functools.partial(dataset.__getitem__, i))
             for i in range(min(2, len(dataset)))]
    return _call(label, "collate(items)", lambda: collate(items))


def _dataset(label: str, task: Any, method: str) -> Any:
    made = _call(label, f"{method}()", getattr(task, method))
    try:
        return as_dataset(made, f"{method}()")
    except ValueError as err:
        raise ConfigError(f"{label}: {err}") from None


def _check_noise_parameters(label: str, task: Any, model: nn.Module,
                            params: list[nn.Parameter]) -> None:
    """noise_parameters(model) names a non-empty set of the model's trainable parameters (the
    block the noise scale is measured on)."""
    chosen = _call(label, "noise_parameters(model)", lambda: list(task.noise_parameters(model)))
    trainable = {id(p) for p in params}
    if not chosen:
        raise ConfigError(f"{label}: noise_parameters(model) is empty; return the parameters "
                          "whose gradient the noise scale is measured on (or drop the method)")
    foreign = [p for p in chosen if not isinstance(p, nn.Parameter) or id(p) not in trainable]
    if foreign:
        raise ConfigError(f"{label}: noise_parameters(model) returns {len(foreign)} of "
                          f"{len(chosen)} items that are not trainable parameters of the model "
                          "it is given; return parameters of that model (e.g. "
                          "model.actor.parameters())")


def _check_per_example(label: str, task: Any, model: nn.Module, batch: Any) -> None:
    """noise.method=per_example can measure this model: one more backward of the batch of 2
    under a per-example monitor, whose hooks see every layer's input."""
    from gnsweep.measure import NoiseScaleMonitor

    parameters = list(task.noise_parameters(model)) if hasattr(task, "noise_parameters") \
        else None
    try:
        monitor = NoiseScaleMonitor(model, "per_example", parameters=parameters)
    except ValueError as err:
        raise ConfigError(f"{label}: noise.method=per_example: {err}") from None
    try:
        model.zero_grad(set_to_none=True)
        task.loss(model, batch).backward()
        unattributed = monitor.unattributed
    finally:
        monitor.close()
        model.zero_grad(set_to_none=True)
    if unattributed:
        layers = ", ".join(f"{name} ({seen})" for name, seen in unattributed.items())
        raise ConfigError(f"{label}: noise.method=per_example cannot attribute the gradient of "
                          f"{layers} to examples (an input without the batch dimension, such "
                          "as positions wpe(torch.arange(T)) broadcast over the batch); use "
                          "noise.method=auto (micro-batches for such a model) or microbatch")


def _call(label: str, what: str, function: Callable[[], Any]) -> Any:
    try:
        return function()
    except ConfigError:
        raise
    except SystemExit as err:
        # A task's sys.exit() would end the launcher with its code and no word of why.
        raise ConfigError(f"{label}: {what} called sys.exit({err.code!r}); a task must "
                          "raise an exception (or return), never exit the process") from None
    except Exception as err:
        raise ConfigError(f"{label}: {what} raised {type(err).__name__}: {err}") from None
