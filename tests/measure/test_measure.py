"""Gradient-norm sources against mathematics: per-example norms against explicit per-example
gradients, and B_simple / B_noise of every method against the closed-form truth of linreg."""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from locations import ROOT
from torch import nn

import gnsweep
from gnsweep.config import Config, NoiseConfig, SweepConfig, TaskConfig
from gnsweep.distributed import close_process_group
from gnsweep.measure import NoiseScaleMonitor, hessian_norms, measure_noise_scale
from gnsweep.sweep import RunSpec
from gnsweep.tasks import linreg, make_task

# A truth point where every method's pooled estimate has about 1% sampling error (measured
# over seeds while writing these tests), so 5% is several standard errors.
TRUTH_OPTIONS = linreg.Options(dim=64, condition=4.0)
BATCH, BATCHES = 256, 600


def _mse(outputs, targets):
    return ((outputs - targets) ** 2).mean()


# -- per-example norms are exact ------------------------------------------------------------


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 3)
        self.rms = nn.RMSNorm(3)

    def forward(self, x):
        return self.rms(self.proj(self.norm(self.embed(x)))).mean(1)


def _cases():
    g = torch.Generator().manual_seed(0)
    return {
        "mlp": (lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)),
                torch.randn(6, 5, generator=g)),
        # Few positions, wide layers: the Gram form; many positions, narrow: explicit.
        "sequence_gram": (lambda: nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 2)),
                          torch.randn(6, 3, 30, generator=g)),
        "sequence_explicit": (lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
                              torch.randn(6, 9, 3, generator=g)),
        "conv": (lambda: nn.Sequential(
            nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2), nn.ReLU(),
            nn.Conv2d(6, 2, 3, padding="same", padding_mode="reflect"), nn.Flatten(),
            nn.Linear(2 * 16, 2)), torch.randn(5, 4, 7, 7, generator=g)),
        "tokens": (_Tokens, torch.randint(0, 5, (6, 7), generator=g)),  # repeats + padding
    }


def _per_example_mean_sq(model, x, y, params) -> float:
    """Brute force: the mean over examples of |g_i|^2, each example's own loss and backward."""
    total = 0.0
    for i in range(len(x)):
        grads = torch.autograd.grad(_mse(model(x[i:i + 1]), y[i:i + 1]), params)
        total += sum(float((g.double() ** 2).sum()) for g in grads)
    return total / len(x)


@pytest.mark.parametrize("name", list(_cases()))
def test_per_example_norms_are_exact(name):
    make, x = _cases()[name]
    torch.manual_seed(0)
    model = make()
    y = torch.randn(model(x).shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters()]
    expected = _per_example_mean_sq(model, x, y, params)
    monitor = NoiseScaleMonitor(model, "per_example")
    assert not monitor.needs_microbatches
    model.zero_grad()
    _mse(model(x), y).backward()
    estimate = monitor.step()
    monitor.close()
    assert estimate is not None and (estimate.b_small, estimate.b_big) == (1, len(x))
    assert estimate.sq_norm_small == pytest.approx(expected, rel=1e-5)
    big = sum(float((p.grad.double() ** 2).sum()) for p in params)
    assert estimate.sq_norm_big == pytest.approx(big, rel=1e-6)


