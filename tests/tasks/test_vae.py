"""The digits VAE: its loss is the negative ELBO in nats per image, checked against a direct
computation, and the reparameterisation noise travels with the batch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from task_training import mean, train

from gnsweep.config import ConfigError
from gnsweep.tasks import vae


@pytest.fixture(scope="module")
def task():
    return vae.make(vae.Options(), seed=0)


def _negative_elbo(model: vae.Vae, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """-ELBO per image written out in float64: the Bernoulli log-likelihood by hand, the KL from
    torch.distributions."""
    model = model.double()
    x, eps = x.double(), eps.double()
    mu, log_var = model.encoder(x).chunk(2, dim=-1)
    sigma = (0.5 * log_var).exp()
    p = torch.sigmoid(model.decoder(mu + sigma * eps))
    log_lik = (x * p.log() + (1 - x) * (1 - p).log()).sum(-1)
    prior = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu))
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mu, sigma), prior).sum(-1)
    return kl - log_lik


def test_loss_is_the_negative_elbo_per_image(task):
    model = task.model()
    with torch.no_grad():  # move away from the initialisation so the KL is not tiny
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    batch = task.sample(16, torch.Generator().manual_seed(0))
    loss = task.loss(model, batch)
    assert loss.dim() == 0
    with torch.no_grad():
        direct = _negative_elbo(copy.deepcopy(model), batch["x"], batch["eps"])
    assert direct.shape == (16,)
    assert float(loss.detach()) == pytest.approx(float(direct.mean()), rel=1e-5)


def test_fresh_model_costs_about_64_ln2(task):
    """Logits near 0 give each pixel ln 2 nats whatever its grey level, and the KL is small."""
    assert abs(task.eval_loss(task.model()) - 64 * math.log(2)) < 2.0


def test_batch_carries_its_noise(task):
    generator = torch.Generator().manual_seed(1)
    batch = task.sample(10, generator)
    assert batch["x"].shape == (10, 64) and batch["eps"].shape == (10, 8)
    assert task.examples(batch) == 10
    assert float(batch["x"].min()) >= 0 and float(batch["x"].max()) <= 1
    model = task.model()
    loss = task.loss(model, batch)
    assert float(task.loss(model, batch)) == float(loss)
    # Two micro-batches, each with its own noise, average to the whole batch's loss.
    halves = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 5), slice(5, 10))]
    split = sum(float(task.loss(model, h).detach()) for h in halves) / 2
    assert split == pytest.approx(float(loss.detach()), rel=1e-6)


def test_seed_reproduces_model_and_batches():
    a, b, c = (vae.make(vae.Options(), seed=s) for s in (3, 3, 4))
    sa, sb, sc = (t.model().state_dict() for t in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    x, y = (t.sample(4, torch.Generator().manual_seed(2)) for t in (a, b))
    assert torch.equal(x["x"], y["x"]) and torch.equal(x["eps"], y["eps"])


@pytest.mark.parametrize(("options", "field"), [
    ({"latent": 0}, r"task.latent"), ({"hidden": 0}, r"task.hidden"),
    ({"holdout": 1.0}, r"task.holdout")])
def test_bad_options(options, field):
    with pytest.raises(ConfigError, match=field):
        vae.Options(**options)


@pytest.mark.slow
def test_short_training_learns(task):
    model, losses = train(task, batch_size=64, lr=0.008, steps=300)
    assert mean(losses[:5]) > 40
    assert mean(losses[-20:]) < 28
    assert task.eval_loss(model) < 28
