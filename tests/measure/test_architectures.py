"""The noise scale on the architectures people train, against brute force.

Each model is slightly trained, then held fixed; brute force is B_simple from 100 independent
batch gradients by plain autograd (no hooks; `brute_force_b_simple`), on the same batches the
methods measure (their sampling errors then largely cancel, so 100 batches resolve 10%). Every
method that claims the model is within 10% of it, or refuses with a reason. For a model with
batch statistics, `microbatch` at fixed parameters is the brute-force definition itself (each
batch with its own statistics); what is checked there is the refusal of per-example norms and
the estimates during training.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from gnsweep import NoiseScaleMonitor, measure_noise_scale
from gnsweep.bench.architectures import (
    BUILDERS,
    brute_force_b_simple,
    cnn_batchnorm,
    gpt2,
    slightly_trained,
)
from gnsweep.measure.batchstats import batch_statistics_layers

# (batch size, learning rate and steps of the training before): B near each model's B_simple
# keeps both |G|^2 and tr(Sigma) resolved by 100 batches.
SETUP = {"mlp": (128, 0.05, 30), "cnn_batchnorm": (64, 0.05, 20),
         "cnn_groupnorm": (64, 0.05, 20), "lstm_lm": (32, 0.5, 40), "gpt2": (16, 0.3, 40)}


@pytest.fixture(scope="module", params=list(SETUP))
def fixed(request):
    name = request.param
    batch_size, lr, steps = SETUP[name]
    arch = slightly_trained(BUILDERS[name](0), steps=steps, lr=lr)
    generator = torch.Generator().manual_seed(2)
    batches = [arch.sample(batch_size, generator) for _ in range(100)]
    return arch, brute_force_b_simple(arch, batches), batches


@pytest.mark.parametrize("method", ["per_example", "microbatch", "auto"])
def test_each_method_matches_brute_force_or_refuses(fixed, method):
    arch, truth, batches = fixed
    has_batch_statistics = bool(batch_statistics_layers(arch.model))
    if method == "per_example" and has_batch_statistics:
        with pytest.raises(ValueError, match=r"statistics of the batch.*method='microbatch'"):
            measure_noise_scale(arch.model, None, batches, method=method, task_loss=arch.loss)
        return
    estimate = measure_noise_scale(arch.model, None, batches, method=method,
                                   task_loss=arch.loss)
    assert estimate.b_simple == pytest.approx(truth, rel=0.10), (arch.name, method)


def test_gpt2_and_lstm_are_covered_or_said_once(caplog):
    """GPT-2's Conv1D, tied embedding and broadcast positions all get per-example norms; the
    LSTM's parameters fall back to micro-batches, said once per process, not once per run."""
    model = gpt2(0).model
    monitor = NoiseScaleMonitor(model, "per_example")
    assert not monitor.needs_microbatches
    monitor.close()
    lstm = BUILDERS["lstm_lm"](0).model
    with caplog.at_level(logging.WARNING, logger="gnsweep.measure"):
        for _ in range(2):
            monitor = NoiseScaleMonitor(lstm, "per_example")
            assert monitor.needs_microbatches
            monitor.close()
    said = [r for r in caplog.records if "no per-example norms for lstm (LSTM)" in r.message]
    assert len(said) <= 1  # zero when an earlier test in this process said it


@pytest.mark.parametrize("form", ["explicit", "explicit_in_chunks", "gram"])
def test_tied_weights_are_the_norm_of_the_sum(form, monkeypatch):
    """A weight shared by an embedding and the output layer, one shared by two embeddings, and a
    linear layer used twice in one forward through a shared copy: sum_i |g_i|^2 against each
    example's own backward, by the explicit per-example gradient (whole, and a few examples at
    a time as for a large vocabulary) and by the Gram form of the uses' cross terms."""
    from gnsweep.measure.per_example import tied

    monkeypatch.setattr(tied, "_explicit_cheaper", lambda uses: form != "gram")
    if form == "explicit_in_chunks":  # 7 x 5 fp32 gradients: 4 examples, then 2
        monkeypatch.setattr(tied, "EXPLICIT_BYTES", 4 * 7 * 5 * 4)

    class TiedLm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 5, padding_idx=0)
            self.mix = nn.Linear(5, 5)
            self.mix_again = nn.Linear(5, 5, bias=False)
            self.mix_again.weight = self.mix.weight
            self.head = nn.Linear(5, 7, bias=False)
            self.head.weight = self.embed.weight
            self.extra = nn.Embedding(4, 5)  # a weight shared by embeddings only
            self.extra_again = nn.Embedding(4, 5)
            self.extra_again.weight = self.extra.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens) + self.extra(tokens % 4) * self.extra_again((tokens + 1) % 4)
            h = torch.tanh(self.mix(h))
            return self.head(torch.tanh(self.mix_again(h)))

    torch.manual_seed(0)
    model = TiedLm()
    tokens = torch.randint(0, 7, (6, 4), generator=torch.Generator().manual_seed(1))

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x).reshape(-1, 7), x.roll(1, 1).reshape(-1))

    params = list(model.parameters())
    expected = sum(float(sum((g.double() ** 2).sum() for g in
                             torch.autograd.grad(loss_of(tokens[i:i + 1]), params)))
                   for i in range(len(tokens))) / len(tokens)
    monitor = NoiseScaleMonitor(model, "per_example")
    assert not monitor.needs_microbatches
    loss_of(tokens).backward()
    estimate = monitor.step()
    monitor.close()
    assert estimate is not None
    assert estimate.sq_norm_small == pytest.approx(expected, rel=1e-5)


