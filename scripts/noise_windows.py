"""Measure noise-scale time windows against the exact truth on linreg (issue 9, item 1).

Trains linreg with plain SGD at each batch size's exact best learning rate (from
gnsweep.linreg_exact), with today's `NoiseScaleMonitor` (per-example norms, B_noise every
`--hessian-every` steps) feeding several `NoiseScaleEma` windows at once, and logs the task's
exact B_simple / B_noise at the parameters of every step (`LinReg.truth`). For each target
(reached by the exact population loss, so the window is the only thing compared) it prints the
S_min-weighted means (weights dS / (1 + b/B), as the analysis) of the measured and of the exact
values, per batch size and as the median over batch sizes (as `analyze` reports them), and the
oracle's ratio-of-expectations means.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/noise_windows.py --seeds 2
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import numpy as np
import torch

from gnsweep.analysis.smoothing import centred_ratio, interpolate_log_steps, pooled_probes
from gnsweep.linreg_exact import Problem, exact_truth
from gnsweep.measure import NoiseScaleMonitor, measure_noise_scale
from gnsweep.noise import NoiseScaleEma, ProbeSchedule, combine_parts, unbiased_g2_and_trace
from gnsweep.tasks import linreg

WINDOWS: dict[str, dict] = {
    "examples2048": {"ema_examples": 2048.0, "hessian_clock": "measurements"},
    "frac0.1": {"ema_fraction": 0.1},
    "frac0.2": {"ema_fraction": 0.2},
    "frac0.3": {"ema_fraction": 0.3},
}


CENTRED = (0.1, 0.2, 0.4)
"""Post-hoc centred windows (analysis.smoothing.centred_ratio) on the per-step raw estimates:
half-width max(f * steps so far, MIN_EXAMPLES / B steps)."""
MIN_EXAMPLES = 64.0
PROBE = {"per_octave": 2, "batch": 512, "batches": 8, "hessian_microbatches": 4}
"""Frozen-parameter probes at log-spaced points in examples: `batches` fresh batches of `batch`
examples pooled at fixed parameters (measure_noise_scale), B_noise from `hessian_microbatches`
micro-batches of half of each batch (b_big = batch / 2);
the per-step value between probes is interpolated linearly in log steps."""
POOL_OCTAVES = 1.0
"""The "pooled" variant: probes within this many octaves of steps either side are pooled."""


class Tee:
    """Feeds one monitor's measurements to several windows (answers with the first), and keeps
    this step's raw unbiased estimates (eq. A.2) for the post-hoc centred windows."""

    def __init__(self, emas: dict[str, NoiseScaleEma]) -> None:
        self.emas = emas
        self.raw = [math.nan] * 4  # g2, trace, ghg, htrace of the current step

    def update_parts(self, parts, **kwargs):
        self.raw[0], self.raw[1] = combine_parts(parts)
        answers = [e.update_parts(parts, **kwargs) for e in self.emas.values()]
        return answers[0]

    def update_hessian(self, *args):
        self.raw[2], self.raw[3] = unbiased_g2_and_trace(*args)
        answers = [e.update_hessian(*args) for e in self.emas.values()]
        return answers[0]


def make_task(dim: int, condition: float, noise: float, teacher_power: float, seed: int
              ) -> linreg.LinReg:
    task = linreg.make(linreg.Options(dim=dim, condition=condition, noise=noise, eval_size=0),
                       seed)
    # The proposed `teacher_power` option: w*_i = z_i lam_i^(-p/2), p = 1 gives every
    # eigen-direction the same expected share of the initial loss.
    task.w_star = task.w_star * task.variances ** (-teacher_power / 2)
    return task


def problem_of(task: linreg.LinReg) -> Problem:
    model = task.model()
    d0 = np.concatenate([model.weight.detach().double().numpy().ravel() - task.w_star.numpy(),
                         model.bias.detach().double().numpy()])
    return Problem.linreg(task.variances.numpy(), d0, task.options.noise)


