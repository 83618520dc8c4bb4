"""Bias of steps-to-target from smoothed training losses, against linreg's exact expected curves.

For every batch size and target, SGD runs at the exact best learning rate are simulated
(`linreg_exact.simulate_sgd`: the batch loss logged before each update, as training logs it);
steps-to-target from (a) the centred local-linear smoother (`analysis.smoothing`) and (b) the
causal EMA the training loop uses today are compared with the exact S(B) of the expected loss, and
B_crit is fitted (eq. 2.11, the project's fit) from each seed's S(B).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/smoothing_bias.py
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from gnsweep.analysis.fit import fit_hyperbola
from gnsweep.analysis.smoothing import centred_fit, first_reach
from gnsweep.linreg_exact import exact_truth, simulate_sgd

sys.path.insert(0, str(Path(__file__).parent))
from noise_windows import make_task, problem_of


def causal_ema_steps(loss: np.ndarray, batch: int, ema_examples: float, target: float) -> float:
    """Today's rule: bias-corrected EMA, decay exp(-B / ema_examples); the step logged with the
    raw loss of the parameters after s-1 updates is s; the first step with EMA <= target."""
    decay = math.exp(-batch / ema_examples)
    total = weight = 0.0
    for s, value in enumerate(loss, start=1):
        total, weight = decay * total + value, decay * weight + 1.0
        if total / weight <= target:
            return float(s)
    return math.nan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--condition", type=float, default=100.0)
    parser.add_argument("--teacher-power", type=float, default=1.0)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.25, 0.2])
    parser.add_argument("--batch-sizes", type=int, nargs="+",
                        default=[4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4])
    parser.add_argument("--min-examples", type=float, default=64.0,
                        help="minimum half-width of the centred window, in examples")
    parser.add_argument("--ema-examples", type=float, default=256.0)
    parser.add_argument("--margin", type=float, default=0.5,
                        help="simulate this fraction of steps past the exact S")
    args = parser.parse_args()
    task = make_task(args.dim, args.condition, 0.5, args.teacher_power, 0)
    problem = problem_of(task)
    d0 = np.sqrt(problem.m0)  # the signs do not matter to the second moments...
    model = task.model()
    d0 = np.concatenate([model.weight.detach().double().numpy().ravel() - task.w_star.numpy(),
                         model.bias.detach().double().numpy()])  # ...but to the paths they do
    targets = sorted(args.targets, reverse=True)
    truth = exact_truth(problem, args.batch_sizes, targets, limits=False)
    rng = np.random.default_rng(0)
    methods = [f"centred{f:g}" for f in args.fractions] + ["ema"]
    steps = {m: np.full((len(targets), len(args.batch_sizes), args.seeds), np.nan)
             for m in methods}
    for k, target in enumerate(targets):
        for j, batch in enumerate(args.batch_sizes):
            lr, exact = truth.best_lr[k, j], truth.steps[k, j]
            n = math.ceil(exact * (1 + args.margin)) + 5
            loss, _, _ = simulate_sgd(problem, d0, lr, batch, n, args.seeds, rng)
            x = np.arange(n + 1, dtype=float)  # the parameters after x updates
            for r in range(args.seeds):
                for f in args.fractions:
                    smooth = centred_fit(x[:-1], loss[r, :-1], f, args.min_examples / batch)
                    steps[f"centred{f:g}"][k, j, r] = first_reach(x[:-1], smooth, target)
                steps["ema"][k, j, r] = causal_ema_steps(loss[r, :-1], batch, args.ema_examples,
                                                         target)
    b = np.asarray(args.batch_sizes, float)
    print(f"dim {args.dim}, condition {args.condition:g}, teacher_power {args.teacher_power:g}, "
          f"{args.seeds} seeds; centred window half-width max(f*s, {args.min_examples:g}/B); "
          f"causal EMA {args.ema_examples:g} examples")
    for k, target in enumerate(targets):
        exact_fit = truth.per_target[k].b_crit_fit
        print(f"target {target:g}: exact S(B) {np.round(truth.steps[k], 1).tolist()}, "
              f"B_crit {exact_fit:.1f}")
        for m in methods:
            ratio = steps[m][k] / truth.steps[k][:, None]
            fits = []
            for r in range(args.seeds):
                ok = np.isfinite(steps[m][k, :, r])
                fits.append(fit_hyperbola(b[ok], steps[m][k, ok, r]).b_crit)
            med = fit_hyperbola(b, np.nanmedian(steps[m][k], axis=1)).b_crit
            print(f"  {m:>11}: S/S_exact per B {np.round(np.nanmean(ratio, 1), 3).tolist()}  "
                  f"B_crit per seed {np.mean(fits):.1f} +- {np.std(fits):.1f} "
                  f"({np.mean(fits) / exact_fit:.2f}x), from median S {med:.1f} "
                  f"({med / exact_fit:.2f}x)")


if __name__ == "__main__":
    main()