def test_batch_statistics_are_detected_in_every_form():
    class Custom(nn.Module):  # keeps running statistics of its own
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("running_mean", torch.zeros(3))

    for layer in (nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.BatchNorm3d(3), nn.SyncBatchNorm(3),
                  nn.LazyBatchNorm1d(), Custom()):
        assert batch_statistics_layers(nn.Sequential(nn.Linear(3, 3), layer)), layer
    for layer in (nn.GroupNorm(1, 3), nn.LayerNorm(3), nn.InstanceNorm1d(3,
                                                                        track_running_stats=True)):
        assert not batch_statistics_layers(nn.Sequential(layer)), layer
    assert not batch_statistics_layers(nn.Sequential(nn.BatchNorm1d(3)).eval())
    assert batch_statistics_layers(nn.Sequential(nn.BatchNorm1d(3, track_running_stats=False))
                                   .eval())


def test_batchnorm_training_with_auto_logs_positive_b_simple():
    """auto on a BatchNorm CNN measures micro-batches (ghost batches of the training loop's
    accumulation): the per-step estimates stay positive instead of per-example norms' large
    negative values."""
    arch = cnn_batchnorm(0)
    model = arch.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = NoiseScaleMonitor(model)  # auto
    assert monitor.method == "microbatch"
    generator = torch.Generator().manual_seed(0)
    values = []
    for _ in range(30):
        optimizer.zero_grad()
        x, y = arch.sample(64, generator)
        for part in range(4):
            piece = slice(16 * part, 16 * (part + 1))
            (arch.loss(model, (x[piece], y[piece])) / 4).backward()
            monitor.accumulate()
        estimate = monitor.step()
        optimizer.step()
        assert estimate is not None
        values.append(estimate.b_simple)
    monitor.close()
    assert sum(v > 0 for v in values[5:]) == len(values[5:])


def test_a_batchnorm_run_of_the_sweep_loop_measures_ghost_batches(tmp_path):
    """noise.method=auto on a BatchNorm model in gnsweep's own loop: micro-batches (each with
    its own statistics), never per-example norms; B_simple is not systematically negative."""
    from gnsweep import paths, store
    from gnsweep.config import Config, NoiseConfig, SweepConfig, TaskConfig
    from gnsweep.runs import RunSpec
    from gnsweep.training import train

    config = Config(task=TaskConfig("custom", {"_target_": "protocol_tasks.batch_normed"}),
                    sweep=SweepConfig(batch_sizes=[32], learning_rates=[0.02], targets=[1e-9],
                                      max_steps=40, eval_every=0),
                    noise=NoiseConfig(method="auto"))
    # 40 steps: far from the noise floor, where |G|^2 is well above its estimate's spread.
    train(config, RunSpec(32, 0.02, 0), tmp_path)
    metrics = store.read_table(tmp_path / paths.METRICS).to_pandas()
    assert (metrics["b_small"].dropna() == 8).all()  # 32 examples in noise.microbatches = 4
    late = metrics["b_simple"].iloc[10:]
    assert (late > 0).mean() > 0.9


def test_the_overhead_bench_runs_each_method():
    """`step_seconds` (make bench's overhead rows) runs plain, per-example and micro-batch steps
    and refuses per-example norms on BatchNorm, as the monitor does (no timing asserted)."""
    from gnsweep.bench.architectures import mlp, step_seconds

    for method in (None, "per_example", "microbatch"):
        assert step_seconds(mlp(0), 16, method, steps=2) > 0
    with pytest.raises(ValueError, match="statistics of the batch"):
        step_seconds(cnn_batchnorm(0), 16, "per_example", steps=2)


def test_syncbatchnorm_under_ddp_is_refused_and_batchnorm_is_not():
    """Ranks that share batch statistics are not independent batches: the DDP method refuses
    SyncBatchNorm; per-rank BatchNorm is exactly what each rank trains with."""
    from gnsweep.measure.batchstats import choose_method

    sync = nn.Sequential(nn.Linear(3, 3), nn.SyncBatchNorm(3))
    with pytest.raises(ValueError, match="share batch statistics across ranks"):
        choose_method(sync, "auto", distributed=True)
    plain = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    assert choose_method(plain, "auto", distributed=True) == "ddp"
    assert choose_method(plain, "auto", distributed=False) == "microbatch"
    assert choose_method(plain.eval(), "auto", distributed=False) == "per_example"
