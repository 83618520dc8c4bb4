"""What measuring costs the user's sweep: the training wall time of a run with the noise scale
measured over the same run with measurement off (`noise.method=none`).

`python -m gnsweep.bench sweep_cost` (or `gnsweep bench sweep_cost`). Each model trains short
runs through gnsweep's own loop (`gnsweep.training.run`: the batch drawn, split where the
measurement needs it, the monitor's step, the optimizer's), one run per variant and round, the
variants interleaved round by round; each variant's fastest round is kept (other load on the
machine only ever adds time) and divided by the fastest run with measurement off:

- default: the settings a sweep runs with (`noise.method=auto`, `noise.every=auto`); its share
  of steps measured (`default_share`), its B_simple's relative standard error at the end
  (`default_rel_se`) and the method it measured with (`default_method`: under Adam, whose
  preconditioned pair cuts measured steps into micro-batches anyway, `microbatch`) beside it;
- every_step: `noise.method=auto` with `noise.every=1` (what the checks compare B_simple with);
- per_example, microbatch, norm_layers: each method on every step (NaN where it is refused for
  the model: norm_layers without LayerNorm/RMSNorm layers).

Models: the digits MLP (`task=digits`, batch 128), the character LM (`task=chars`) at 8 and 64
windows (512 and 4,096 tokens a step), the bench's CNN (`bench.noise`, 16x16 images, batch
128), GPT-2 (`bench.architectures.gpt2`, 2 layers, width 24, 12 tokens, batch 128) and a
Llama-style transformer with a custom RMSNorm and a broadcast position-embedding parameter
(`bench.architectures.llama`, the same sizes; `--models llama`).

Flags: `--models` (default mlp, cnn, gpt2, lm512: about 2 minutes on one loaded CPU core;
lm4096 takes as long again), `--steps` (a run's steps; default 40: too few for
`noise.every=auto` to skip a step, so measure a sweep's share at 200 or more), `--rounds`
(default 3), `--variants` (those run beside none and default, e.g. `--variants none` for long
runs; the others NaN), `--more` (every model, 200 steps, 5 rounds), `--device` (cpu or cuda),
`--precision` (fp32 or bf16), `--clock` (`wall`, or `cpu`: the process's CPU time, what a
run would take on an idle core where other jobs load the machine), `--json PATH`. The
per-step ratios are `gnsweep bench noise`'s; the numbers are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gnsweep.noise import Method

VARIANTS: dict[str, dict[str, Any]] = {
    "none": {"method": "none"},
    "default": {},
    "every_step": {"every": 1},
    "per_example": {"method": "per_example", "every": 1},
    "microbatch": {"method": "microbatch", "every": 1},
    "norm_layers": {"method": "norm_layers", "every": 1},
}
"""noise.* settings of each variant over the defaults (`none` is the baseline)."""
MODELS: dict[str, tuple[str, dict[str, Any], int, float, str]] = {
    # name: (task, task options, batch size, learning rate, optimizer)
    "mlp": ("digits", {}, 128, 0.1, "sgd"),
    "cnn": ("custom", {"_target_": "gnsweep.bench.sweep_cost.cnn_task"}, 128, 0.05, "sgd"),
    "gpt2": ("custom", {"_target_": "gnsweep.bench.sweep_cost.gpt2_task"}, 128, 0.01, "adam"),
    "llama": ("custom", {"_target_": "gnsweep.bench.sweep_cost.llama_task"}, 128, 0.01, "adam"),
    "lm512": ("chars", {"eval_windows": 0}, 8, 0.004, "adam"),
    "lm4096": ("chars", {"eval_windows": 0}, 64, 0.004, "adam"),
}
STEPS, ROUNDS = 40, 3
DEFAULT_MODELS = ("mlp", "cnn", "gpt2", "lm512")


class _BenchTask:
    """A bench model as a task: fresh batches from a generator, its own loss."""

    def __init__(self, make: Callable[[], nn.Module], sample: Callable[[int, torch.Generator],
                 Any], loss: Callable[[nn.Module, Any], torch.Tensor], seed: int) -> None:
        self._make, self._sample, self.loss, self.seed = make, sample, loss, seed

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self._make()

    def sample(self, batch_size: int, generator: torch.Generator) -> Any:
        return self._sample(batch_size, generator)


def cnn_task(seed: int) -> _BenchTask:
    """`bench.noise`'s CNN (conv 1->16, conv 16->32 stride 2, linear) on random 16x16 images
    with random labels."""
    from gnsweep.bench.noise import _classification, _cnn

    def sample(batch: int, generator: torch.Generator) -> Any:
        return (torch.randn(batch, 1, 16, 16, generator=generator),
                torch.randint(10, (batch,), generator=generator))

    return _BenchTask(_cnn, sample, _classification, seed)


def gpt2_task(seed: int) -> _BenchTask:
    """`bench.architectures.gpt2` (transformers' GPT-2, 2 layers, width 24, 12 tokens) on its
    Markov-chain tokens."""
    from gnsweep.bench.architectures import gpt2

    arch = gpt2(seed)
    return _BenchTask(lambda: gpt2(seed).model, arch.sample, arch.loss, seed)


def llama_task(seed: int) -> _BenchTask:
    """`bench.architectures.llama` (custom RMSNorm, SwiGLU, a broadcast position-embedding
    parameter; 2 layers, width 24, 12 tokens) on Markov-chain tokens."""
    from gnsweep.bench.architectures import llama

    arch = llama(seed)
    return _BenchTask(lambda: llama(seed).model, arch.sample, arch.loss, seed)


def _config(model: str, noise: dict[str, Any], steps: int, precision: str) -> Any:
    from gnsweep.config import Config, NoiseConfig, SweepConfig, TaskConfig, TrainConfig

    task, options, batch, lr, optimizer = MODELS[model]
    return Config(task=TaskConfig(name=task, options=dict(options)),
                  sweep=SweepConfig(batch_sizes=[batch], learning_rates=[lr], targets=[1e-9],
                                    max_steps=steps, eval_every=0, log_every=steps),
                  noise=NoiseConfig(**noise),
                  train=TrainConfig(optimizer=optimizer, precision=precision))


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""`--clock`: wall time, or this process's CPU time (on a machine loaded by other jobs, what
the run would take on an idle core: the loop runs on one thread)."""


def _one_run(model: str, noise: dict[str, Any], steps: int, precision: str,
             clock: str = "wall") -> tuple[float, float, float, str]:
    """(seconds of the run's training loop on `clock`, share of steps measured, B_simple's
    relative standard error at its end, the method it measured with)."""
    from gnsweep.runs import RunSpec
    from gnsweep.training import build_run, run

    _, _, batch, lr, _ = MODELS[model]
    state = build_run(_config(model, noise, steps, precision),
                      RunSpec(batch_size=batch, learning_rate=lr))
    tick = CLOCKS[clock]
    start = tick()
    run(state)
    seconds = tick() - start
    estimate = state.estimate
    rel = math.nan if estimate is None or not estimate.b_simple else \
        estimate.b_simple_se / abs(estimate.b_simple)
    return seconds, state.monitor.schedule.share, rel, state.monitor.measures


def measure(model: str, steps: int, rounds: int, precision: str = "fp32",
            only: tuple[str, ...] = tuple(VARIANTS), clock: str = "wall") -> dict[str, Any]:
    """One model's row: each variant's fastest run over the fastest run with measurement
    off, the variants interleaved round by round. `only`: the variants run (`none` and
    `default` always; the others NaN)."""
    variants = {name: VARIANTS[name] for name in VARIANTS
                if name in only or name in (Method.NONE, "default")}
    best: dict[str, float] = {}
    shares: dict[str, float] = {}
    errors: dict[str, float] = {}
    methods: dict[str, str] = {}
    for name in list(variants):  # a refused method (no norm layers) is left out: NaN
        try:
            _one_run(model, variants[name], 2, precision)  # warm-up, and the refusal
        except ValueError:
            del variants[name]
    for _ in range(rounds):
        for name, noise in variants.items():
            seconds, share, rel, method = _one_run(model, noise, steps, precision, clock)
            best[name] = min(best.get(name, math.inf), seconds)
            shares[name], errors[name], methods[name] = share, rel, method
    base = best["none"]
    row: dict[str, Any] = {"model": model, "steps": steps, "none_s": round(base, 4)}
    for name in VARIANTS:
        if name != Method.NONE:
            row[name] = round(best[name] / base, 3) if name in best else math.nan
    row["default_share"] = round(shares["default"], 3)
    row["default_rel_se"] = round(errors["default"], 3)
    row["default_method"] = methods["default"]
    return row


SWEEPS: dict[str, list[str]] = {
    # The default sweep (`make demo`): digits, 8 batch sizes x 7 learning rates, 3 targets.
    "digits": [],
    # A small language-model sweep: the character LM (Adam), 3 batch sizes x 5 rates a
    # factor 2 apart (the chars sweep's rates and one below, one above).
    "lm": ["task=chars", "sweep=chars", "sweep.name=chars_bench",
           "sweep.batch_sizes=[4,16,64]",
           "sweep.learning_rates=[0.002,0.004,0.008,0.016,0.032]",
           "sweep.targets=[2.9,2.6]", "sweep.max_steps=800"],
    # For the bench's own test: a few seconds.
    "tiny": ["sweep=tiny", "sweep.batch_sizes=[32]", "sweep.targets=[0.5]",
             "sweep.max_steps=80"],
    # The default sweep's grid, each run a plain script with 4 micro-batches a step
    # (`accumulating_script`), measured by the in-script probe with no line added. About 4
    # minutes a launch here: 56 processes, each importing torch.
    "script": ["task=script", "sweep.name=script_bench", "task.accumulation=4",
               "task.command={python} -m gnsweep.bench.accumulating_script "
               "--batch-size={batch_size} --accumulation={accumulation} --lr={learning_rate} "
               "--seed={seed} --max-steps={max_steps} --cpu-out={cpu_dir}/{run_id}.json",
               r"task.log_pattern=step (?P<step>\d+) loss (?P<loss>\S+)",
               "sweep.batch_sizes=[8,16,32,64,128,256,512,1024]",
               "sweep.learning_rates=[0.1,0.2,0.4,0.8,1.6,3.2,6.4]",
               "sweep.targets=[0.3,0.1,0.03]"],
}
"""`--sweeps`: whole sweeps launched as a user launches them (`gnsweep launch`). In a script
sweep's command, `{python}` is this interpreter and `{cpu_dir}` a folder of the bench's where
the script writes its training CPU time by step (filled before the launch; the other
placeholders are gnsweep's)."""
SWEEP_VARIANTS: dict[str, list[str]] = {
    "none": ["noise.method=none"],
    "default": [],
    "full": ["noise.runs=all", "noise.every=1"],
}
"""The whole-sweep variants: measurement off, the defaults (noise.runs=auto, noise.every=auto),
and the full measurement (every run, every step) the default's B_simple is compared with."""
B_SIMPLE_TOLERANCE = 0.15
"""A target's B_simple agrees with the full measurement's within this share, or within two of
the two standard errors combined."""


def agreement(value: float, se: float, full: float, full_se: float) -> dict[str, Any]:
    """A target's B_simple against the full measurement's: their ratio, and whether they agree
    (within `B_SIMPLE_TOLERANCE`, or within two of their standard errors combined in
    quadrature, the finite ones). A NaN on either side never agrees."""
    ratio = value / full if full > 0 and math.isfinite(value) else math.nan
    errors = [e for e in (se, full_se) if math.isfinite(e)]
    both = math.hypot(*errors) if errors else math.nan
    agrees = bool(abs(ratio - 1) <= B_SIMPLE_TOLERANCE
                  or (math.isfinite(both) and abs(value - full) <= 2 * both))
    return {"b_simple": round(value, 4), "se": round(se, 4), "full": round(full, 4),
            "full_se": round(full_se, 4), "ratio": round(ratio, 3), "agrees": agrees}


def _launch(sweep: str, variant: str, folder: Path
            ) -> tuple[float, dict[str, float], float]:
    """Launch one whole sweep in `folder` (a fresh one) as a user would: (the sum of its runs'
    training time, each run's status.json `train_seconds`; each run's training CPU time,
    `train_cpu_seconds`, by run id: the sweep's compute; the CPU time of the whole launch,
    its workers' start and the launch's own work included)."""
    import resource
    import shutil
    import subprocess
    import sys

    from gnsweep import store
    from gnsweep.paths import run_dir

    def cpu() -> float:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return used.ru_utime + used.ru_stime

    cpu_dir = folder.with_name(folder.name + "_cpu")
    shutil.rmtree(cpu_dir, ignore_errors=True)
    cpu_dir.mkdir(parents=True)
    overrides = [o.replace("{python}", sys.executable).replace("{cpu_dir}", str(cpu_dir))
                 for o in SWEEPS[sweep]]
    command = [sys.executable, "-m", "gnsweep", "launch", "--sweep-dir", str(folder), "--quiet",
               *overrides, *SWEEP_VARIANTS[variant]]
    before = cpu()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"sweep {sweep} ({variant}) failed: {done.stderr.strip()[-400:]}")
    statuses = {r: store.read_status(run_dir(folder, r)) for r in store.run_ids(folder)}
    trained = {r: s.train_cpu_seconds or _script_cpu(cpu_dir / f"{r}.json", s.steps)
               for r, s in statuses.items()}
    return (sum(s.train_seconds or 0.0 for s in statuses.values()), trained, cpu() - before)


