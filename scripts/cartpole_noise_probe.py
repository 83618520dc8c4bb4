"""Cartpole's noise scale at frozen parameters: the truth from the spread of whole-batch
gradients, against in-batch estimates that take different units as the independent example.

    python scripts/cartpole_noise_probe.py [UPDATES] [all|policy|critic|actor|monitor] [B] [N]

UPDATES Adam updates at B = 256 first (0: the random policy). Then, at B = 64 (8 environments x
8 steps; or B), over N = 200 batches of the continuing rollouts:
- "batch spread" (the truth, eq. 2.9 by its definition): B x the variance of whole-batch
  gradients over the batches, over the mean gradient's |G|^2 (less its variance);
- "per-segment in-batch": tr Sigma and |G|^2 from each environment's segment's gradient
  within a batch, unbiased (eq. A.1-A.2), averaged over the batches, times the 8 steps of a
  segment: segments of different environments are independent;
- "per-step in-batch": the same with each environment step taken as an independent example
  (what the monitor measured before the batch became environment-major; the 8 steps of a
  segment are correlated, so this is biased low).
Modes: the gradient of the whole A2C loss on all parameters (all), of the policy term on the
actor (policy), of the critic term on the critic (critic), of the whole loss on the actor
(actor: what the monitor measures now, `Cartpole.noise_parameters`), and `monitor`: the actor
truth beside the training loop's own NoiseScaleMonitor (per-example hooks, the actor's
parameters, B_simple converted to environment steps as `gnsweep.training` does), pooled over the
same batches.

Both sides are sampling estimates: for the policy (B_simple of hundreds to ten thousand steps)
64 x 200 steps leave |G|^2 noise-dominated, and consecutive batches of the same environments
are correlated, which biases the spread's |G|^2 up when B_simple is not << B x N. Use
`UPDATES monitor 512 400` or more for a comparison (seconds per 100 batches of 512).
"""

from __future__ import annotations

import math
import sys

import torch
from torch.nn import functional as F

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.tasks import cartpole
from gnsweep.training.backward import in_task_units


def _unbiased(per: torch.Tensor, unit: int) -> tuple[float, float]:
    """(tr Sigma, |G|^2) per `unit` steps from n independent gradients `per` (n, P) of `unit`
    steps each (eq. A.2 with b_small = 1, b_big = n)."""
    n = per.shape[0]
    big, small = per.mean(0).pow(2).sum(), per.pow(2).sum(1).mean()
    return float((small - big) / (1 - 1 / n)), float((n * big - small) / (n - 1))


def main(updates: int, part: str, size: int = 64, count: int = 200) -> None:
    torch.set_num_threads(1)
    task = cartpole.make(cartpole.Options(), seed=0)
    model = task.model()
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=0.004)
    for _ in range(updates):
        batch = task.sample(256, gen)
        opt.zero_grad()
        task.loss(model, batch).backward()
        opt.step()
    print(f"return of the latest episodes: {task.metric(model):.4g}")

    def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if part in ("all", "actor", "monitor"):
            return task.loss(model, batch)
        logits, value = model(batch["obs"])
        if part == "critic":
            return 0.5 * (batch["ret"] - value).pow(2).mean()
        log_p = F.log_softmax(logits, -1)
        advantage = (batch["ret"] - value).detach()
        return -(log_p.gather(-1, batch["action"][..., None]).squeeze(-1) * advantage).mean()

    module = {"policy": model.actor, "actor": model.actor, "monitor": model.actor,
              "critic": model.critic}.get(part, model)
    params = list(module.parameters())

    def grad(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss(batch), params)])

    monitor = None
    if part == "monitor":
        # As gnsweep.training builds it, with a window that pools every measurement equally.
        monitor = NoiseScaleMonitor(model, "per_example", ema_examples=math.inf,
                                    task_loss=task.loss,
                                    parameters=task.noise_parameters(model))
    whole, segments, steps_ = [], [], []
    estimate = None
    for k in range(count):
        batch = task.sample(size, gen)
        n, t = batch["action"].shape
        if monitor is not None:
            model.zero_grad(set_to_none=True)
            task.loss(model, batch).backward()
            estimate = in_task_units(monitor.step(examples=n * t), task.examples(batch) / n)
            whole.append(torch.cat([p.grad.reshape(-1) for p in params]))  # type: ignore[union-attr]
            continue
        whole.append(grad(batch))
        if k < 30:
            per_env = torch.stack([grad({key: v[i:i + 1] for key, v in batch.items()})
                                   for i in range(n)])
            segments.append(_unbiased(per_env, t))
            per_step = torch.stack([grad({key: v[i:i + 1, j:j + 1] for key, v in batch.items()})
                                    for i in range(n) for j in range(t)])
            steps_.append(_unbiased(per_step, 1))
    g = torch.stack(whole)
    spread = (g - g.mean(0)).pow(2).sum(1).mean() * count / (count - 1)
    g2 = g.mean(0).pow(2).sum() - spread / count
    print(f"batch spread:         tr Sigma {float(spread * size):.4g}  |G|^2 {float(g2):.4g}  "
          f"B_simple {float(spread * size / g2):.3g} environment steps")
    if estimate is not None:
        print(f"monitor (pooled):     tr Sigma {estimate.trace_sigma:.4g}  |G|^2 "
              f"{estimate.g2:.4g}  B_simple {estimate.b_simple:.3g} environment steps")
        return
    for name, pairs, unit in (("per-segment", segments, t), ("per-step", steps_, 1)):
        s = sum(a for a, _ in pairs) / len(pairs) * unit
        g2s = sum(b for _, b in pairs) / len(pairs)
        print(f"{name + ' in-batch:':<22}tr Sigma {s:.4g}  |G|^2 {g2s:.4g}  B_simple {s / g2s:.3g}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 0, args[1] if len(args) > 1 else "all",
         *(int(a) for a in args[2:4]))
