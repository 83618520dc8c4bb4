"""The learning-rate schedule of a run: pure formulas of where the run stands.

The rate of the step that brings the run to `steps` optimizer steps and `examples` examples is
`peak x factor`, `factor = warmup x decay`:

- warmup, linear from 0 over W steps (or W examples): `min(1, steps / W)` (or `examples / W`);
  the first step of a 10-step warmup runs at peak/10, the 10th at the peak. Counted in
  examples, every batch size warms up over the same data.
- decay, over the horizon H counted from the start of the run (in examples, or in steps),
  starting where the warmup ends (`start`, converted to the decay's unit with the run's
  examples per step when the two units differ), with `p = clip((x - start) / (H - start), 0, 1)`
  and r = min_lr_ratio:
  constant 1; linear `r + (1 - r)(1 - p)`; cosine `r + (1 - r)(1 + cos(pi p)) / 2`;
  step `r ** (min(floor(3 p), 2) / 2)`: the peak, then sqrt(r) x peak from p = 1/3, then
  r x peak from p = 2/3 (ImageNet's divide-by-10 twice for r = 0.01).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from gnsweep.config import Config


@dataclass(frozen=True)
class LrSchedule:
    """A warmup then a decay (see the module docstring); the run's counters are its position,
    so it holds no state of its own: `state_dict()` is its settings, refused on load when they
    differ (a run resumed under another schedule would log rates of neither)."""

    warmup: float = 0.0
    """Warmup length (0: none)."""
    warmup_in_examples: bool = False
    """Whether `warmup` counts examples (else optimizer steps)."""
    decay: str = "constant"
    """constant, cosine, linear or step."""
    horizon: float = 0.0
    """Where the decay ends, from the start of the run."""
    horizon_in_examples: bool = False
    """Whether `horizon` counts examples (else optimizer steps)."""
    min_ratio: float = 0.0
    """The factor at the end of the decay."""

    @classmethod
    def of(cls, config: Config) -> LrSchedule:
        """The schedule of `config.train`: the decay's horizon is train.decay_examples, else
        the run's budget (sweep.max_examples when set, else sweep.max_steps)."""
        train, sweep = config.train, config.sweep
        horizon_examples = train.decay_examples or sweep.max_examples
        return cls(warmup=float(train.warmup_examples or train.warmup_steps),
                   warmup_in_examples=bool(train.warmup_examples), decay=train.decay,
                   horizon=float(horizon_examples or sweep.max_steps),
                   horizon_in_examples=bool(horizon_examples), min_ratio=train.min_lr_ratio)

    def factor(self, steps: int, examples: float, per_step: float) -> float:
        """The fraction of the peak rate for the step that ends at `steps` steps and
        `examples` examples; `per_step`: the run's examples per step (converts the warmup's
        end to the decay's unit when they differ)."""
        warm = 1.0
        if self.warmup:
            warm = min(1.0, (examples if self.warmup_in_examples else steps) / self.warmup)
        return warm * self.decay_factor(steps, examples, per_step)

    def decay_factor(self, steps: int, examples: float, per_step: float) -> float:
        """The decay's share of `factor` (1 during the warmup)."""
        if self.decay == "constant":
            return 1.0
        x = examples if self.horizon_in_examples else steps
        start = self.warmup
        if self.warmup_in_examples != self.horizon_in_examples:
            start = start * per_step if self.horizon_in_examples else start / per_step
        p = 1.0 if self.horizon <= start else min(1.0, max(0.0, (x - start)
                                                          / (self.horizon - start)))
        r = self.min_ratio
        if self.decay == "linear":
            return r + (1 - r) * (1 - p)
        if self.decay == "cosine":
            return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p))
        return float(r ** (min(math.floor(3 * p), 2) / 2))

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state != self.state_dict():
            raise ValueError(f"a state saved under another learning-rate schedule ({state}); "
                             f"this run's is {self.state_dict()}")
