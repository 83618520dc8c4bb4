"""Cost of measuring the noise scale: step time with each method / plain step time.

`python -m gnsweep.bench noise` (or `gnsweep bench noise`). For a small MLP and a small CNN at a
few batch sizes, every variant runs in the same process, interleaved round by round, and the
ratio of medians is reported:

- per_example: one backward, hooks on every layer;
- microbatch: over the same 4-micro-batch accumulation loop without a monitor (the monitor's
  cost), and over one unsplit step (the monitor plus the splitting, if you would not split);
- B_noise: one Hessian measurement (`hessian_norms`) in plain steps (`hessian_steps`), and
  amortized over the default frequency, every 50 steps (`b_noise`, on top of B_simple's cost);
- ddp: two gloo processes, DDP with the hook / plain DDP (`--no-ddp` skips it);
- auto: the method `noise.method=auto` keeps on one process for the model and batch, and its
  step over the plain unsplit step (`auto_cost`).

Flags: `--quick` (fewer rounds), `--no-ddp`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.distributed import close_process_group
from gnsweep.measure import NoiseScaleMonitor, hessian_norms

BATCH_SIZES = (32, 128, 512)
HESSIAN_EVERY = 50  # the default frequency of conf/noise/hessian.yaml
MICROBATCHES = 4
TARGETS = {"microbatch": 1.05, "ddp": 1.05, "per_example": 1.3, "b_noise": 1.2}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (_mlp, (64,)), "cnn": (_cnn, (1, 16, 16))}


def _data(shape: tuple[int, ...], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, *shape, generator=g), torch.randint(10, (batch,), generator=g)


def _stepper(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int,
             monitor: NoiseScaleMonitor | None) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs, ys = x.tensor_split(k), y.tensor_split(k)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for xm, ym in zip(xs, ys, strict=True):
            (F.cross_entropy(model(xm), ym) * (len(xm) / len(x))).backward()
            if monitor is not None:
                monitor.accumulate()
        if monitor is not None:
            monitor.step(batch=(x, y))
        optimizer.step()

    return step


def _variants(name: str, batch: int) -> dict[str, Callable[[], object]]:
    make, shape = MODELS[name]
    x, y = _data(shape, batch)
    torch.manual_seed(0)
    hessian_model = make()
    out: dict[str, Callable[[], object]] = {
        # One B_noise measurement on its own (timed per call, amortized over HESSIAN_EVERY).
        "hessian_call": lambda: hessian_norms(hessian_model, F.cross_entropy, (x, y), 2)}
    for variant in ("plain", "plain_split", "per_example", "microbatch"):
        torch.manual_seed(0)
        model = make()
        monitor = None
        if variant == "per_example":
            monitor = NoiseScaleMonitor(model, "per_example")
        elif variant == "microbatch":
            monitor = NoiseScaleMonitor(model, "microbatch")
        k = MICROBATCHES if variant in ("plain_split", "microbatch") else 1
        out[variant] = _stepper(model, x, y, k, monitor)
    return out


def _auto_method(name: str, batch: int) -> str:
    """The method `noise.method=auto` keeps for this model and batch on one process (the
    training loop's monitor, `timed_auto`): chosen after the first measured step."""
    make, shape = MODELS[name]
    x, y = _data(shape, batch)
    torch.manual_seed(0)
    model = make()
    monitor = NoiseScaleMonitor(model, "auto", timed_auto=True)
    F.cross_entropy(model(x), y).backward()
    monitor.step()
    monitor.close()
    return monitor.method


def _time_side_by_side(steppers: Mapping[str, Callable[[], object]], rounds: int, steps: int
                       ) -> dict[str, float]:
    """Seconds per call of each variant: the variants interleaved round by round, the fastest
    round of each (other load on the machine only ever adds time)."""
    for fn in steppers.values():  # warm-up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steppers}
    for _ in range(rounds):
        for key, fn in steppers.items():
            calls = max(1, steps // 10) if key == "hessian_call" else steps
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[key].append((time.perf_counter() - start) / calls)
    return {k: min(v) for k, v in times.items()}


def _ddp_ratio(name: str, batch: int, world: int, rounds: int, steps: int) -> float:
    """DDP with the hook / plain DDP, this rank's share of `batch`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    make, shape = MODELS[name]
    x, y = _data(shape, batch // world)
    steppers = {}
    monitors = []
    for variant in ("plain", "ddp"):
        torch.manual_seed(0)
        model = DDP(make())
        monitor = NoiseScaleMonitor(model, "ddp") if variant == "ddp" else None
        if monitor is not None:
            monitors.append(monitor)
        steppers[variant] = _stepper(model, x, y, 1, monitor)
    # Both ranks run the same schedule, so the collectives pair up.
    seconds = _time_side_by_side(steppers, rounds, steps)
    for monitor in monitors:
        monitor.close()  # waits for its last all-reduce: no collective left in flight
    return seconds["ddp"] / seconds["plain"]


def _ddp_worker(rank: int, world: int, store: str, out: str, rounds: int, steps: int,
                batch_sizes: tuple[int, ...], models: tuple[str, ...]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    clean = False
    try:
        results = {f"{name}/{batch}": _ddp_ratio(name, batch, world, rounds, steps)
                   for name in models for batch in batch_sizes}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        clean = True
    finally:
        close_process_group(clean)


def _ddp_ratios(rounds: int, steps: int, batch_sizes: tuple[int, ...], models: tuple[str, ...]
                ) -> dict[str, float]:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "ddp.json"
        store = str(Path(folder) / "store")
        mp.spawn(_ddp_worker, args=(2, store, str(out), rounds, steps, batch_sizes, models),
                 nprocs=2)
        result: dict[str, float] = json.loads(out.read_text())
        return result


def main(argv: list[str]) -> dict[str, Any]:
    import argparse

    parser = argparse.ArgumentParser(prog="gnsweep bench noise",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 9.")
    parser.add_argument("--no-ddp", action="store_true", help="Skip the two-process DDP part.")
    parser.add_argument("--rounds", type=int, default=0, help="Rounds (overrides --quick).")
    parser.add_argument("--steps", type=int, default=HESSIAN_EVERY,
                        help=f"Steps per variant and round (default {HESSIAN_EVERY}).")
    parser.add_argument("--batch-sizes", type=lambda s: tuple(int(b) for b in s.split(",")),
                        default=BATCH_SIZES, help="Comma-separated (default "
                        f"{','.join(map(str, BATCH_SIZES))}).")
    parser.add_argument("--models", type=lambda s: tuple(s.split(",")), default=tuple(MODELS),
                        help=f"Comma-separated, of {','.join(MODELS)} (default all).")
    args = parser.parse_args(argv)
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
    rounds, steps = args.rounds or (3 if args.quick else 9), args.steps
    torch.set_num_threads(1)
    rows = []
    ddp = {} if args.no_ddp else _ddp_ratios(rounds, steps, args.batch_sizes, args.models)
    for name in args.models:
        for batch in args.batch_sizes:
            seconds = _time_side_by_side(_variants(name, batch), rounds, steps)
            plain = seconds["plain"]
            auto = _auto_method(name, batch)
            rows.append({
                "model": name, "batch": batch, "plain_ms": 1e3 * plain,
                "per_example": seconds["per_example"] / plain,
                "microbatch": seconds["microbatch"] / seconds["plain_split"],
                "microbatch_vs_unsplit": seconds["microbatch"] / plain,
                "hessian_steps": seconds["hessian_call"] / plain,
                "b_noise": 1 + seconds["hessian_call"] / plain / HESSIAN_EVERY,
                "ddp": ddp.get(f"{name}/{batch}", float("nan")),
                # What auto costs over the plain unsplit step: its splitting included.
                "auto": auto, "auto_cost": seconds["per_example"] / plain
                if auto == "per_example" else seconds["microbatch"] / plain,
            })
    columns = ["model", "batch", "plain_ms", "per_example", "microbatch",
               "microbatch_vs_unsplit", "hessian_steps", "b_noise", "ddp", "auto", "auto_cost"]
    print(f"noise-scale measurement cost (step time / plain step time, fastest of {rounds} "
          f"interleaved rounds, 1 thread; b_noise: one Hessian measurement every "
          f"{HESSIAN_EVERY} steps; microbatch: over the same {MICROBATCHES}-micro-batch loop; "
          "ddp: 2 gloo processes; auto: the method noise.method=auto keeps on one process, "
          "auto_cost: its step over the plain unsplit step)")
    width = {c: max(len(c), 6) for c in columns}
    print("  ".join(f"{c:>{width[c]}}" for c in columns))
    for row in rows:
        print("  ".join(f"{row[c]:>{width[c]}.3g}" if isinstance(row[c], float)
                        else f"{row[c]:>{width[c]}}" for c in columns))
    worst = {key: max(cast(float, r[key]) for r in rows) for key in TARGETS if key in rows[0]}
    result = {"subject": "noise", "rows": rows, "worst": worst, "targets": TARGETS,
              "hessian_every": HESSIAN_EVERY, "microbatches": MICROBATCHES}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