class _Rows(nn.Module):
    """Linear layers with one example per row in the shapes their hooks must get right: no
    bias, a frozen weight (bias trained), an in-place ReLU on an output (its hook needs the
    gradient before it), and two branches whose backward order is not the forward's reverse."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7, bias=False)
        self.b = nn.Linear(5, 7)
        self.c = nn.Linear(7, 2)
        self.c.weight.requires_grad_(False)

    def forward(self, x):
        return self.c(torch.relu_(self.a(x)) + torch.tanh(self.b(x)))


@pytest.mark.parametrize("create_graph", [False, True])
def test_per_example_rows_are_exact(create_graph):
    torch.manual_seed(0)
    model = _Rows()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = _per_example_mean_sq(model, x, y, params)
    monitor = NoiseScaleMonitor(model, "per_example")
    assert not monitor.needs_microbatches
    _mse(model(x), y).backward(create_graph=create_graph)  # a graph of the gradient: none kept
    estimate = monitor.step()
    monitor.close()
    assert estimate is not None and estimate.sq_norm_small == pytest.approx(expected, rel=1e-5)
    big = sum(float((p.grad.double() ** 2).sum()) for p in params)
    assert estimate.sq_norm_big == pytest.approx(big, rel=1e-6)


# -- ground truth -------------------------------------------------------------------------


def _truth_setup(seed: int = 0):
    task = linreg.make(TRUTH_OPTIONS, seed=0)
    model = task.model()
    generator = torch.Generator().manual_seed(seed)
    batches = [task.sample(BATCH, generator) for _ in range(BATCHES)]
    return task, model, batches


@pytest.mark.parametrize("method", ["per_example", "microbatch"])
def test_b_simple_and_b_noise_match_the_truth(method):
    task, model, batches = _truth_setup()
    truth = task.truth(model)
    before = [p.detach().clone() for p in model.parameters()]
    estimate = measure_noise_scale(model, task.output_loss, batches, method=method, hessian=True,
                                   hessian_microbatches=8)
    assert estimate.b_simple == pytest.approx(truth.b_simple, rel=0.05)
    assert estimate.g2 == pytest.approx(truth.g2, rel=0.05)
    assert estimate.trace_sigma == pytest.approx(truth.trace_sigma, rel=0.05)
    assert estimate.b_noise == pytest.approx(truth.b_noise, rel=0.05)
    assert estimate.g_h_g == pytest.approx(truth.g_h_g, rel=0.05)
    assert estimate.trace_h_sigma == pytest.approx(truth.trace_h_sigma, rel=0.05)
    # No step taken, gradients left as they were.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


class _Shift(nn.Module):
    """An output offset around a child layer: a parameter of a layer kind without per-example
    norms (a leaf layer of one's own would be measured by its own forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.tensor(0.3))
        self.inner = nn.Identity()

    def forward(self, x):
        return self.inner(x) + self.offset


class _Attention(nn.Module):
    """One attention layer over 5 positions: by `scaled_dot_product_attention` (fused kernels
    without double backward) or written out (softmax(q k^T / sqrt(d)) v)."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.qkv = nn.Linear(4, 12)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        # (batch, 2 heads, positions, 2): the layout the fused kernels take.
        q, k, v = (t.unflatten(-1, (2, 2)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.fused:
            h = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            h = torch.softmax(q @ k.transpose(-1, -2) / 2 ** 0.5, dim=-1) @ v
        return self.out(h.transpose(1, 2).flatten(2)).mean((1, 2))


def test_b_noise_of_attention_by_a_fused_kernel_equals_written_out_attention():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 5, 4, generator=g), torch.randn(16, generator=g)
    norms = []
    for fused in (True, False):
        torch.manual_seed(0)
        norms.append(hessian_norms(_Attention(fused), _mse, (x, y), 2))
    assert norms[0] is not None and norms[1] is not None
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    assert norms[0].sq_small > 0


def test_per_example_falls_back_to_microbatches(caplog):
    task, linear, batches = _truth_setup()
    model = nn.Sequential(linear, _Shift())
    # The offset adds to the bias: the truth is the task's at bias + offset, with the offset's
    # gradient (equal to the bias's) counted once more: G_b^2 in |G|^2 and Var(g_b) in tr(Sigma).
    reference = task.model()
    with torch.no_grad():
        reference.weight.copy_(linear.weight)
        reference.bias.copy_(linear.bias + 0.3)
    truth = task.truth(reference)
    c = float(reference.bias.detach())
    g2 = truth.g2 + c * c
    trace = truth.trace_sigma + 2 * truth.loss - c * c  # Var(g_b) = s2 - c^2 = 2 loss - c^2
    with caplog.at_level(logging.WARNING, logger="gnsweep.measure"):
        estimate = measure_noise_scale(model, task.output_loss, batches[:300], method="per_example")
    assert "no per-example norms for 1 (its own offset: used beside its child layers" in caplog.text
    assert estimate.b_simple == pytest.approx(trace / g2, rel=0.05)


def _pooled_ratio_and_error(model, loss_fn, batches, method) -> tuple[float, float]:
    """B_simple from per-batch unbiased estimates, with its standard error (delta method)."""
    monitor = NoiseScaleMonitor(model, method)
    g2s, traces = [], []
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        k = 4 if monitor.needs_microbatches else 1
        for xs, ys in zip(x.tensor_split(k), y.tensor_split(k), strict=True):
            (loss_fn(model(xs), ys) / k).backward()
            monitor.accumulate()
        estimate = monitor.step()
        g2s.append(estimate.g2_step)
        traces.append(estimate.trace_sigma_step)
    monitor.close()
    g2, trace = torch.tensor(g2s, dtype=torch.float64), torch.tensor(traces, dtype=torch.float64)
    ratio = float(trace.mean() / g2.mean())
    # Var of a ratio of means: (var_t - 2 r cov + r^2 var_g) / (n mean_g^2).
    cov = torch.cov(torch.stack([trace, g2]))
    var = (cov[0, 0] - 2 * ratio * cov[0, 1] + ratio ** 2 * cov[1, 1]) / (len(g2s) * g2.mean() ** 2)
    return ratio, float(var.sqrt())


def test_methods_agree_within_sampling_error():
    task = make_task("digits", {}, seed=0)
    model = task.model()
    generator = torch.Generator().manual_seed(3)
    batches = [task.sample(64, generator) for _ in range(150)]
    per_example = _pooled_ratio_and_error(model, task.output_loss, batches, "per_example")
    microbatch = _pooled_ratio_and_error(model, task.output_loss, batches, "microbatch")
    difference = abs(per_example[0] - microbatch[0])
    assert difference < 4 * math.hypot(per_example[1], microbatch[1])


# -- the monitor in a training loop -------------------------------------------------------


def test_monitor_in_a_training_loop(caplog):
    task = linreg.make(linreg.Options(dim=8), seed=0)
    model = task.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = NoiseScaleMonitor(model, "per_example", every=3, loss_fn=task.output_loss,
                                hessian_every=6, ema_examples=512)
    generator = torch.Generator().manual_seed(0)
    seen = []
    with caplog.at_level(logging.WARNING, logger="gnsweep.measure"):
        for step in range(13):
            x, y = task.sample(32, generator)
            optimizer.zero_grad()
            assert monitor.measuring == (step % 3 == 0)
            task.output_loss(model(x), y).backward()
            estimate = monitor.step(batch=(x, y) if step < 12 else None)
            seen.append(estimate)
            optimizer.step()
    monitor.close()
    # New estimates on measured steps only; B_noise from step 0 on, carried between.
    assert all(seen[i] is seen[i - 1] for i in range(1, 13) if i % 3)
    assert len({id(e) for e in seen}) == 5
    assert all(math.isfinite(e.b_simple) and math.isfinite(e.b_noise) for e in seen)
    assert "B_noise needs the step's batch" in caplog.text  # step 12: due, no batch


def test_gradient_accumulation_with_per_example():
    task = linreg.make(linreg.Options(dim=8), seed=0)
    model = task.model()
    x, y = task.sample(12, torch.Generator().manual_seed(0))
    whole = NoiseScaleMonitor(model, "per_example")
    model.zero_grad()
    task.output_loss(model(x), y).backward()
    one = whole.step()
    whole.close()
    split = NoiseScaleMonitor(model, "per_example")
    model.zero_grad()
    for xs, ys in zip(x.tensor_split(3), y.tensor_split(3), strict=True):
        (task.output_loss(model(xs), ys) / 3).backward()
        split.accumulate()
    three = split.step()
    split.close()
    assert (three.b_small, three.b_big) == (1, 12)
    assert three.sq_norm_small == pytest.approx(one.sq_norm_small, rel=1e-5)
    assert three.sq_norm_big == pytest.approx(one.sq_norm_big, rel=1e-5)


def test_train_logs_b_simple_and_b_noise(tmp_path):
    import pandas as pd

    config = Config(task=TaskConfig(name="linreg", options={"dim": 8}),
                    sweep=SweepConfig(batch_sizes=[32], learning_rates=[0.1], targets=[0.01],
                                      max_steps=30),
                    noise=NoiseConfig(hessian_every=5))
    from gnsweep.training import train

    train(config, RunSpec(batch_size=32, learning_rate=0.1), tmp_path)
    metrics = pd.read_parquet(tmp_path / "metrics.parquet")
    assert len(metrics) == 30
    assert metrics["b_simple"].notna().all() and metrics["b_noise"].notna().all()
    assert (metrics["b_small"] == 1).all() and (metrics["b_big"] == 32).all()


# -- bad input -----------------------------------------------------------------------------


def test_bad_input_gives_clear_errors():
    frozen = nn.Linear(3, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        NoiseScaleMonitor(frozen)
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="method='ddp' needs an initialised"):
        NoiseScaleMonitor(model, "ddp")
    with pytest.raises(ValueError, match="choose one of"):
        NoiseScaleMonitor(model, "vmap")
    with pytest.raises(ValueError, match="needs loss_fn"):
        NoiseScaleMonitor(model, hessian_every=5)
    one = [(torch.randn(1, 3), torch.randn(1, 1))]
    with pytest.raises(ValueError, match="cannot split a batch of one example"):
        measure_noise_scale(model, _mse, one, method="microbatch")
    batch = [(torch.randn(4, 3), torch.randn(4, 1))]
    with pytest.raises(ValueError, match="must return a scalar"):
        measure_noise_scale(model, lambda o, t: (o - t) ** 2, batch)
    monitor = NoiseScaleMonitor(model, "microbatch")
    _mse(model(torch.randn(1, 3)), torch.randn(1, 1)).backward()
    monitor.accumulate()
    with pytest.raises(ValueError, match="a batch of one example cannot be split"):
        monitor.step()
    monitor.close()


def test_public_names():
    assert gnsweep.NoiseScaleMonitor is NoiseScaleMonitor
    assert gnsweep.measure_noise_scale is measure_noise_scale


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Measure the noise scale in your own training loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    exec(compile(code.group(1), "README.md", "exec"), {"__name__": "readme"})


# -- DDP, for real: two gloo processes --------------------------------------------------------


def _ddp_worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    # A file store: no port to race for with other tests.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result: dict = {}
        with pytest.raises(ValueError, match="DistributedDataParallel-wrapped"):
            NoiseScaleMonitor(nn.Linear(2, 1), "ddp")
        with pytest.raises(ValueError, match="use method='ddp'"):
            NoiseScaleMonitor(DDP(nn.Linear(2, 1)), "per_example")
        # Ground truth at fixed parameters: b_small = per-worker batch, b_big = global batch.
        task = linreg.make(TRUTH_OPTIONS, seed=0)
        model = DDP(task.model())
        truth = task.truth(model)
        generator = torch.Generator().manual_seed(100 + rank)
        batches = (task.sample(BATCH // 2, generator) for _ in range(BATCHES))
        estimate = measure_noise_scale(model, task.output_loss, batches, method="ddp", hessian=True,
                                       hessian_microbatches=8)
        result.update(b_simple=estimate.b_simple / truth.b_simple,
                      b_noise=estimate.b_noise / truth.b_noise,
                      pair=[estimate.b_small, estimate.b_big])
        # Training: the hook must still average the gradients (DDP stops dividing by the world
        # size once a hook is registered); buckets are rebuilt after the first step.
        small = linreg.make(linreg.Options(dim=8), seed=0)
        ddp = DDP(small.model())
        reference = small.model()
        monitor = NoiseScaleMonitor(ddp, "ddp")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        # Each step's pair by hand: the mean over workers of |g_r|^2 and |mean g_r|^2. The
        # monitor folds a step's pair in one step late (summed in the next step's gradient
        # all-reduce), the last at close().
        pairs, folded = [], []
        for step in range(4):
            xs = [small.sample(16, torch.Generator().manual_seed(10 * step + r)) for r in (0, 1)]
            grads = [torch.autograd.grad(small.output_loss(reference(x), y),
                                         list(reference.parameters())) for x, y in xs]
            mine, other = grads
            pairs.append([sum(float(g.square().sum()) for g in (*mine, *other)) / 2,
                          sum(float(((a + b) / 2).square().sum())
                              for a, b in zip(mine, other, strict=True))])
            opt.zero_grad()
            small.output_loss(ddp(xs[rank][0]), xs[rank][1]).backward()
            last = monitor.step()
            if last is not None:
                folded.append([last.sq_norm_small, last.sq_norm_big])
            opt.step()
            ref_opt.zero_grad()
            x = torch.cat([xs[0][0], xs[1][0]])
            y = torch.cat([xs[0][1], xs[1][1]])
            small.output_loss(reference(x), y).backward()
            ref_opt.step()
        monitor.close()
        assert monitor.estimate is not None
        folded.append([monitor.estimate.sq_norm_small, monitor.estimate.sq_norm_big])
        result["pairs"], result["folded"] = pairs, folded
        result["same_params"] = all(
            torch.allclose(a, b, atol=1e-6)
            for a, b in zip(ddp.module.parameters(), reference.parameters(), strict=True))
        result["train_pair"] = [last.b_small, last.b_big]
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        close_process_group(clean=sys.exc_info()[0] is None)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_hook_matches_the_truth_and_keeps_training_exact(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "result.json"
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2)
    result = json.loads(out.read_text())
    assert result["pair"] == [BATCH // 2, BATCH]
    assert result["b_simple"] == pytest.approx(1, abs=0.05)
    assert result["b_noise"] == pytest.approx(1, abs=0.05)
    assert result["same_params"]
    assert result["train_pair"] == [16, 32]
    assert len(result["folded"]) == len(result["pairs"])
    for folded, pair in zip(result["folded"], result["pairs"], strict=True):
        assert folded == pytest.approx(pair, rel=1e-5)