def run(task: linreg.LinReg, batch: int, lr: float, hardest: float, hessian_every: int,
        seed: int, max_steps: int, margin: float) -> dict[str, np.ndarray]:
    model = task.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    monitor = NoiseScaleMonitor(model, "per_example", loss_fn=task.loss,
                                hessian_every=hessian_every)
    emas = {name: NoiseScaleEma(**kw) for name, kw in WINDOWS.items()}
    tee = Tee(emas)
    monitor.ema = tee  # type: ignore[assignment]
    rng = torch.Generator().manual_seed(10_000 + seed)
    rows: dict[str, list[float]] = {k: [] for k in ("loss", "bs_true", "bn_true", "g2", "trace",
                                                    "ghg", "htrace")}
    for name in emas:
        rows |= {f"bs_{name}": [], f"bn_{name}": [], f"drift_{name}": []}
    stop = max_steps
    probe_rng = torch.Generator().manual_seed(20_000 + seed)
    probes: list[tuple[float, ...]] = []
    schedule, probe_cost = ProbeSchedule(PROBE["per_octave"]), 0.0
    for step in range(max_steps):
        if schedule.due(step * batch):
            begin = time.perf_counter()
            batches = [task.batch(PROBE["batch"], probe_rng) for _ in range(PROBE["batches"])]
            # On a copy: the training monitor's hooks would see the probe's batches.
            est = measure_noise_scale(copy.deepcopy(model), task.loss, batches, hessian=True,
                                      hessian_microbatches=PROBE["hessian_microbatches"])
            probes.append((float(step), est.b_simple, est.b_noise, est.trace_sigma, est.g2,
                           est.trace_h_sigma, est.g_h_g))
            probe_cost += time.perf_counter() - begin
        truth = task.truth(model)  # the parameters this step's gradient is taken at
        rows["loss"].append(truth.loss)
        rows["bs_true"].append(truth.b_simple)
        rows["bn_true"].append(truth.b_noise)
        if truth.loss <= hardest and stop == max_steps:
            # Run on past the hardest target so that centred windows there are whole.
            stop = step + math.ceil(margin * step)
        if step >= stop:
            break
        tee.raw = [math.nan] * 4
        x, y = task.batch(batch, rng)
        optimizer.zero_grad(set_to_none=True)
        task.loss(model(x), y).backward()
        monitor.step(batch=(x, y))
        optimizer.step()
        for name, ema in emas.items():
            est = ema.estimate()
            rows[f"bs_{name}"].append(est.b_simple)
            rows[f"bn_{name}"].append(est.b_noise)
            rows[f"drift_{name}"].append(ema.drift)
        for key, value in zip(("g2", "trace", "ghg", "htrace"), tee.raw, strict=True):
            rows[key].append(value)
    monitor.close()
    out = {k: np.asarray(v, float) for k, v in rows.items()}
    # Row s (0-based) holds the values at the parameters after s updates (before update s+1).
    x = np.arange(len(out["g2"]), dtype=float)
    at = np.array(probes)
    for col, q in ((1, "bs"), (2, "bn")):
        out[f"{q}_probes"] = interpolate_log_steps(at[:, 0], at[:, col], x)
    # Pooled: numerator and denominator smoothed across neighbouring probes (a centred window
    # of POOL_OCTAVES either side in log steps) before the ratio, which shrinks the bias of a
    # ratio of finite pools.
    for q, num, den in (("bs", 3, 4), ("bn", 5, 6)):
        out[f"{q}_pooled"] = pooled_probes(at[:, 0], at[:, num], at[:, den], x, POOL_OCTAVES)
    out["probe_seconds"] = np.array([probe_cost, len(probes)])
    for f in CENTRED:
        out[f"bs_centred{f:g}"] = centred_ratio(x, out["trace"], out["g2"], f, MIN_EXAMPLES / batch)
        out[f"bn_centred{f:g}"] = centred_ratio(x, out["htrace"], out["ghg"], f,
                                                MIN_EXAMPLES / batch)
    return out


