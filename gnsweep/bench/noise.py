"""Cost of measuring the noise scale: step time with each method / plain step time.

`python -m gnsweep.bench noise` (or `gnsweep bench noise`). For a small MLP, a small CNN, the
same CNN with BatchNorm and a small GPT-2 (`bench.architectures.gpt2`) at a few batch sizes,
every variant runs in the same process, interleaved round by round, and the fastest round's
ratio is reported:

- per_example: one backward, hooks on every layer (NaN where the method would be wrong: a
  BatchNorm model's examples interact, so `noise.method=auto` measures it with micro-batches);
- microbatch: over the same 4-micro-batch accumulation loop without a monitor (the monitor's
  cost), and over one unsplit step (the monitor plus the splitting, if you would not split);
- B_noise: one Hessian measurement (`hessian_norms`) in plain steps (`hessian_steps`), and
  amortized over the default frequency, every 50 steps (`b_noise`, on top of B_simple's cost);
- ddp: two gloo processes, DDP with the hook / plain DDP (`--no-ddp` skips it);
- auto: the method `noise.method=auto` keeps on one process for the model and batch, and its
  step over the plain unsplit step (`auto_cost`: what a user pays);
- meets: whether the row meets the goals (`GOALS`): auto_cost <= 1.3 below batch 128 and <= 1.2
  from it, per_example <= 1.3 on models with convolutions; the rows that miss are named.

Flags: `--quick` (fewer rounds), `--no-ddp`, `--models`, `--batch-sizes`, `--round-seconds`,
`--device cuda` (one GPU; timings wait for the GPU's queue) and `--precision bf16` (the losses
under bf16 autocast, as `train.precision=bf16`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from gnsweep import allocator
from gnsweep.distributed import close_process_group
from gnsweep.measure import NoiseScaleMonitor, hessian_norms
from gnsweep.noise import Method

BATCH_SIZES = (32, 128, 512)
HESSIAN_EVERY = 50  # the default frequency of conf/noise/hessian.yaml
MICROBATCHES = 4
ROUND_SECONDS = 0.5
"""A variant's calls per round are cut to about this long (at least MIN_CALLS), so that the
large models' rows do not make the bench minutes longer; the small ones run all `--steps`."""
MIN_CALLS = 5
TARGETS = {"microbatch": 1.05, "ddp": 1.05, "per_example": 1.3, "b_noise": 1.2}
GOALS = {"auto_small": 1.3, "auto_large": 1.2, "per_example_conv": 1.3}
"""What `meets` checks: auto_cost <= auto_small below batch LARGE_FROM and <= auto_large from it;
per_example <= per_example_conv on models with convolutions (where it is right for them)."""
LARGE_FROM = 128
PLACE: dict[str, Any] = {"device": torch.device("cpu"), "bf16": False}
"""Where the single-process variants run (`--device`, `--precision`)."""


def _on(value: Any) -> Any:
    """A model or a batch (tensors, tuples of them) on the bench's device."""
    device = PLACE["device"]
    if isinstance(value, (nn.Module, torch.Tensor)):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_on(v) for v in value)
    return value


def _loss(subject: Subject, model: nn.Module, batch: Any) -> torch.Tensor:
    if not PLACE["bf16"]:
        return subject.loss(model, batch)
    with torch.autocast(PLACE["device"].type, dtype=torch.bfloat16):
        return subject.loss(model, batch)


def _sync() -> None:
    if PLACE["device"].type == "cuda":
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Subject:
    """A benchmarked model: a fresh copy (seeded), a batch of n examples, its batch-mean loss."""

    make: Callable[[], nn.Module]
    data: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 10))


def _cnn(norm: Callable[[int], nn.Module] | None = None) -> nn.Module:
    def after(channels: int) -> list[nn.Module]:
        return [norm(channels)] if norm is not None else []

    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), *after(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), *after(32), nn.ReLU(),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


