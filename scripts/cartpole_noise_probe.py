"""Why cartpole's B_simple is far below its B_crit: the noise scale at frozen parameters, of the
whole A2C loss or of one of its parts, estimated two ways.

    python scripts/cartpole_noise_probe.py [UPDATES] [all|policy|critic]

UPDATES Adam updates at B = 256 first (0: the random policy). Then, at B = 64:
- "batch spread": B x the variance of whole-batch gradients over 200 batches, over the mean
  gradient's |G|^2 (eq. 2.9 by its definition; batches from the continuing rollouts);
- "per-sample in-batch": tr Sigma and |G|^2 from per-sample gradients within a batch, unbiased
  (eq. A.1-A.2), averaged over 30 batches: what the training loop's monitor measures, which
  treats the batch's environment steps as independent examples.
"""

from __future__ import annotations

import sys

import torch
from torch.nn import functional as F

from gnsweep.tasks import cartpole


def main(updates: int, part: str) -> None:
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
        if part == "all":
            return task.loss(model, batch)
        logits, value = model(batch["obs"])
        if part == "critic":
            return 0.5 * (batch["ret"] - value).pow(2).mean()
        log_p = F.log_softmax(logits, -1)
        advantage = (batch["ret"] - value).detach()
        return -(log_p.gather(1, batch["action"][:, None]).squeeze(1) * advantage).mean()

    module = {"policy": model.actor, "critic": model.critic}.get(part, model)
    params = list(module.parameters())

    def grad(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss(batch), params)])

    size, count = 64, 200
    whole, within = [], []
    for k in range(count):
        batch = task.sample(size, gen)
        whole.append(grad(batch))
        if k < 30:
            per = torch.stack([grad({n: v[i:i + 1] for n, v in batch.items()})
                               for i in range(size)])
            big, small = per.mean(0).pow(2).sum(), per.pow(2).sum(1).mean()
            within.append(((small - big) / (1 - 1 / size), (size * big - small) / (size - 1)))
    g = torch.stack(whole)
    spread = (g - g.mean(0)).pow(2).sum(1).mean()
    g2 = g.mean(0).pow(2).sum() - spread / count
    print(f"batch spread:        tr Sigma {float(spread * size):.4g}  |G|^2 {float(g2):.4g}  "
          f"B_simple {float(spread * size / g2):.3g}")
    s = sum(float(t) for t, _ in within) / len(within)
    g2 = sum(float(x) for _, x in within) / len(within)
    print(f"per-sample in-batch: tr Sigma {s:.4g}  |G|^2 {g2:.4g}  B_simple {s / g2:.3g}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, sys.argv[2] if len(sys.argv) > 2 else "all")
