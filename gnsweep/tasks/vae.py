"""A variational autoencoder (Kingma & Welling 2014) on scikit-learn's bundled digits images
(1797 images of 8 x 8 pixels, intensities 0..16 scaled to [0, 1]); loss the negative ELBO in
nats per image (summed over the 64 pixels, not averaged), batch-mean.

    -ELBO(x) = E_q(z|x)[-log p(x|z)] + KL(q(z|x) || N(0, I))

with a diagonal Gaussian encoder q(z|x) = N(mu, diag(sigma^2)) (KL in closed form) and a
Bernoulli decoder on the scaled intensities (`binary_cross_entropy_with_logits` summed over
pixels; with grey levels as targets this is the usual "soft" Bernoulli likelihood, so the floor is
the intensities' own entropy, not 0). One reparameterised sample z = mu + sigma * eps per image.

The reparameterisation noise travels with the batch: `sample(B, generator)` returns
`{"x": (B, 64), "eps": (B, latent)}`, so the loss is a deterministic function of the batch (a
micro-batch split keeps each image's noise, and a seed reproduces the run). `eval_loss` uses the
held-out images with fixed noise.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.tasks.digits import load_digits
from gnsweep.tasks.options import VaeOptions

DESCRIPTION = ("VAE on scikit-learn's bundled digits images (8 x 8), negative ELBO in nats per "
               "image.")

PIXELS = 64


Options = VaeOptions
"""The task's settings (schema in gnsweep.tasks.options, importable without torch)."""


class Vae(nn.Module):
    def __init__(self, latent: int, hidden: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(PIXELS, hidden), nn.Tanh(),
                                     nn.Linear(hidden, 2 * latent))
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.Tanh(),
                                     nn.Linear(hidden, PIXELS))

    def forward(self, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """Per-image negative ELBO (nats), shape (B,)."""
        mu, log_var = self.encoder(x).chunk(2, dim=-1)
        z = mu + (0.5 * log_var).exp() * eps
        logits = self.decoder(z)
        nll = F.binary_cross_entropy_with_logits(logits, x, reduction="none").sum(-1)
        kl = 0.5 * (mu.pow(2) + log_var.exp() - 1 - log_var).sum(-1)
        return nll + kl


class DigitsVae:
    def __init__(self, options: Options, seed: int) -> None:
        pixels, _ = load_digits()
        x = torch.tensor(pixels, dtype=torch.float32) / 16.0
        # The split is fixed (seed 0), as digits', so every run of a sweep sees the same images.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        n_eval = round(options.holdout * len(x))
        self.x = x[order[n_eval:]]
        self._eval = None
        if n_eval:
            held = x[order[:n_eval]]
            noise = torch.randn(n_eval, options.latent, generator=torch.Generator().manual_seed(1))
            self._eval = {"x": held, "eps": noise}
        self.options, self.seed = options, seed

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return Vae(self.options.latent, self.options.hidden)

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        index = torch.randint(len(self.x), (batch_size,), generator=generator)
        eps = torch.randn(batch_size, self.options.latent, generator=generator)
        return {"x": self.x[index], "eps": eps}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["x"], batch["eps"]).mean()

    def eval_loss(self, model: nn.Module) -> float:
        if self._eval is None:
            return float("nan")
        with torch.no_grad():
            return float(self.loss(model, self._eval))

    def examples(self, batch: dict[str, torch.Tensor]) -> int:
        return len(batch["x"])


def make(options: Options, seed: int) -> DigitsVae:
    return DigitsVae(options, seed)