def _classification(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _images(shape: tuple[int, ...]) -> Callable[[int], Any]:
    def data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return torch.randn(batch, *shape, generator=g), torch.randint(10, (batch,), generator=g)

    return data


def _gpt2() -> Subject:
    """`bench.architectures.gpt2` (transformers' GPT-2, 2 layers, width 24, 12 tokens)."""
    from gnsweep.bench.architectures import gpt2

    arch = gpt2(0)

    def make() -> nn.Module:
        return gpt2(0).model

    def data(batch: int) -> Any:
        return arch.sample(batch, torch.Generator().manual_seed(0))

    return Subject(make, data, arch.loss)


MODELS: dict[str, Callable[[], Subject]] = {
    "mlp": lambda: Subject(_mlp, _images((64,)), _classification),
    "cnn": lambda: Subject(_cnn, _images((1, 16, 16)), _classification),
    "cnn_batchnorm": lambda: Subject(lambda: _cnn(nn.BatchNorm2d), _images((1, 16, 16)),
                                     _classification),
    "gpt2": _gpt2}


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def _split(batch: Any, k: int) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(k))
    return [type(batch)(parts) for parts in zip(*(t.tensor_split(k) for t in batch), strict=True)]


def _size(batch: Any) -> int:
    return len(batch if isinstance(batch, torch.Tensor) else batch[0])


def _stepper(subject: Subject, model: nn.Module, batch: Any, k: int,
             monitor: NoiseScaleMonitor | None) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    pieces = _split(batch, k) if k > 1 else [batch]
    n = _size(batch)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for piece in pieces:
            (_loss(subject, model, piece) * (_size(piece) / n)).backward()
            if monitor is not None:
                monitor.accumulate()
        if monitor is not None:
            monitor.step(batch=batch)
        optimizer.step()

    return step


def _variants(subject: Subject, batch_size: int) -> dict[str, Callable[[], object]]:
    """Every timed variant; a method that would measure this model wrong (per-example norms of
    a BatchNorm model), or a Hessian measurement the model's ops cannot differentiate twice,
    is left out, and its column is NaN."""
    batch = _on(subject.data(batch_size))
    torch.manual_seed(0)
    hessian_model = _on(subject.make())
    out: dict[str, Callable[[], object]] = {}

    def hessian_call() -> object:
        return hessian_norms(hessian_model, None, batch, 2, task_loss=subject.loss)

    try:  # double backward is not implemented for every op (torch.cdist, CTC loss)
        hessian_call()
        # One B_noise measurement on its own (timed per call, amortized over HESSIAN_EVERY).
        out["hessian_call"] = hessian_call
    except RuntimeError:
        pass
    for variant in ("plain", "plain_split", Method.PER_EXAMPLE, Method.MICROBATCH):
        torch.manual_seed(0)
        model = _on(subject.make())
        monitor = None
        if variant in (Method.PER_EXAMPLE, Method.MICROBATCH):
            try:
                monitor = NoiseScaleMonitor(model, variant)
            except ValueError:  # wrong for this model: refused, not timed
                continue
        k = MICROBATCHES if variant in ("plain_split", Method.MICROBATCH) else 1
        out[variant] = _stepper(subject, model, batch, k, monitor)
    return out


def _auto_method(subject: Subject, batch_size: int) -> str:
    """The method `noise.method=auto` keeps for this model and batch on one process (the
    training loop's monitor, `timed_auto`): per-example norms' choice is made after the first
    measured step."""
    batch = _on(subject.data(batch_size))
    torch.manual_seed(0)
    model = _on(subject.make())
    monitor = NoiseScaleMonitor(model, "auto", timed_auto=True)
    try:  # one measured step as the training loop takes it (split where the monitor says)
        pieces = _split(batch, MICROBATCHES) if monitor.needs_microbatches else [batch]
        for piece in pieces:
            (_loss(subject, model, piece) * (_size(piece) / _size(batch))).backward()
            monitor.accumulate()
        monitor.step()
    finally:
        monitor.close()
    return monitor.method


