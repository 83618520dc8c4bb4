"""The MNIST-1D task: generated offline once, cached atomically, and a CNN that learns it."""

from __future__ import annotations

import math
import random
import socket

import numpy as np
import pytest
import torch
from task_training import mean, train

from gnsweep.config import ConfigError
from gnsweep.tasks import mnist1d


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache folder built once for the module, with the network refused while it is built."""
    folder = tmp_path_factory.mktemp("mnist1d-cache")
    real = socket.socket

    def refuse(*args, **kwargs):
        raise OSError("no network in this test")

    socket.socket = refuse  # type: ignore[misc]
    try:
        mnist1d.load(folder)
    finally:
        socket.socket = real  # type: ignore[misc]
    return folder


@pytest.fixture(scope="module")
def task(cache):
    return mnist1d.make(mnist1d.Options(cache_dir=str(cache)), seed=0)


def test_dataset_is_the_package_default(cache):
    """make_dataset's defaults: 5000 signals of length 40, an 80/20 split, 500 per class,
    standardised over the whole set."""
    data = mnist1d.load(cache)
    assert data["x"].shape == (4000, 40) and data["x_test"].shape == (1000, 40)
    labels = np.concatenate([data["y"], data["y_test"]])
    assert np.bincount(labels).tolist() == [500] * 10
    everything = np.concatenate([data["x"], data["x_test"]])
    assert abs(everything.mean()) < 1e-6 and abs(everything.std() - 1) < 1e-6


def test_cache_is_read_back_without_generating(cache, monkeypatch):
    first = mnist1d.load(cache)

    def forbidden():
        raise AssertionError("generated again although the cache exists")

    monkeypatch.setattr(mnist1d, "generate", forbidden)
    again = mnist1d.load(cache)
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    assert [p.name for p in cache.iterdir()] == [mnist1d.CACHE_NAME]


def test_default_cache_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert mnist1d.cache_dir() == tmp_path / "gnsweep"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert mnist1d.cache_dir() == tmp_path / "home" / ".cache" / "gnsweep"
    assert mnist1d.cache_dir("~/elsewhere") == tmp_path / "home" / "elsewhere"


def test_failed_write_leaves_no_file(cache, monkeypatch, tmp_path):
    """A crash between writing and renaming leaves neither a cache file nor a temporary one, so
    the next run regenerates instead of reading half a file."""
    data = mnist1d.load(cache)
    monkeypatch.setattr(mnist1d, "generate", lambda: data)

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(mnist1d.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        mnist1d.load(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_generation_keeps_the_global_generators(monkeypatch, tmp_path):
    """make_dataset reseeds numpy's and random's global generators; the caller's survive."""
    np.random.seed(123)
    random.seed(123)
    expected_np, expected_py = np.random.rand(), random.random()
    np.random.seed(123)
    random.seed(123)
    mnist1d.generate()
    assert np.random.rand() == expected_np and random.random() == expected_py


def test_shapes_loss_and_examples(task):
    batch = task.sample(32, torch.Generator().manual_seed(0))
    x, y = batch
    assert x.shape == (32, 40) and y.shape == (32,) and task.examples(batch) == 32
    model = task.model()
    assert model(x).shape == (32, 10)
    loss = task.loss(model, batch)
    assert loss.dim() == 0 and math.isfinite(float(loss.detach()))
    # A fresh network's logits are small: about ln(10) nats, the uniform guess.
    assert abs(task.eval_loss(model) - math.log(10)) < 0.1


def test_seed_reproduces_model_and_batches(cache):
    def state(seed):
        task = mnist1d.make(mnist1d.Options(cache_dir=str(cache)), seed=seed)
        return task.model().state_dict(), task.sample(8, torch.Generator().manual_seed(5))

    (a, batch_a), (b, batch_b), (c, _) = state(1), state(1), state(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert torch.equal(batch_a[0], batch_b[0])


def test_bad_options():
    with pytest.raises(ConfigError, match=r"task.channels"):
        mnist1d.Options(channels=0)


@pytest.mark.slow
def test_short_training_learns(task):
    model, losses = train(task, batch_size=64, lr=0.008, steps=300)
    assert mean(losses[:5]) > 2.0  # starts near ln(10) = 2.30
    assert mean(losses[-20:]) < 0.8
    assert task.eval_loss(model) < 1.0
