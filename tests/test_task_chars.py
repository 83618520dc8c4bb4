"""The character-level language model: windows of the standard library's text, counted in tokens,
a causal transformer, nats per character."""

from __future__ import annotations

import math

import pytest
import torch
from task_training import mean, train

from gnsweep.config import ConfigError
from gnsweep.tasks import chars

SMALL = chars.Options(context=16, width=32, depth=1, heads=2, eval_windows=8)


@pytest.fixture(scope="module")
def task():
    return chars.make(SMALL, seed=0)


def _decode(task, tokens: torch.Tensor) -> str:
    return "".join(task.alphabet[int(i)] for i in tokens)


def test_windows_are_pieces_of_the_training_text(task):
    batch = task.sample(6, torch.Generator().manual_seed(0))
    assert batch.shape == (6, SMALL.context + 1) and batch.dtype == torch.long
    corpus = chars.text()
    train_text = corpus[:len(task.train)]
    for row in batch:
        assert _decode(task, row) in train_text
    held_out = corpus[len(task.train):]
    for row in task._eval:
        assert _decode(task, row) in held_out


def test_examples_are_predicted_tokens(task):
    batch = task.sample(5, torch.Generator().manual_seed(1))
    assert task.examples(batch) == 5 * SMALL.context


def test_loss_is_nats_per_character(task):
    """A fresh model is close to uniform over the alphabet: about ln(len(alphabet)) nats."""
    model = task.model()
    batch = task.sample(4, torch.Generator().manual_seed(2))
    assert model(batch[:, :-1]).shape == (4, SMALL.context, len(task.alphabet))
    loss = task.loss(model, batch)
    assert loss.dim() == 0
    assert abs(float(loss.detach()) - math.log(len(task.alphabet))) < 0.6
    assert len(task.alphabet) > 50


def test_model_is_causal(task):
    """Changing a later character leaves the predictions at earlier positions unchanged."""
    model = task.model()
    tokens = task.sample(1, torch.Generator().manual_seed(3))[:, :-1]
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % len(task.alphabet)
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_seed_reproduces_model_and_batches():
    a, b, c = (chars.make(SMALL, seed=s) for s in (4, 4, 5))
    sa, sb, sc = (t.model().state_dict() for t in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    batches = [t.sample(3, torch.Generator().manual_seed(6)) for t in (a, b)]
    assert torch.equal(*batches)


@pytest.mark.parametrize(("options", "field"), [
    ({"width": 30, "heads": 4}, r"task.heads"),
    ({"context": 0}, r"task.context"),
    ({"holdout": 0.7}, r"task.holdout"),
    ({"holdout": 0.0}, r"task.eval_windows"),
])
def test_bad_options(options, field):
    with pytest.raises(ConfigError, match=field):
        chars.Options(**options)


@pytest.mark.slow
def test_short_training_learns(task):
    model, losses = train(task, batch_size=16, lr=0.004, steps=150)
    assert mean(losses[:5]) > 4.0
    # Character frequencies alone give about 3.3 nats (the unigram entropy of this text).
    assert mean(losses[-10:]) < 3.0
    assert task.eval_loss(model) < 3.0


def test_the_registry_counts_chars_batches_in_tokens():
    """compare's table and axis labels take the unit from the registry."""
    from gnsweep.config import TaskConfig
    from gnsweep.tasks import about

    assert about(TaskConfig("chars")).unit == "tokens"
