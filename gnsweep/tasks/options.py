"""The built-in tasks' option schemas, apart from their torch code: a sweep's config can be
checked and loaded (analysis on a laptop) where torch cannot be imported."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gnsweep.errors import ConfigError, at_least, integer, number


def _check(options: Any, convert: Callable[[str, Any], Any], minimum: float | None,
           *names: str) -> None:
    """Convert each named field (`task.<name>` in errors) and, with `minimum`, check it."""
    for name in names:
        where = f"task.{name}"
        value = convert(where, getattr(options, name))
        setattr(options, name, value if minimum is None else at_least(where, value, minimum))


@dataclass
class DigitsOptions:
    hidden: int = 64
    """Width of each hidden layer."""
    depth: int = 2
    """Number of hidden layers."""
    holdout: float = 0.2
    """Fraction of the examples kept out of training, for the eval loss."""
    exact_truth: bool = False
    """Log the exact B_simple of the training set (per-example gradients over every training
    example) and its whole loss as the eval loss, every logged step: the second oracle
    (docs/truth.md); costs about one pass over the 1,438 training examples per logged step."""

    def __post_init__(self) -> None:
        if not isinstance(self.exact_truth, bool):
            raise ConfigError(f"task.exact_truth: {self.exact_truth!r} must be true or false")
        _check(self, integer, 1, "hidden")
        _check(self, integer, 0, "depth")
        _check(self, number, None, "holdout")
        if not 0 <= self.holdout < 1:
            raise ConfigError(f"task.holdout: {self.holdout} must be in [0, 1)")


@dataclass
class LinregOptions:
    dim: int = 16
    """Input dimension."""
    condition: float = 100.0
    """Ratio of the largest to the smallest input variance (eigenvalues log-spaced, max 1)."""
    noise: float = 0.5
    """Standard deviation of the label noise (the loss floor is noise^2 / 2)."""
    eval_size: int = 4096
    """Unused: the eval loss is the exact population loss (closed form, `LinReg.eval_loss`);
    kept so that sweep folders written before it load and relaunch unchanged."""
    teacher_power: float = 0.0
    """Teacher w*_i = z_i * variance_i^(-p/2): 0 gives w* ~ N(0, I), 1 gives every
    eigen-direction the same expected share of the initial loss (a long, realistic run)."""

    def __post_init__(self) -> None:
        _check(self, integer, 1, "dim")
        _check(self, number, 1, "condition")
        _check(self, number, 0, "noise")
        _check(self, integer, 0, "eval_size")
        _check(self, number, None, "teacher_power")


@dataclass
class CartpoleOptions:
    hidden: int = 64
    """Width of the two hidden layers of the actor and of the critic (separate networks)."""
    steps_per_update: int = 8
    """Steps each environment takes per update (B / steps_per_update environments)."""
    gamma: float = 0.99
    """Discount factor."""
    value_coef: float = 0.5
    """Weight of the critic's squared error in the loss."""
    entropy_coef: float = 0.01
    """Weight of the policy's entropy bonus in the loss."""
    return_window: int = 20
    """Episodes averaged by the return metric."""

    def __post_init__(self) -> None:
        _check(self, integer, 1, "hidden", "steps_per_update", "return_window")
        _check(self, number, 0, "gamma", "value_coef", "entropy_coef")
        if self.gamma > 1:
            raise ConfigError(f"task.gamma: {self.gamma} must be in [0, 1]")


@dataclass
class Mnist1dOptions:
    channels: int = 32
    """Channels of each convolution layer."""
    cache_dir: str = ""
    """Folder for the generated data ('': $XDG_CACHE_HOME/gnsweep or ~/.cache/gnsweep)."""

    def __post_init__(self) -> None:
        _check(self, integer, 1, "channels")
        if not isinstance(self.cache_dir, str):
            raise ConfigError(f"task.cache_dir: {self.cache_dir!r} must be a folder path")


@dataclass
class CharsOptions:
    context: int = 64
    """Characters each window predicts (the attention span)."""
    width: int = 64
    """Embedding width."""
    depth: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads (must divide width)."""
    holdout: float = 0.1
    """Fraction of the text (its end) kept out of training, for the eval loss."""
    eval_windows: int = 128
    """Held-out windows for the eval loss (0: none)."""

    def __post_init__(self) -> None:
        _check(self, integer, 1, "context", "width", "depth", "heads")
        _check(self, integer, 0, "eval_windows")
        _check(self, number, None, "holdout")
        if self.width % self.heads:
            raise ConfigError(f"task.heads: {self.heads} must divide task.width={self.width}")
        if not 0 <= self.holdout < 0.5:
            raise ConfigError(f"task.holdout: {self.holdout} must be in [0, 0.5)")
        if self.eval_windows and not self.holdout:
            raise ConfigError("task.eval_windows needs task.holdout > 0 (or set it to 0)")


@dataclass
class VaeOptions:
    latent: int = 8
    """Latent dimensions."""
    hidden: int = 128
    """Width of the encoder's and the decoder's hidden layer."""
    holdout: float = 0.2
    """Fraction of the images kept out of training, for the eval loss."""

    def __post_init__(self) -> None:
        _check(self, integer, 1, "latent", "hidden")
        _check(self, number, None, "holdout")
        if not 0 <= self.holdout < 1:
            raise ConfigError(f"task.holdout: {self.holdout} must be in [0, 1)")
