"""What a run logs beside its training loss to make the answer checkable: frozen-parameter probes
of the noise scale at log-spaced points in examples, and, for tasks with a closed form
(`task.truth(model)`, linreg), the exact B_simple, B_noise and population loss.

A probe measures tr(Sigma), |G|^2, tr(H Sigma) and G^T H G (eq. A.2, eq. 2.8) from
`probe_batches` fresh batches of `probe_batch_size` examples at the current parameters, on a copy
of the model: the training monitor's hooks never see the probe's batches, and the probe's data
come from their own generator, so training draws the same examples with or without probes.
The analysis pools neighbouring probes and takes the ratios (`analysis.smoothing.pooled_probes`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from gnsweep.measure.batchstats import batch_statistics_layers
from gnsweep.measure.common import LossFn, is_ddp, to_device
from gnsweep.measure.offline import measure_noise_scale
from gnsweep.noise import ProbeSchedule
from gnsweep.tables import PROBE_COLUMNS, TRUTH_COLUMNS


class RunProbes:
    """Probes and exact truth for one run; `values(model, examples)` gives one logged row's
    columns (NaN where nothing was measured)."""

    def __init__(self, noise: Any, task: Any, seed: int) -> None:
        self.per_octave = float(noise.probe_per_octave)
        self.batches, self.batch_size = int(noise.probe_batches), int(noise.probe_batch_size)
        self.hessian_microbatches = int(noise.probe_hessian_microbatches)
        self.schedule = ProbeSchedule(self.per_octave) if self.per_octave > 0 else None
        self.task = task
        self.generator = torch.Generator().manual_seed(20_000 + seed)
        self.truth: Callable[[nn.Module], Any] | None = getattr(task, "truth", None)
        # A costly truth (a pass over a whole training set) at log-spaced points only, 4 per
        # doubling of examples; the analysis interpolates between them.
        self.truth_schedule = ProbeSchedule(4.0) if getattr(task, "truth_is_costly", False) \
            else None
        self.seconds = 0.0
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        """Where each schedule stands, the probes' own generator, and the time and count spent."""
        return {"schedule": None if self.schedule is None else self.schedule.state_dict(),
                "truth_schedule": (None if self.truth_schedule is None
                                   else self.truth_schedule.state_dict()),
                "generator": self.generator.get_state(), "seconds": self.seconds,
                "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("schedule", "truth_schedule"):
            schedule: ProbeSchedule | None = getattr(self, name)
            if (schedule is None) != (state[name] is None):
                raise ValueError(f"probe state: {name} does not match this run's settings")
            if schedule is not None:
                schedule.load_state_dict(state[name])
        self.generator.set_state(state["generator"])
        self.seconds, self.count = float(state["seconds"]), int(state["count"])

    def exact_loss(self, model: nn.Module) -> float | None:
        """The exact loss (population or whole training set) where the task has a cheap one
        (None elsewhere: the task's own eval loss is used)."""
        if self.truth is None:
            return None
        if self.truth_schedule is not None:  # a cheap whole-set loss beside a costly truth
            whole = getattr(self.task, "training_loss", None)
            return float(whole(model)) if whole is not None else None
        return float(self.truth(model).loss)

    def values(self, model: nn.Module, examples: float) -> dict[str, float]:
        out = dict.fromkeys(PROBE_COLUMNS + TRUTH_COLUMNS, math.nan)
        if self.truth is not None and (self.truth_schedule is None
                                       or self.truth_schedule.due(examples)):
            truth = self.truth(model)
            out["b_simple_true"], out["b_noise_true"] = truth.b_simple, truth.b_noise
        if self.schedule is not None and self.schedule.due(examples):
            out.update(self.probe(model))
        return out

    def probe(self, model: nn.Module) -> dict[str, float]:
        start = time.perf_counter()
        module = cast(nn.Module, model.module) if is_ddp(model) else model
        # measure_noise_scale takes `loss_fn(outputs, targets)`: the built-in tasks' output_loss.
        loss_fn: LossFn = self.task.output_loss
        device = next(module.parameters()).device
        batches = [to_device(self.task.sample(self.batch_size, self.generator), device)
                   for _ in range(self.batches)]
        was_training = module.training
        copied = copy.deepcopy(module)
        copied.train(was_training)
        # The task's measured block (`noise_parameters`), as in the training loop's monitor.
        choose = getattr(self.task, "noise_parameters", None)
        # B_noise's Hessian passes split batches, which a model with batch statistics does not
        # allow (docs/noise.md): its probes measure B_simple only (B_noise columns NaN).
        hessian = not batch_statistics_layers(copied)
        est = measure_noise_scale(copied, loss_fn, batches, hessian=hessian,
                                  hessian_microbatches=self.hessian_microbatches,
                                  parameters=None if choose is None else choose(copied))
        self.seconds += time.perf_counter() - start
        self.count += 1
        return {"probe_g2": est.g2, "probe_trace_sigma": est.trace_sigma,
                "probe_g_h_g": est.g_h_g, "probe_trace_h_sigma": est.trace_h_sigma}


