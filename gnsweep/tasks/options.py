"""The built-in tasks' option schemas, apart from their torch code: a sweep's config can be
checked and loaded (analysis on a laptop) where torch cannot be imported."""

from __future__ import annotations

from dataclasses import dataclass

from gnsweep.errors import ConfigError, integer, number


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
        self.hidden = integer("task.hidden", self.hidden)
        self.depth = integer("task.depth", self.depth)
        self.holdout = number("task.holdout", self.holdout)
        if self.hidden < 1 or self.depth < 0:
            raise ConfigError("task.hidden must be >= 1 and task.depth >= 0")
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
    """Held-out examples for the eval loss (0: none; runs log the exact population loss as
    their eval loss whatever this is)."""
    teacher_power: float = 0.0
    """Teacher w*_i = z_i * variance_i^(-p/2): 0 gives w* ~ N(0, I), 1 gives every
    eigen-direction the same expected share of the initial loss (a long, realistic run)."""

    def __post_init__(self) -> None:
        self.dim = integer("task.dim", self.dim)
        self.teacher_power = number("task.teacher_power", self.teacher_power)
        self.condition = number("task.condition", self.condition)
        self.noise = number("task.noise", self.noise)
        self.eval_size = integer("task.eval_size", self.eval_size)
        if self.dim < 1:
            raise ConfigError(f"task.dim: {self.dim} must be >= 1")
        if self.condition < 1:
            raise ConfigError(f"task.condition: {self.condition} must be >= 1")
        if self.noise < 0:
            raise ConfigError(f"task.noise: {self.noise} must be >= 0")
        if self.eval_size < 0:
            raise ConfigError(f"task.eval_size: {self.eval_size} must be >= 0")
