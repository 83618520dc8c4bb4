"""The noise scale of one block of the parameters (`NoiseScaleMonitor(parameters=...)`): linreg's
closed-form truth with an unrelated second network trained beside it, and the same per-step
norms as a monitor on a model made of that block alone."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gnsweep.distributed import close_process_group
from gnsweep.measure import NoiseScaleMonitor, measure_noise_scale
from gnsweep.tasks import linreg

# The truth point of test_measure.py (about 1% sampling error per pooled estimate).
OPTIONS = linreg.Options(dim=64, condition=4.0)
BATCH, BATCHES = 256, 600


class _WithDistractor(nn.Module):
    """linreg's linear model beside an unrelated MLP head with a large, noisy loss of its own:
    the measured block's gradient is linreg's alone; the whole gradient is dominated by the
    head."""

    def __init__(self, linear: nn.Linear, dim: int) -> None:
        super().__init__()
        self.linear = linear
        torch.manual_seed(1)
        self.head = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), self.head(x)


def _loss(outputs: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    main, head = outputs
    return linreg.LinReg.output_loss(main, y) + 10.0 * (head.squeeze(-1) - y.pow(2)).pow(2).mean()


def _setup():
    task = linreg.make(OPTIONS, seed=0)
    linear = task.model()
    model = _WithDistractor(linear, OPTIONS.dim)
    generator = torch.Generator().manual_seed(0)
    batches = [task.sample(BATCH, generator) for _ in range(BATCHES)]
    return task, linear, model, batches


@pytest.mark.parametrize("method", ["per_example", "microbatch"])
def test_a_parameter_block_has_the_closed_form_noise_scale_of_its_own_loss(method):
    task, linear, model, batches = _setup()
    truth = task.truth(linear)
    estimate = measure_noise_scale(model, _loss, batches, method=method, hessian=True,
                                   hessian_microbatches=8, parameters=linear.parameters())
    # The distractor's loss does not touch linreg's block: its gradient, Sigma and Hessian block
    # are linreg's (eq. 2.8-2.9 on that block).
    for name in ("b_simple", "g2", "trace_sigma", "b_noise", "g_h_g", "trace_h_sigma"):
        assert getattr(estimate, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    whole = measure_noise_scale(model, _loss, batches[:100], method=method)
    # Unrestricted, the head sets B_simple (35 here, 40% off linreg's 58).
    assert whole.b_simple != pytest.approx(truth.b_simple, rel=0.25)


def _per_step(monitor, net, loss_fn, batches):
    pairs = []
    for x, y in batches:
        net.zero_grad(set_to_none=True)
        k = 4 if monitor.needs_microbatches else 1
        for xs, ys in zip(x.tensor_split(k), y.tensor_split(k), strict=True):
            (loss_fn(net(xs), ys) / k).backward()
            monitor.accumulate()
        e = monitor.step()
        pairs.append((e.sq_norm_small, e.sq_norm_big, e.b_small, e.b_big))
    monitor.close()  # one monitor at a time: both would hook the shared linear layer
    return pairs


@pytest.mark.parametrize("method", ["per_example", "microbatch"])
def test_restricted_monitor_sees_what_a_monitor_on_the_block_alone_sees(method):
    _, linear, model, batches = _setup()
    restricted = NoiseScaleMonitor(model, method, parameters=list(linear.parameters()))
    got = _per_step(restricted, model, _loss, batches[:5])
    alone = NoiseScaleMonitor(linear, method)
    expected = _per_step(alone, linear, linreg.LinReg.output_loss, batches[:5])
    for a, b in zip(got, expected, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_a_layer_measured_in_part_falls_back_to_microbatches(caplog):
    _, linear, model, _ = _setup()
    with caplog.at_level(logging.WARNING, logger="gnsweep.measure"):
        monitor = NoiseScaleMonitor(model, "per_example", parameters=[linear.weight])
    assert "linear (only some of its parameters measured)" in caplog.text
    assert monitor.needs_microbatches and monitor.params == [linear.weight]
    monitor.close()


def test_bad_parameter_choices_are_clear_errors():
    _, linear, model, _ = _setup()
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="trainable parameters of the model"):
        NoiseScaleMonitor(model, parameters=[stranger])
    with pytest.raises(ValueError, match="empty"):
        NoiseScaleMonitor(model, parameters=[])
    linear.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="trainable parameters of the model"):
        NoiseScaleMonitor(model, parameters=[linear.bias])


# -- DDP, for real: two gloo processes --------------------------------------------------------


def _ddp_worker(rank: int, world: int, store: str, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        task = linreg.make(OPTIONS, seed=0)
        linear = task.model()
        # Small buckets: the measured block's gradients share buckets with the head's or not.
        model = DDP(_WithDistractor(linear, OPTIONS.dim), bucket_cap_mb=0.0001)
        truth = task.truth(linear)
        generator = torch.Generator().manual_seed(100 + rank)
        batches = (task.sample(BATCH // 2, generator) for _ in range(BATCHES))
        estimate = measure_noise_scale(model, _loss, batches, method="ddp",
                                       parameters=linear.parameters())
        if rank == 0:
            Path(out).write_text(json.dumps({
                "b_simple": estimate.b_simple / truth.b_simple, "g2": estimate.g2 / truth.g2,
                "pair": [estimate.b_small, estimate.b_big]}))
    finally:
        close_process_group(clean=sys.exc_info()[0] is None)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_measures_the_block_alone(tmp_path):
    import json

    import torch.multiprocessing as mp

    out = tmp_path / "result.json"
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2)
    result = json.loads(out.read_text())
    assert result["pair"] == [BATCH // 2, BATCH]
    assert result["b_simple"] == pytest.approx(1, abs=0.05)
    assert result["g2"] == pytest.approx(1, abs=0.05)


@pytest.mark.parametrize("method", ["per_example", "microbatch"])
def test_one_shot_measurement_from_a_tasks_own_loss(method):
    """`measure_noise_scale(model, None, batches, task_loss=task.loss)` on the batches a task
    samples: linreg's closed form, B_noise included (the Hessian passes use the task's loss)."""
    task, model, _, batches = _setup()
    estimate = measure_noise_scale(model, None, batches, method=method, hessian=True,
                                   hessian_microbatches=8, task_loss=task.loss)
    truth = task.truth(model)
    for name in ("b_simple", "g2", "trace_sigma", "b_noise"):
        assert getattr(estimate, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    with pytest.raises(ValueError, match="exactly one"):
        measure_noise_scale(model, None, batches[:1])
