"""A small 1-D CNN on MNIST-1D (Greydanus 2020: 4000 training + 1000 test signals of length 40,
10 classes), cross-entropy in nats per example.

The data are generated offline by the `mnist1d` package's `make_dataset` with its default
arguments (seeded inside the package, so every machine builds the same arrays), never its
`get_dataset`, which downloads. The arrays are cached as `.npz` under the user's cache folder
(`$XDG_CACHE_HOME/gnsweep`, else `~/.cache/gnsweep`), written to a temporary file and renamed,
so concurrent workers never read half a file; after the first build no worker imports `mnist1d`
(which pulls in matplotlib and requests).

Protocol: `sample(B, generator)` returns `(x, y)`, x of shape (B, 40); `loss(model, batch)` is the
batch-mean cross-entropy; `eval_loss(model)` the cross-entropy on the package's 1000 test signals.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.tasks.options import Mnist1dOptions

DESCRIPTION = ("1-D CNN on MNIST-1D (4000 x 40 signals, 10 classes; generated offline, cached), "
               "cross-entropy.")

LENGTH = 40
CACHE_NAME = "mnist1d-default-v1.npz"
"""Bump the suffix if the generation or the arrays kept ever change."""


Options = Mnist1dOptions
"""The task's settings (schema in gnsweep.tasks.options, importable without torch)."""


def cache_dir(option: str = "") -> Path:
    """The folder the generated data live in (see `Options.cache_dir`)."""
    if option:
        return Path(option).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "gnsweep"


def generate() -> dict[str, np.ndarray]:
    """MNIST-1D from `mnist1d.data.make_dataset` with its default arguments (no download)."""
    try:
        from mnist1d.data import make_dataset
    except ModuleNotFoundError as err:
        if err.name != "mnist1d":
            raise
        from gnsweep.errors import ConfigError

        raise ConfigError("task mnist1d needs the mnist1d package: pip install mnist1d") from None
    # make_dataset reseeds numpy's and random's global generators; keep the caller's.
    import random

    numpy_state, random_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset()
    finally:
        np.random.set_state(numpy_state)
        random.setstate(random_state)
    return {key: np.asarray(data[key]) for key in ("x", "y", "x_test", "y_test")}


def load(folder: Path) -> dict[str, np.ndarray]:
    """The cached arrays, generating and caching them on first use."""
    path = folder / CACHE_NAME
    if path.is_file():
        with np.load(path) as arrays:
            return {key: arrays[key] for key in arrays.files}
    data = generate()
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, x=data["x"], y=data["y"], x_test=data["x_test"], y_test=data["y_test"])
    # Same folder, then rename: another process sees the old state or the whole file.
    handle, temp = tempfile.mkstemp(prefix=f".{CACHE_NAME}.", dir=folder)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(buffer.getvalue())
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return data


class Net(nn.Module):
    """Three convolutions (the last two with stride 2: 40 -> 20 -> 10) and a linear head.

    The 1-D convolutions are `nn.Conv2d` with (1, k) kernels over a (B, 1, 1, 40) view: the
    per-example gradient norms cover Conv2d, not Conv1d.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        c = channels
        self.convs = nn.ModuleList([
            nn.Conv2d(1, c, (1, 5), padding=(0, 2)),
            nn.Conv2d(c, c, (1, 3), stride=(1, 2), padding=(0, 1)),
            nn.Conv2d(c, c, (1, 3), stride=(1, 2), padding=(0, 1)),
        ])
        self.head = nn.Linear(c * LENGTH // 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(len(x), 1, 1, -1)
        for conv in self.convs:
            h = F.relu(conv(h))
        return self.head(h.flatten(1))


class Mnist1d:
    def __init__(self, options: Options, seed: int) -> None:
        data = load(cache_dir(options.cache_dir))
        self.x = torch.tensor(data["x"], dtype=torch.float32)
        self.y = torch.tensor(data["y"], dtype=torch.long)
        self.x_test = torch.tensor(data["x_test"], dtype=torch.float32)
        self.y_test = torch.tensor(data["y_test"], dtype=torch.long)
        self.options, self.seed = options, seed

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return Net(self.options.channels)

    def sample(self, batch_size: int, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(len(self.x), (batch_size,), generator=generator)
        return self.x[index], self.y[index]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(self.x_test), self.y_test))

    def examples(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return len(batch[0])


def make(options: Options, seed: int) -> Mnist1d:
    return Mnist1d(options, seed)
