"""Cost of the lag-free noise-scale measurement: frozen-parameter probes and the exact
truth, per training step.

`python -m gnsweep.bench probe [--quick]`. For linreg (the `+experiment=linreg_truth` task) and
digits (the demo's MLP), at two batch sizes: the time of one training step with the monitor (as
`gnsweep.training` runs it, ema_fraction 0.2), of one probe
(`measure.run_probes.RunProbes.probe`: 16 batches of 512 at frozen parameters, B_simple and
B_noise) and of one exact-truth evaluation; then the probes' cost amortized over a run of S
steps with 2 probes per doubling of examples (about 2 log2(S) + 1 probes), as a fraction of
the run's own steps.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import torch

from gnsweep.config import NoiseConfig
from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.run_probes import RunProbes
from gnsweep.tasks import make_task

TASKS: dict[str, dict[str, Any]] = {"linreg": {"dim": 32, "teacher_power": 1.0, "eval_size": 0},
         "digits": {"exact_truth": True}}
BATCH_SIZES = (8, 64)
RUN_STEPS = (100, 1000)


def _fastest(fn, rounds: int) -> float:
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _row(name: str, task: Any, model: torch.nn.Module, probes: RunProbes, batch: int,
         rounds: int) -> dict[str, Any]:
    monitor = NoiseScaleMonitor(model, "per_example", ema_fraction=0.2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    def steps(n: int = 20) -> None:
        for _ in range(n):
            drawn = task.sample(batch, g)
            optimizer.zero_grad(set_to_none=True)
            task.loss(model, drawn).backward()
            monitor.step()
            optimizer.step()

    plain = _fastest(steps, rounds) / 20
    monitor.close()
    probe = _fastest(lambda: probes.probe(model), max(rounds // 2, 2))
    assert probes.truth is not None
    truth_fn = probes.truth
    truth = _fastest(lambda: truth_fn(model), max(rounds // 2, 2))
    row: dict[str, Any] = {"task": name, "batch": batch, "step_ms": 1e3 * plain,
                           "probe_steps": probe / plain, "truth_steps": truth / plain}
    for s in RUN_STEPS:
        row[f"probes_per_step_S{s}"] = (2 * math.log2(s) + 1) * probe / (s * plain)
    return row


def main(argv: list[str]) -> dict[str, Any]:
    import argparse

    parser = argparse.ArgumentParser(prog="gnsweep bench probe",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 7.")
    parser.add_argument("--rounds", type=int, default=0, help="Rounds (overrides --quick).")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    torch.set_num_threads(1)
    noise = NoiseConfig(probe_per_octave=2)
    rows = []
    for name, options in TASKS.items():
        task = make_task(name, options, 0)
        model = task.model()
        probes = RunProbes(noise, task, 0)
        assert probes.truth is not None
        probes.truth(model)  # the first call pays a one-off setup (torch.func)
        for batch in BATCH_SIZES:
            rows.append(_row(name, task, model, probes, batch, rounds))
    columns = list(rows[0])
    print("lag-free measurement cost (one probe / one exact truth in training steps; probes "
          "amortized over a run of S steps at 2 per doubling of examples)")
    print("  ".join(f"{c:>14}" for c in columns))
    for row in rows:
        print("  ".join(f"{v:>14.3g}" if isinstance(v, float) else f"{v:>14}"
                        for v in row.values()))
    print(json.dumps({"probe": rows}))
    return {"probe": rows}
