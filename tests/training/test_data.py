"""A task's Dataset drawn without replacement: every index exactly once an epoch, in one process
and split over DDP ranks, reshuffled each epoch, whatever the step's size; resumed from its state
where it stood; the same draws through DataLoader worker processes."""

from __future__ import annotations

import math

import pytest
import torch
from protocol_tasks import Table, TableTask

from gnsweep.training.data import DatasetSource, make_data, mean_loss

CPU = torch.device("cpu")


def _indices(source: DatasetSource, sizes: list[int]) -> list[int]:
    return [i for size in sizes for i in source.draw(size)["index"].tolist()]


def _epochs(drawn: list[int], per_epoch: int, epochs: int) -> list[list[int]]:
    """The drawn indices cut into epochs: the k-th index drawn belongs to epoch k // per_epoch."""
    return [drawn[e * per_epoch:(e + 1) * per_epoch] for e in range(epochs)]


def test_one_process_draws_every_index_once_an_epoch_reshuffled():
    source = DatasetSource(Table(1000, 4, seed=1), seed=0, world=1, rank=0, device=CPU)
    drawn = _indices(source, [64] * 32)  # 2048 draws: two whole epochs and 48 of the third
    first, second = _epochs(drawn, 1000, 2)
    assert sorted(first) == sorted(second) == list(range(1000))
    assert first != second  # reshuffled
    assert source.epoch == 2 and source.position == 48
    assert source.epochs == pytest.approx(2.048)
    # Another seed, another order.
    other = DatasetSource(Table(1000, 4, seed=1), seed=1, world=1, rank=0, device=CPU)
    assert _indices(other, [64])[:64] != first[:64]


def test_two_ranks_draw_disjoint_shares_that_cover_each_epoch():
    ranks = [DatasetSource(Table(1000, 4, seed=1), seed=0, world=2, rank=r, device=CPU)
             for r in range(2)]
    # A global batch of 64: 32 a rank a step.
    drawn = [_epochs(_indices(source, [64] * 32), 500, 2) for source in ranks]
    for epoch in range(2):
        zero, one = drawn[0][epoch], drawn[1][epoch]
        assert len(set(zero)) == len(set(one)) == 500
        assert not set(zero) & set(one)
        assert sorted(zero + one) == list(range(1000))


def test_an_odd_length_over_two_ranks_repeats_nothing_within_an_epoch():
    ranks = [DatasetSource(Table(1001, 4, seed=1), seed=0, world=2, rank=r, device=CPU)
             for r in range(2)]
    drawn = [_epochs(_indices(source, [10] * 200), 500, 2) for source in ranks]
    for epoch in range(2):
        both = drawn[0][epoch] + drawn[1][epoch]
        assert len(both) == len(set(both)) == 1000 and set(both) <= set(range(1001))


def test_batches_of_changing_size_still_draw_each_index_once_an_epoch():
    source = DatasetSource(Table(100, 4, seed=1), seed=3, world=1, rank=0, device=CPU)
    sizes = [7, 7, 30, 1, 64, 13, 13, 65]  # 200 draws, some batches spanning two epochs
    drawn = _indices(source, sizes)
    for epoch in _epochs(drawn, 100, 2):
        assert sorted(epoch) == list(range(100))


def test_a_source_loaded_from_a_state_mid_epoch_draws_what_it_would_have():
    def fresh() -> DatasetSource:
        return DatasetSource(Table(100, 4, seed=1), seed=0, world=1, rank=0, device=CPU)

    whole = fresh()
    _indices(whole, [16] * 9)  # epoch 1, position 44
    state = {k: v for k, v in whole.state_dict().items()}
    assert state == {"epoch": 1, "position": 44}
    expected = _indices(whole, [16] * 10)
    resumed = fresh()
    resumed.load_state_dict(state)
    assert _indices(resumed, [16] * 10) == expected


@pytest.mark.process
def test_loader_worker_processes_deliver_the_same_batches():
    plain = DatasetSource(Table(100, 4, seed=1), seed=0, world=1, rank=0, device=CPU)
    workers = DatasetSource(Table(100, 4, seed=1), seed=0, world=1, rank=0, device=CPU,
                            workers=2)
    try:
        for size in (16, 16, 16, 8, 8):
            a, b = plain.draw(size), workers.draw(size)
            assert torch.equal(a["index"], b["index"]) and torch.equal(a["x"], b["x"])
        alive = workers._batches._workers  # type: ignore[union-attr]
        assert len(alive) == 2 and all(w.is_alive() for w in alive)
        # Stopped and loaded from where it stood (a resumed run): new workers, same draws.
        state = workers.state_dict()
        workers.close()
        assert not any(w.is_alive() for w in alive)
        workers.load_state_dict(state)
        for size in (8, 16):
            a, b = plain.draw(size), workers.draw(size)
            assert torch.equal(a["index"], b["index"])
    finally:
        workers.close()
    assert workers._batches is None


def test_a_task_with_a_dataset_gets_a_dataset_source_and_its_eval_loss_is_the_mean_over_it():
    task = TableTask(seed=0, n=50)
    assert isinstance(make_data(task, 0, 1, 0, CPU), DatasetSource)
    model = task.model()
    held_out = task.eval_dataset()
    # By hand: the mean of the per-item squared errors over the whole held-out set.
    with torch.no_grad():
        errors = 0.5 * (model(held_out.x).squeeze(-1) - held_out.y).pow(2)
    assert mean_loss(task, model, held_out, CPU, batch_size=64) == pytest.approx(
        float(errors.mean()), rel=1e-6)
    assert math.isnan(make_data(object(), 0, 1, 0, CPU).epochs)  # type: ignore[arg-type]
