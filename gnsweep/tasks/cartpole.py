"""Advantage actor-critic (A2C, Mnih et al. 2016) on gymnasium's CartPole-v1; the batch is
environments x steps per update, counted in environment steps; the target metric is the mean
episode return (higher is better, at most 500).

Additions to the task protocol (everything else is the ordinary one):

- `metric_name = "return"` and `higher_is_better = True`: the sweep's targets are returns to reach,
  not losses to fall below. A task without these attributes means `"loss"`, lower is better.
- `metric(model) -> float`: the mean return of the last `return_window` episodes that ended
  during training (the stochastic policy's own episodes, so it costs no extra environment step;
  NaN until one has ended). The loop calls it after each step and tests the targets on it, not on
  the loss. It is already a window mean: smooth it no further (or only lightly), or the lag adds
  steps to every run. The A2C loss is logged as usual but has no target meaning.
- The task is stateful: `model()` builds a fresh network, keeps it as the policy that `sample`
  rolls out, and resets the environments and the episode record, so one task object can serve
  one run at a time. `sample(B, generator)` steps `n = max(1, B // steps_per_update)`
  environments for `B // n` steps each with the current policy (no gradient), continuing their
  episodes across calls, and returns a dict of `n * (B // n)` transitions (= B when B is a
  multiple of `steps_per_update`), environment-major: `obs` (n, steps, 4), `action` (n, steps),
  `ret` (n, steps), the n-step bootstrapped discounted return. `examples(batch)` is that number
  of environment steps.
- The batch's first dimension is the environment: one environment's segment is the
  independent sample (its steps share n-step returns and follow each other), so micro-batches
  split whole environments and the per-example noise monitor measures per segment (the Gram
  form over its steps, as for a language model's windows); the loop converts B_simple to
  environment steps. A batch of one environment (B < 2 x steps_per_update) has no spread to
  measure: B_simple is NaN there.
- `noise_parameters(model)` is the actor's parameters: the noise scale is that of the policy
  gradient. Actor and critic are separate networks trained by Adam (each parameter's step
  normalised, so the critic's larger gradient does not swamp the actor's update), and the
  return, the target, is set by the policy alone; the critic's squared-error gradient would
  otherwise dominate |G|^2 (its B_simple is 100x smaller) and set B_simple (docs/tasks.md).

Reproducible under a seed: the network from `torch.manual_seed(seed)`, environment i reset once
with seed `seed * 100_003 + i` (+ 1_000_003 x the rank under torchrun; later resets continue
its own generator), actions drawn from the loop's generator. Truncation at 500 steps
bootstraps from the value of the final observation.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.tasks.options import CartpoleOptions

DESCRIPTION = ("Advantage actor-critic on gymnasium's CartPole-v1; B in environment steps "
               "(environments x steps per update); target: mean episode return (higher is better).")

ENV_ID = "CartPole-v1"


# The option schema lives with the other tasks' schemas, apart from torch (config checks).
Options = CartpoleOptions


def _gym() -> Any:
    try:
        import gymnasium
    except ModuleNotFoundError as err:
        if err.name != "gymnasium":
            raise
        from gnsweep.errors import ConfigError

        raise ConfigError("task cartpole needs the gymnasium package: pip install gymnasium"
                          ) from None
    return gymnasium


def _rank() -> int:
    """This process's rank under torch.distributed (torchrun), else 0."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _mlp(width: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, out))


