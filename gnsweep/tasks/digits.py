"""An MLP on scikit-learn's bundled handwritten digits (1797 x 64, 10 classes), cross-entropy.

The data ship inside scikit-learn's wheel, so the default sweep needs no download.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.tasks.options import DigitsOptions

Options = DigitsOptions
"""The task's settings (schema in gnsweep.tasks.options, importable without torch)."""


class Digits:
    def __init__(self, options: Options, seed: int) -> None:
        pixels, labels = load_digits()
        x = torch.tensor(pixels, dtype=torch.float32) / 16.0
        y = torch.tensor(labels, dtype=torch.long)
        # The split is fixed (seed 0) so that every run of a sweep sees the same data.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        n_eval = round(options.holdout * len(x))
        self._eval = (x[order[:n_eval]], y[order[:n_eval]]) if n_eval else None
        self.x, self.y = x[order[n_eval:]], y[order[n_eval:]]
        mean, std = self.x.mean(0), self.x.std(0).clamp_min(1e-3)
        self.x = (self.x - mean) / std
        if self._eval is not None:
            self._eval = ((self._eval[0] - mean) / std, self._eval[1])
        self.options, self.seed = options, seed
        if options.exact_truth:
            # Runs log `truth(model)` where a task has it (gnsweep.measure.run_probes).
            self.truth = self.exact
            self.truth_is_costly = True

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self._build()

    def _build(self) -> nn.Module:
        layers: list[nn.Module] = []
        width = self.x.shape[1]
        for _ in range(self.options.depth):
            layers += [nn.Linear(width, self.options.hidden), nn.Tanh()]
            width = self.options.hidden
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)

    def sample(self, batch_size: int, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(len(self.x), (batch_size,), generator=generator)
        return self.x[index], self.y[index]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return self.output_loss(model(x), y)

    @staticmethod
    def output_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch-mean cross-entropy of the model's outputs: the `loss_fn(outputs, targets)`
        form that `NoiseScaleMonitor` and the framework integrations take."""
        return F.cross_entropy(outputs, targets)

    def eval_loss(self, model: nn.Module) -> float:
        """Cross-entropy on the held-out split (NaN without one)."""
        if self._eval is None:
            return float("nan")
        device = next(model.parameters()).device
        with torch.no_grad():
            x, y = self._eval
            return float(self.loss(model, (x.to(device), y.to(device))))

    def exact(self, model: nn.Module) -> TrainingSetTruth:
        """The exact noise scale of the distribution SGD samples from (uniform over the training
        set, with replacement): with per-example gradients g_i over all N training examples,
        G = mean g_i, tr(Sigma) = mean |g_i|^2 - |G|^2, B_simple = tr(Sigma) / |G|^2 (eq. 2.9);
        and the training set's whole loss (no sampling noise, no smoothing)."""
        from torch.func import functional_call, grad, vmap

        live = cast(nn.Module, model.module) if hasattr(model, "module") else model
        # A hook-free copy: the training monitor's hooks do not work under vmap.
        module = self._build()
        module.load_state_dict(live.state_dict())
        params = {k: v.detach() for k, v in module.named_parameters()}

        def one(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(module, p, (x[None],)), y[None])

        total = torch.zeros((), dtype=torch.float64)
        mean = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
        n = len(self.x)
        for lo in range(0, n, 512):
            x, y = self.x[lo:lo + 512], self.y[lo:lo + 512]
            grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
            for k, g in grads.items():
                g = g.double()
                total += g.reshape(len(x), -1).pow(2).sum()
                mean[k] += g.sum(0)
        g2 = float(sum((m / n).pow(2).sum() for m in mean.values()))
        trace = float(total) / n - g2
        return TrainingSetTruth(loss=self.training_loss(model),
                                b_simple=trace / g2 if g2 > 0 else float("nan"))

    @torch.no_grad()
    def training_loss(self, model: nn.Module) -> float:
        """The mean loss over every training example: lag-free, no sampling noise."""
        was_training = model.training
        model.eval()
        loss = float(F.cross_entropy(model(self.x), self.y))
        model.train(was_training)
        return loss


@dataclass(frozen=True)
class TrainingSetTruth:
    loss: float
    """The whole training set's mean loss."""
    b_simple: float
    """Exact tr(Sigma) / |G|^2 over the training set (eq. 2.9)."""
    b_noise: float = float("nan")
    """Not computed (it needs the Hessian)."""


@functools.cache
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 x 64 pixels (0..16) and labels, read from the file scikit-learn ships.

    Reading the CSV directly skips `import sklearn` (about 1.4 s here), which every worker
    process would otherwise pay; sklearn's own loader is the fallback if the file moves.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    return data.data, data.target


def make(options: Options, seed: int) -> Digits:
    return Digits(options, seed)
