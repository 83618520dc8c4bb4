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
    """Unused: the eval loss is the exact population loss (closed form, `LinReg.eval_loss`);
    kept so that sweep folders written before it load and relaunch unchanged."""
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
        for name in ("hidden", "steps_per_update", "return_window"):
            setattr(self, name, integer(f"task.{name}", getattr(self, name)))
            if getattr(self, name) < 1:
                raise ConfigError(f"task.{name}: {getattr(self, name)} must be >= 1")
        for name in ("gamma", "value_coef", "entropy_coef"):
            setattr(self, name, number(f"task.{name}", getattr(self, name)))
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"task.gamma: {self.gamma} must be in [0, 1]")
        for name in ("value_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"task.{name}: {getattr(self, name)} must be >= 0")


@dataclass
class Mnist1dOptions:
    channels: int = 32
    """Channels of each convolution layer."""
    cache_dir: str = ""
    """Folder for the generated data ('': $XDG_CACHE_HOME/gnsweep or ~/.cache/gnsweep)."""

    def __post_init__(self) -> None:
        self.channels = integer("task.channels", self.channels)
        if self.channels < 1:
            raise ConfigError(f"task.channels: {self.channels} must be >= 1")
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
        for name in ("context", "width", "depth", "heads", "eval_windows"):
            setattr(self, name, integer(f"task.{name}", getattr(self, name)))
        self.holdout = number("task.holdout", self.holdout)
        for name in ("context", "width", "depth", "heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"task.{name}: {getattr(self, name)} must be >= 1")
        if self.width % self.heads:
            raise ConfigError(f"task.heads: {self.heads} must divide task.width={self.width}")
        if not 0 <= self.holdout < 0.5:
            raise ConfigError(f"task.holdout: {self.holdout} must be in [0, 0.5)")
        if self.eval_windows < 0:
            raise ConfigError(f"task.eval_windows: {self.eval_windows} must be >= 0")
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
        self.latent = integer("task.latent", self.latent)
        self.hidden = integer("task.hidden", self.hidden)
        self.holdout = number("task.holdout", self.holdout)
        if self.latent < 1:
            raise ConfigError(f"task.latent: {self.latent} must be >= 1")
        if self.hidden < 1:
            raise ConfigError(f"task.hidden: {self.hidden} must be >= 1")
        if not 0 <= self.holdout < 1:
            raise ConfigError(f"task.holdout: {self.holdout} must be in [0, 1)")