def _time_side_by_side(steppers: Mapping[str, Callable[[], object]], rounds: int, steps: int,
                       round_seconds: float = math.inf,
                       agree: Callable[[int], int] | None = None) -> dict[str, float]:
    """Seconds per call of each variant: the variants interleaved round by round, the fastest
    round of each (other load on the machine only ever adds time). Calls per round: `steps`,
    cut to about `round_seconds` for the slowest variant (at least MIN_CALLS); `agree` makes
    the ranks of a process group run the same count (their collectives pair up)."""
    warm: dict[str, float] = {}
    for key, fn in steppers.items():  # warm-up, and the time of one call
        for _ in range(3):
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            warm[key] = time.perf_counter() - start
    slowest = max(t for k, t in warm.items() if k != "hessian_call")
    steps = min(steps, max(MIN_CALLS, math.ceil(round_seconds / slowest))) \
        if math.isfinite(round_seconds) else steps
    if agree is not None:
        steps = agree(steps)
    times: dict[str, list[float]] = {k: [] for k in steppers}
    for _ in range(rounds):
        for key, fn in steppers.items():
            calls = max(1, steps // 10) if key == "hessian_call" else steps
            _sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync()
            times[key].append((time.perf_counter() - start) / calls)
    return {k: min(v) for k, v in times.items()}


def _ddp_ratio(name: str, batch_size: int, world: int, rounds: int, steps: int,
               round_seconds: float) -> float:
    """DDP with the hook / plain DDP, this rank's share of `batch_size`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def agree(calls: int) -> int:  # the fewest calls any rank would make
        count = torch.tensor([calls])
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return int(count.item())

    subject = MODELS[name]()
    batch = subject.data(batch_size // world)
    steppers = {}
    monitors = []
    for variant in ("plain", Method.DDP):
        torch.manual_seed(0)
        model = DDP(subject.make())
        monitor = NoiseScaleMonitor(model, Method.DDP) if variant == Method.DDP else None
        if monitor is not None:
            monitors.append(monitor)
        steppers[variant] = _stepper(subject, model, batch, 1, monitor)
    # Both ranks run the same schedule, so the collectives pair up.
    try:
        seconds = _time_side_by_side(steppers, rounds, steps, round_seconds, agree)
    finally:
        for monitor in monitors:
            monitor.close()  # waits for its last all-reduce: no collective left in flight
    return seconds["ddp"] / seconds["plain"]


def _ddp_worker(rank: int, world: int, store: str, out: str, rounds: int, steps: int,
                batch_sizes: tuple[int, ...], models: tuple[str, ...],
                round_seconds: float) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    allocator.tune()  # a spawned process: as gnsweep's workers (gnsweep.allocator)
    # A bounded wait: a rank that died leaves the other at a collective, not for 30 minutes.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5))
    clean = False
    try:
        results = {f"{name}/{batch}": _ddp_ratio(name, batch, world, rounds, steps,
                                                 round_seconds)
                   for name in models for batch in batch_sizes}
        if rank == 0:  # whole or not at all: the parent reads it even if a process dies later
            partial = Path(f"{out}.part")
            partial.write_text(json.dumps(results))
            partial.replace(out)
        clean = True
    finally:
        close_process_group(clean)


def _ddp_ratios(rounds: int, steps: int, batch_sizes: tuple[int, ...], models: tuple[str, ...],
                round_seconds: float, attempts: int = 2) -> dict[str, float]:
    """The DDP ratios from two spawned processes. A process that dies after rank 0 wrote every
    ratio (at exit, in gloo's teardown) costs nothing measured: said, and the ratios kept; one
    that dies before is started again once (a fresh store and processes), then raised."""
    import tempfile

    import torch.multiprocessing as mp

    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory(prefix="gnsweep-bench-ddp-") as folder:
            out = Path(folder) / "ddp.json"
            store = str(Path(folder) / "store")
            try:
                mp.spawn(_ddp_worker, args=(2, store, str(out), rounds, steps, batch_sizes,
                                            models, round_seconds), nprocs=2)
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
                if out.exists():
                    print(f"noise bench, ddp: a process failed after the results were written "
                          f"(kept): {str(err).strip().splitlines()[-1]}")
                elif attempt < attempts:
                    print(f"noise bench, ddp: {str(err).strip().splitlines()[-1]}; "
                          "starting the two processes again")
                    continue
                else:
                    raise
            result: dict[str, float] = json.loads(out.read_text())
            return result
    raise AssertionError("unreachable")


def misses(row: Mapping[str, Any]) -> list[str]:
    """What a row of the table misses of `GOALS` (empty: it meets them)."""
    out = []
    goal = GOALS["auto_small"] if row["batch"] < LARGE_FROM else GOALS["auto_large"]
    if not row["auto_cost"] <= goal:
        out.append(f"auto_cost {row['auto_cost']:.3g} > {goal:g}")
    if row["conv"] and math.isfinite(row["per_example"]) \
            and row["per_example"] > GOALS["per_example_conv"]:
        out.append(f"per_example {row['per_example']:.3g} > {GOALS['per_example_conv']:g} "
                   "(convolutions)")
    return out


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
    parser.add_argument("--round-seconds", type=float, default=ROUND_SECONDS,
                        help="Cut a variant's calls per round to about this long (at least "
                        f"{MIN_CALLS}; default {ROUND_SECONDS}; 0: every --steps).")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="Where the single-process variants run (DDP stays on gloo/CPU).")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU")
    PLACE.update(device=torch.device(args.device), bf16=args.precision == "bf16")
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
    rounds, steps = args.rounds or (3 if args.quick else 9), args.steps
    round_seconds = args.round_seconds if args.round_seconds > 0 else math.inf
    torch.set_num_threads(1)
    rows = []
    ddp = {} if args.no_ddp else _ddp_ratios(rounds, steps, args.batch_sizes, args.models,
                                             round_seconds)
    nan = float("nan")
    for name in args.models:
        subject = MODELS[name]()
        conv = _has_conv(subject.make())
        for batch in args.batch_sizes:
            seconds = _time_side_by_side(_variants(subject, batch), rounds, steps,
                                         round_seconds)
            plain = seconds["plain"]
            auto = _auto_method(subject, batch)
            row: dict[str, Any] = {
                "model": name, "batch": batch, "plain_ms": 1e3 * plain,
                "per_example": seconds.get("per_example", nan) / plain,
                "microbatch": seconds["microbatch"] / seconds["plain_split"],
                "microbatch_vs_unsplit": seconds["microbatch"] / plain,
                "hessian_steps": seconds.get("hessian_call", nan) / plain,
                "b_noise": 1 + seconds.get("hessian_call", nan) / plain / HESSIAN_EVERY,
                "ddp": ddp.get(f"{name}/{batch}", nan),
                # What auto costs over the plain unsplit step: its splitting included.
                "auto": auto, "auto_cost": seconds[auto] / plain, "conv": conv}
            row["misses"] = misses(row)
            row["meets"] = not row["misses"]
            rows.append(row)
    columns = ["model", "batch", "plain_ms", "per_example", "microbatch",
               "microbatch_vs_unsplit", "hessian_steps", "b_noise", "ddp", "auto", "auto_cost",
               "meets"]
    print(f"noise-scale measurement cost (step time / plain step time, fastest of {rounds} "
          f"interleaved rounds, 1 thread; b_noise: one Hessian measurement every "
          f"{HESSIAN_EVERY} steps; microbatch: over the same {MICROBATCHES}-micro-batch loop; "
          "ddp: 2 gloo processes; auto: the method noise.method=auto keeps on one process, "
          "auto_cost: its step over the plain unsplit step; nan: a method wrong for the model, "
          f"or ops without double backward for the Hessian, not timed; {allocator.described()})")
    width = {c: max(len(c), 6) for c in columns}
    for name in ("model", "auto"):
        width[name] = max(width[name], *(len(r[name]) for r in rows))
    print("  ".join(f"{c:>{width[c]}}" for c in columns))
    for row in rows:
        cells = {**row, "meets": "yes" if row["meets"] else "no"}
        print("  ".join(f"{cells[c]:>{width[c]}.3g}" if isinstance(cells[c], float)
                        else f"{cells[c]:>{width[c]}}" for c in columns))
    print(f"goals (meets): auto_cost <= {GOALS['auto_small']:g} below batch {LARGE_FROM}, <= "
          f"{GOALS['auto_large']:g} from it; per_example <= {GOALS['per_example_conv']:g} on "
          "models with convolutions")
    missed = [f"{r['model']} {r['batch']}: {'; '.join(r['misses'])}" for r in rows if r["misses"]]
    print("every row meets them" if not missed else "rows that miss: " + ", ".join(missed))
    worst = {key: max((cast(float, r[key]) for r in rows if math.isfinite(r[key])),
                      default=nan) for key in TARGETS if key in rows[0]}
    result = {"subject": "noise", "rows": rows, "worst": worst, "targets": TARGETS,
              "goals": GOALS, "all_meet": not missed, "hessian_every": HESSIAN_EVERY,
              "microbatches": MICROBATCHES}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    import sys

    allocator.tune()
    main(sys.argv[1:])