def weighted_mean(b: np.ndarray, batch: float, steps: int) -> float:
    b = b[:steps]
    ok = np.isfinite(b) & (b / batch > -1)
    w = np.where(ok, 1.0 / (1.0 + np.where(ok, b, 0) / batch), 0.0)
    return float((w * np.where(ok, b, 0)).sum() / w.sum()) if w.sum() > 0 else math.nan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--condition", type=float, default=100.0)
    parser.add_argument("--noise", type=float, default=0.5)
    parser.add_argument("--teacher-power", type=float, default=1.0)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.25, 0.2])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128,
                                                                        256])
    parser.add_argument("--hessian-every", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--probe-batches", type=int, default=PROBE["batches"])
    parser.add_argument("--probe-per-octave", type=float, default=PROBE["per_octave"])
    parser.add_argument("--margin", type=float, default=0.25,
                        help="steps past the hardest target, as a fraction of the steps to it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    PROBE.update(batches=args.probe_batches, per_octave=args.probe_per_octave)
    targets = sorted(args.targets, reverse=True)
    task = make_task(args.dim, args.condition, args.noise, args.teacher_power, 0)
    truth = exact_truth(problem_of(task), args.batch_sizes, targets, limits=False)
    print("exact (oracle, ratio of expectations, median over B):")
    for t in truth.per_target:
        print(f"  target {t.target:g}: B_crit(fit) {t.b_crit_fit:.1f}  B_simple mean "
              f"{t.b_simple_mean:.1f}  B_noise mean {t.b_noise_mean:.1f}")
    # per[target][quantity][B] -> list over seeds
    windows = [*WINDOWS, *(f"centred{f:g}" for f in CENTRED), "probes", "pooled"]
    names = ["true", *windows]
    per = {t: {f"{q}_{n}": {b: [] for b in args.batch_sizes} for q in ("bs", "bn")
               for n in names} for t in targets}
    drift_share = {n: [] for n in WINDOWS}
    steps_total, start = 0, time.perf_counter()
    probe_total, probe_count = 0.0, 0
    for j, batch in enumerate(args.batch_sizes):
        lr = float(truth.best_lr[-1, j])
        for seed in range(args.seeds):
            rows = run(task, batch, lr, targets[-1], args.hessian_every, seed,
                       int(5 * truth.steps[-1, j]) + 50, args.margin)
            n_rows = len(rows["bs_frac0.2"])
            steps_total += n_rows
            probe_total += rows["probe_seconds"][0]
            probe_count += int(rows["probe_seconds"][1])
            for n in WINDOWS:
                d = rows[f"drift_{n}"]
                drift_share[n].append(float(np.mean(np.isfinite(d) & ((d > 2) | (d < 0.5)))))
            for t in targets:
                hit = np.flatnonzero(rows["loss"] <= t)
                if not len(hit):
                    continue
                s = int(hit[0])  # updates needed; rows 0..s-1 are the steps taken
                for n in names:
                    for q in ("bs", "bn"):
                        per[t][f"{q}_{n}"][batch].append(weighted_mean(rows[f"{q}_{n}"], batch, s))
    elapsed = time.perf_counter() - start
    print(f"{steps_total} steps in {elapsed:.1f} s ({1e3 * elapsed / steps_total:.2f} ms/step, "
          f"hessian every {args.hessian_every}; of which {probe_total:.1f} s in {probe_count} "
          "probes)")
    print("share of steps flagged |G|^2 drift > 2x in window:",
          {n: round(float(np.mean(v)), 3) for n, v in drift_share.items()})
    for k, t in enumerate(targets):
        print(f"target {t:g}:")
        for q, label in (("bs", "B_simple"), ("bn", "B_noise")):
            med = {n: float(np.nanmedian([np.mean(v) for v in per[t][f"{q}_{n}"].values()
                                          if v])) for n in names}
            exact = truth.per_target[k].b_simple_mean if q == "bs" else \
                truth.per_target[k].b_noise_mean
            ratios = " ".join(f"{n} {med[n]:.1f} ({med[n] / med['true']:.2f})" for n in windows)
            print(f"  {label}: oracle {exact:.1f}  path-true {med['true']:.1f}  {ratios}")
            for b in args.batch_sizes:
                row = per[t]
                vals = {n: np.mean(row[f"{q}_{n}"][b]) for n in names if row[f"{q}_{n}"][b]}
                if vals:
                    print(f"    B={b:<4d} " + " ".join(f"{n} {v:.1f}" for n, v in vals.items()))


if __name__ == "__main__":
    main()