def _script_cpu(path: Path, steps: int | None) -> float:
    """A script run's training CPU seconds up to the last step gnsweep recorded (the script
    may take a step more before it is stopped); 0 without the script's file."""
    try:
        by_step = json.loads(path.read_text())["cpu"]
    except (OSError, ValueError, KeyError):
        return 0.0
    if not by_step or not steps:
        return 0.0
    return float(by_step[min(steps, len(by_step)) - 1])


def _b_simple(folder: Path) -> dict[float, tuple[float, float]]:
    """Each target's B_simple at target and its standard error (fits.parquet), analysed."""
    from gnsweep.commands.analyze import analyze_sweep

    fits = analyze_sweep(folder).fits
    return {float(r.target): (float(r.b_simple_at_target), float(r.b_simple_at_target_se))
            for r in fits.itertuples(index=False)}


def measure_sweep(sweep: str, rounds: int, work: Path) -> dict[str, Any]:
    """One whole sweep's row: the sum of its runs' training time with the defaults over the
    same with measurement off (wall: each variant's fastest of `rounds`; CPU: the sum of
    each run's fastest round), the variants interleaved round by round, and B_simple at each
    target against the full measurement's."""
    import shutil

    totals: dict[str, float] = {}
    fastest: dict[str, dict[str, float]] = {}
    cpus: dict[str, float] = {}
    for index in range(rounds):
        for variant in SWEEP_VARIANTS:
            folder = work / f"{sweep}_{variant}_{index}"
            shutil.rmtree(folder, ignore_errors=True)
            seconds, train_cpu, cpu = _launch(sweep, variant, folder)
            totals[variant] = min(totals.get(variant, math.inf), seconds)
            # Each run's fastest round: the same run trains the same steps every round, and
            # load from other jobs only ever adds to a run's CPU time (cache, memory bus).
            runs = fastest.setdefault(variant, {})
            for run_id, value in train_cpu.items():
                runs[run_id] = min(runs.get(run_id, math.inf), value)
            cpus[variant] = min(cpus.get(variant, math.inf), cpu)
    trained = {variant: sum(runs.values()) for variant, runs in fastest.items()}
    last = rounds - 1
    default = _b_simple(work / f"{sweep}_default_{last}")
    full = _b_simple(work / f"{sweep}_full_{last}")
    targets = [{"target": target, **agreement(value, se, *full.get(target, (math.nan,
                                                                          math.nan)))}
               for target, (value, se) in sorted(default.items())]
    from gnsweep.folder import read_noise_plan
    from gnsweep.noise_plan import OFF

    plan = read_noise_plan(work / f"{sweep}_default_{last}")
    return {"sweep": sweep, "none_s": round(totals["none"], 2),
            "default": round(totals["default"] / totals["none"], 3),
            "full": round(totals["full"] / totals["none"], 3),
            "none_train_cpu_s": round(trained["none"], 2),
            "default_train_cpu": round(trained["default"] / trained["none"], 3),
            "full_train_cpu": round(trained["full"] / trained["none"], 3),
            "none_cpu_s": round(cpus["none"], 2),
            "default_cpu": round(cpus["default"] / cpus["none"], 3),
            "full_cpu": round(cpus["full"] / cpus["none"], 3),
            "runs_measured": f"{sum(a.role != OFF for a in plan.values())}/{len(plan)}",
            "targets": targets}