class ActorCritic(nn.Module):
    """Separate actor and critic: returns reach 100, so a shared trunk would let the critic's
    squared error swamp the policy gradient."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.actor, self.critic = _mlp(hidden, 2), _mlp(hidden, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.critic(obs).squeeze(-1)


class Cartpole:
    metric_name = "return"
    higher_is_better = True
    # Its environments, their episodes and the returns so far live here, outside the run's
    # state: a checkpoint would not continue the same run (gnsweep.training.checkpoint).
    resumable = False

    def __init__(self, options: Options, seed: int) -> None:
        self.gym = _gym()
        self.options, self.seed = options, seed
        self._policy: ActorCritic | None = None
        self._reset_environments()

    def _reset_environments(self) -> None:
        self._envs: list[Any] = []
        self._obs: list[np.ndarray] = []
        self._running: list[float] = []
        self.finished: collections.deque[float] = collections.deque(
            maxlen=self.options.return_window)
        self.env_steps = 0
        """Environment steps taken since the last `model()`."""

    def _grow(self, count: int) -> None:
        while len(self._envs) < count:
            env = self.gym.make(ENV_ID)
            # Under torchrun each rank steps its own environments: the rank is folded in as
            # the loop folds it into its data generator (rank 0 = a single process).
            seed = self.seed * 100_003 + len(self._envs) + 1_000_003 * _rank()
            obs, _ = env.reset(seed=seed)
            self._envs.append(env)
            self._obs.append(obs)
            self._running.append(0.0)

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        self._policy = ActorCritic(self.options.hidden)
        self._reset_environments()
        return self._policy

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        if self._policy is None:
            raise RuntimeError("cartpole: call model() before sample(); it rolls out that model")
        n = max(1, batch_size // self.options.steps_per_update)
        steps = max(1, batch_size // n)
        self._grow(n)
        obs = torch.empty(steps, n, 4)
        actions = torch.empty(steps, n, dtype=torch.long)
        rewards = torch.zeros(steps, n)
        # next_value[t, i]: what to bootstrap from after step t; NaN = the following step's return.
        next_value = torch.full((steps, n), math.nan)
        truncated: list[tuple[int, int, np.ndarray]] = []
        with torch.no_grad():
            for t in range(steps):
                obs[t] = torch.from_numpy(np.stack(self._obs[:n])).float()
                logits, _ = self._policy(obs[t])
                actions[t] = torch.multinomial(F.softmax(logits, -1), 1,
                                               generator=generator).squeeze(1)
                for i in range(n):
                    new, reward, terminated, truncation, _ = self._envs[i].step(
                        int(actions[t, i]))
                    rewards[t, i] = float(reward)
                    self._running[i] += float(reward)
                    if terminated:
                        next_value[t, i] = 0.0
                    elif truncation:
                        truncated.append((t, i, new))
                    if terminated or truncation:
                        self.finished.append(self._running[i])
                        self._running[i] = 0.0
                        new, _ = self._envs[i].reset()
                    self._obs[i] = new
            last = torch.from_numpy(np.stack(self._obs[:n])).float()
            _, last_value = self._policy(last)
            if truncated:
                finals = torch.from_numpy(np.stack([o for _, _, o in truncated])).float()
                _, values = self._policy(finals)
                for (t, i, _), value in zip(truncated, values, strict=True):
                    next_value[t, i] = value
        returns = torch.empty(steps, n)
        following = last_value
        for t in reversed(range(steps)):
            bootstrap = torch.where(next_value[t].isnan(), following, next_value[t])
            returns[t] = rewards[t] + self.options.gamma * bootstrap
            following = returns[t]
        self.env_steps += steps * n
        # Environment-major: dim 0 indexes the independent samples (environments' segments).
        return {"obs": obs.transpose(0, 1).contiguous(),
                "action": actions.transpose(0, 1).contiguous(),
                "ret": returns.transpose(0, 1).contiguous()}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits, value = model(batch["obs"])
        log_p = F.log_softmax(logits, -1)
        advantage = (batch["ret"] - value).detach()
        policy = -(log_p.gather(-1, batch["action"][..., None]).squeeze(-1) * advantage).mean()
        critic = 0.5 * (batch["ret"] - value).pow(2).mean()
        entropy = -(log_p.exp() * log_p).sum(-1).mean()
        o = self.options
        return policy + o.value_coef * critic - o.entropy_coef * entropy

    def examples(self, batch: dict[str, torch.Tensor]) -> int:
        """Environment steps: environments x steps each."""
        return int(batch["action"].numel())

    def noise_parameters(self, model: nn.Module) -> Iterator[nn.Parameter]:
        """The actor's: B_simple of the policy gradient (see the module's docstring)."""
        assert isinstance(model, ActorCritic)
        return model.actor.parameters()

    def metric(self, model: nn.Module | None = None) -> float:
        """Mean return of the last `return_window` finished training episodes (NaN before one)."""
        return float(np.mean(self.finished)) if self.finished else math.nan


def make(options: Options, seed: int) -> Cartpole:
    return Cartpole(options, seed)