def sweeps_main(names: list[str], rounds: int, json_path: Path | None) -> dict[str, Any]:
    """`--sweeps`: the whole-sweep figure of each named sweep."""
    import tempfile

    unknown = [n for n in names if n not in SWEEPS]
    if unknown:
        raise SystemExit(f"bench sweep_cost: unknown sweep {unknown[0]!r}; choose from "
                         f"{', '.join(SWEEPS)}")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gnsweep-sweep-cost-") as work:
        rows = [measure_sweep(name, rounds, Path(work)) for name in names]
    print(f"sweep_cost --sweeps: the sum of a whole sweep's runs' training time / the same "
          f"sweep with noise.method=none (CPU time, which other jobs do not inflate; wall "
          f"clock; and the CPU time of the whole launch, process starts included; "
          f"fastest of {rounds}; load average "
          f"{load:.2f} on {os.cpu_count()} cores at the start); B_simple at each target "
          "against noise.runs=all noise.every=1")
    for row in rows:
        print(f"  {row['sweep']}: the runs' training CPU time: default "
              f"{row['default_train_cpu']}x, full {row['full_train_cpu']}x (none "
              f"{row['none_train_cpu_s']} s; {row['runs_measured']} runs measured); their "
              f"wall time: default {row['default']}x, full {row['full']}x (none "
              f"{row['none_s']} s); CPU time of the whole launch: default "
              f"{row['default_cpu']}x, full {row['full_cpu']}x (none {row['none_cpu_s']} s)")
        for t in row["targets"]:
            print(f"    target {t['target']:g}: B_simple {t['b_simple']:.4g} +- {t['se']:.2g}, "
                  f"full {t['full']:.4g} +- {t['full_se']:.2g} (ratio {t['ratio']}; "
                  f"{'agrees' if t['agrees'] else 'DISAGREES'})")
    out = {"subject": "sweep_cost", "sweeps": rows, "rounds": rounds, "load": round(load, 2)}
    print(json.dumps(out))
    if json_path is not None:
        json_path.write_text(json.dumps(out, indent=1))
    return out


@contextlib.contextmanager
def _gpus_hidden(hide: bool) -> Iterator[None]:
    """For a CPU bench: `build_run` places a run on a visible GPU, so none is visible while the
    runs train; the caller's CUDA_VISIBLE_DEVICES is put back after (a test session goes on)."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="gnsweep bench sweep_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds (default {ROUNDS}; 1 with --sweeps)")
    parser.add_argument("--more", action="store_true", help="200 steps a run, 5 rounds")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="the variants run (none and default always); the others NaN")
    parser.add_argument("--clock", default="wall", choices=tuple(CLOCKS),
                        help="wall time, or the process's CPU time (a loaded machine)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--sweeps", default="",
                        help="whole sweeps instead of runs: digits, lm, script, tiny")
    args, _ = parser.parse_known_args(argv)
    if args.sweeps:
        return sweeps_main([n for n in args.sweeps.split(",") if n],
                           args.rounds or 1, args.json)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"bench sweep_cost: unknown model {unknown[0]!r}; choose from "
                         f"{', '.join(MODELS)}")
    steps, rounds = (200, 5) if args.more else (args.steps, args.rounds or ROUNDS)
    if args.more and args.models == ",".join(DEFAULT_MODELS):
        models = list(MODELS)
    if args.device == "cpu":
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("bench sweep_cost: --device cuda, but torch sees no GPU")
    only = tuple(v for v in args.variants.split(",") if v)
    wrong = [v for v in only if v not in VARIANTS]
    if wrong:
        raise SystemExit(f"bench sweep_cost: unknown variant {wrong[0]!r}; choose from "
                         f"{', '.join(VARIANTS)}")
    with _gpus_hidden(args.device == "cpu"):
        rows = [measure(m, steps, rounds, args.precision, only, args.clock) for m in models]
    columns = ["model", "steps", "none_s", *[v for v in VARIANTS if v != Method.NONE],
               "default_share", "default_rel_se", "default_method"]
    print(f"sweep_cost: a run's training time / the same run with noise.method=none "
          f"({args.device}, {args.precision}, {args.clock} clock, fastest of {rounds} "
          "interleaved rounds)")
    print("  ".join(f"{c:>14}" for c in columns))
    for row in rows:
        print("  ".join(f"{row[c]:>14}" for c in columns))
    out = {"subject": "sweep_cost", "device": args.device, "precision": args.precision,
           "clock": args.clock, "rounds": rounds, "rows": rows}
    print(json.dumps(out))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return out
