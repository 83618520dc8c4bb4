"""B_simple_P = tr(P Sigma) / (G^T P G): the noise scale in the optimizer's preconditioner."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.preconditioner import preconditioner
from gnsweep.tasks.linreg import LinReg, Options


def _train(monitor: NoiseScaleMonitor, model: nn.Module, optimizer: torch.optim.Optimizer,
           task: LinReg, steps: int, batch: int, k: int, *, update: bool = True,
           seed: int = 0) -> None:
    """Steps of the training loop's shape: k micro-batches with accumulate() after each."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x, y = task.sample(batch, gen)
        for xs, ys in zip(x.chunk(k), y.chunk(k), strict=True):
            (task.loss(model, (xs, ys)) * (len(xs) / batch)).backward()
            monitor.accumulate()
        monitor.step()
        if update:
            optimizer.step()


@pytest.mark.parametrize("method,k,every", [("per_example", 1, 1), ("microbatch", 4, 1),
                                           ("per_example", 1, 3), ("microbatch", 4, 3)])
def test_sgd_precond_equals_b_simple(method: str, k: int, every: int) -> None:
    """SGD and momentum: P = I, so b_simple_precond is b_simple exactly from the second
    measurement on (after one, it is not determined: NaN), whatever steps are measured (a
    measurement weighs the steps it stands for in both windows: the first of every=3 stands for
    one step, the next ones for three)."""
    task = LinReg(Options(dim=16), seed=0)
    model = task.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = NoiseScaleMonitor(model, method, ema_fraction=0.2, optimizer=optimizer,
                                every=every)
    assert not monitor.wants_microbatches
    gen = torch.Generator().manual_seed(1)
    for step in range(30):
        optimizer.zero_grad(set_to_none=True)
        x, y = task.sample(32, gen)
        for xs, ys in zip(x.chunk(k), y.chunk(k), strict=True):
            (task.loss(model, (xs, ys)) * (len(xs) / 32)).backward()
            monitor.accumulate()
        estimate = monitor.step()
        assert estimate is not None and math.isfinite(estimate.b_simple)
        if step < every:  # one measurement so far
            assert math.isnan(estimate.b_simple_precond)
        else:
            assert estimate.b_simple_precond == estimate.b_simple
        optimizer.step()


def test_adam_precond_matches_closed_form_on_linreg() -> None:
    """Adam's P frozen (no update while measuring): pooled over many batches at fixed
    parameters, B_simple_P matches tr(P Sigma) / (G^T P G) in closed form, while B_simple
    matches its own, different, closed form."""
    task = LinReg(Options(dim=16, condition=100.0), seed=0)
    model = task.model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    warm = NoiseScaleMonitor(model, "per_example", ema_fraction=0.2, optimizer=optimizer)
    assert not warm.wants_microbatches  # the per-example hooks weigh by P themselves
    _train(warm, model, optimizer, task, steps=20, batch=32, k=1)
    warm.close()
    p = preconditioner(optimizer, list(model.parameters()))
    assert p is not None and p.shape == (17,)
    gpg, trace_p = task.precond_truth(model, p)
    truth = task.truth(model)
    monitor = NoiseScaleMonitor(model, "microbatch", ema_examples=math.inf, optimizer=optimizer)
    _train(monitor, model, optimizer, task, steps=600, batch=64, k=4, update=False, seed=7)
    estimate = monitor.estimate
    assert estimate is not None
    exact_p, exact = trace_p / gpg, truth.b_simple
    assert abs(exact_p / exact - 1) > 0.3  # the two differ: the test tells them apart
    assert estimate.b_simple_precond == pytest.approx(exact_p, rel=0.1)
    assert estimate.b_simple == pytest.approx(exact, rel=0.1)
    # The per-example hooks' P-norms (b_small = 1, no split) pool to the same closed form.
    hooks = NoiseScaleMonitor(model, "per_example", ema_examples=math.inf, optimizer=optimizer)
    _train(hooks, model, optimizer, task, steps=300, batch=64, k=1, update=False, seed=8)
    estimate = hooks.estimate
    assert estimate is not None and estimate.b_small == 1.0
    assert estimate.b_simple_precond == pytest.approx(exact_p, rel=0.1)


def test_adam_precond_with_per_example_norms_and_unknown_optimizer() -> None:
    """Per-example B_simple with the P pair from the loop's micro-batches: finite, positive,
    not B_simple; an optimizer without a known diagonal P leaves the column NaN."""
    task = LinReg(Options(dim=16, condition=100.0), seed=0)
    model = task.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    monitor = NoiseScaleMonitor(model, "per_example", ema_fraction=0.2, optimizer=optimizer)
    _train(monitor, model, optimizer, task, steps=40, batch=32, k=4)
    estimate = monitor.estimate
    assert estimate is not None
    assert estimate.b_simple_precond > 0 and math.isfinite(estimate.b_simple_precond)
    assert estimate.b_simple_precond != pytest.approx(estimate.b_simple, rel=0.05)
    # A checkpoint carries B_simple_P's EMAs.
    again = NoiseScaleMonitor(model, "per_example", ema_fraction=0.2, optimizer=optimizer)
    again.load_state_dict(monitor.state_dict())
    assert again.preconditioned.ema.estimate().b_simple == estimate.b_simple_precond

    model = task.model()
    lbfgs = torch.optim.Rprop(model.parameters(), lr=0.01)
    other = NoiseScaleMonitor(model, "per_example", ema_fraction=0.2, optimizer=lbfgs)
    assert not other.wants_microbatches
    _train(other, model, lbfgs, task, steps=5, batch=32, k=1)
    assert other.estimate is not None and math.isnan(other.estimate.b_simple_precond)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
])
def test_preconditioner_is_the_optimizers_step(make) -> None:
    """P g is the optimizer's own step direction: with no momentum (RMSprop, Adagrad) or right
    after one Adam step from a state, the update equals -lr P g (checked on one parameter)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5))
    optimizer = make([w])
    for _ in range(3):  # a state to read
        optimizer.zero_grad()
        (w ** 2).sum().backward()
        optimizer.step()
    optimizer.zero_grad()
    (w ** 2).sum().backward()
    if isinstance(optimizer, torch.optim.Adam):
        return  # momentum mixes past gradients in: P alone is checked by the closed form above
    # P as read before the update; the optimizer's state then takes in this gradient, so
    # recompute P from the state after the update (the step used the updated state).
    before = w.detach().clone()
    optimizer.step()
    p = preconditioner(optimizer, [w])
    assert p is not None
    assert torch.allclose(w.detach() - before, -optimizer.param_groups[0]["lr"] * p * w.grad,
                          rtol=1e-4, atol=1e-7)


def test_a_tiny_lm_trained_with_adamw_logs_b_simple_precond() -> None:
    """The training loop on a small character-level transformer with AdamW: after step 50
    b_simple_precond is finite and positive on at least 90% of rows, and not b_simple."""
    from gnsweep.config import Config, NoiseConfig, SweepConfig, TaskConfig, TrainConfig
    from gnsweep.runs import RunSpec
    from gnsweep.training import build_run, run

    torch.set_num_threads(1)
    config = Config(task=TaskConfig(name="chars", options={"context": 16, "width": 32,
                                                           "depth": 1, "heads": 2,
                                                           "eval_windows": 0}),
                    sweep=SweepConfig(batch_sizes=[16], learning_rates=[0.01],
                                      targets=[1e-9], max_steps=90),
                    train=TrainConfig(optimizer="adamw", weight_decay=0.1),
                    # Micro-batches: B_simple beside it (per-example norms skip the position
                    # embedding, looked up once for the batch); both pairs from one split.
                    noise=NoiseConfig(method="microbatch", every=1))
    state = build_run(config, RunSpec(batch_size=16, learning_rate=0.01))
    run(state)
    rows = [(s, b, p) for s, b, p in zip(state.rows["step"], state.rows["b_simple"],
                                         state.rows["b_simple_precond"], strict=True) if s > 50]
    assert len(rows) >= 30
    good = [p for _, _, p in rows if math.isfinite(p) and p > 0]
    assert len(good) >= 0.9 * len(rows)
    assert all(math.isfinite(b) for _, b, _ in rows)
    assert sum(b != p for _, b, p in rows) >= 0.9 * len(rows)


def _ddp_adam_worker(rank: int, world: int, store: str, out: str, wrapper: bool) -> None:
    """Two DDP workers trained with AdamW beside a single-process replica trained on both
    halves: each step's P-norm pair the monitor folds into B_simple_P's EMAs must be the one
    computed by hand, the mean over workers of |g_r|_P^2 and |mean_r g_r|_P^2 with P read from
    the replica's AdamW before its update (the same state: DDP's gradients are the mean).
    `wrapper`: the gradients are all-reduced behind the monitor's back, as a framework's DDP
    does (the monitor reads each worker's from parameter hooks); else gnsweep's DDP hook."""
    import json
    import sys
    from pathlib import Path

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gnsweep.distributed import close_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        task = LinReg(Options(dim=8, condition=30.0), seed=0)
        ddp, replica = (task.model() if wrapper else DDP(task.model())), task.model()
        params = list(replica.parameters())
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.02, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)
        monitor = NoiseScaleMonitor(ddp, "ddp", optimizer=opt, all_reduced_grads=wrapper)
        assert not monitor.wants_microbatches
        folded: list[list[float]] = []
        fold = monitor._fold_preconditioned

        def record(precond):  # the pairs the DDP path hands to B_simple_P's EMAs
            folded.extend([*pair] for pair in precond or [])
            fold(precond)

        monitor._fold_preconditioned = record  # type: ignore[method-assign]
        by_hand = []
        for step in range(8):
            halves = [task.sample(16, torch.Generator().manual_seed(10 * step + r))
                      for r in range(world)]
            grads = [torch.autograd.grad(task.loss(replica, half), params) for half in halves]
            weight = preconditioner(ref_opt, params)
            if weight is not None:  # none before the first update
                flat = [torch.cat([g.reshape(-1) for g in gs]) for gs in grads]
                mean = sum(flat) / world
                by_hand.append([sum(float(torch.dot(weight, g * g)) for g in flat) / world,
                                float(torch.dot(weight, mean * mean)), 16.0, 32.0])
            opt.zero_grad()
            task.loss(ddp, halves[rank]).backward()
            if wrapper:  # the framework's all-reduce of .grad
                for p in ddp.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            monitor.step()
            opt.step()
            ref_opt.zero_grad()
            for gs in grads:
                for p, g in zip(params, gs, strict=True):
                    p.grad = g / world if p.grad is None else p.grad + g / world
            ref_opt.step()
        monitor.close()
        assert monitor.estimate is not None
        if rank == 0:
            Path(out).write_text(json.dumps({
                "folded": folded, "by_hand": by_hand,
                "b_simple_precond": monitor.estimate.b_simple_precond,
                "b_simple": monitor.estimate.b_simple,
                "same_params": all(torch.allclose(a, b, atol=1e-6) for a, b in zip(
                    ddp.parameters(), params, strict=True))}))
    finally:
        close_process_group(clean=sys.exc_info()[0] is None)


@pytest.mark.distributed
@pytest.mark.parametrize("wrapper", [False, True], ids=["ddp_hook", "framework_ddp"])
def test_adam_precond_under_ddp_folds_each_workers_p_norms(tmp_path, wrapper) -> None:
    import json

    import torch.multiprocessing as mp

    out = tmp_path / "result.json"
    mp.spawn(_ddp_adam_worker, args=(2, str(tmp_path / "store"), str(out), wrapper), nprocs=2)
    result = json.loads(out.read_text())
    assert result["same_params"]
    # Step 0 has no P yet; steps 1-7 each fold their pair (through the DDP hook one step late,
    # the last at close).
    assert len(result["by_hand"]) == 7 and len(result["folded"]) == 7
    for folded, by_hand in zip(result["folded"], result["by_hand"], strict=True):
        assert folded == pytest.approx(by_hand, rel=1e-5)
    b_p, b = result["b_simple_precond"], result["b_simple"]
    assert math.isfinite(b_p) and b_p > 0 and abs(b_p / b - 1) > 0.05  # P reweights: not B


def test_a_ddp_pack_saved_before_p_norms_rode_along_still_resumes() -> None:
    """A checkpoint holds the last DDP measurement's pack, summed over 2 workers, until the
    resumed run folds it in; one written before the P-norms were appended (9 numbers) gives its
    B_simple pair and no B_simple_P pair, one written after (12) gives both."""
    from gnsweep.measure.ddp import DdpHook
    from gnsweep.noise import NormPair

    hook = DdpHook.__new__(DdpHook)  # the pack's arithmetic only: no process group needed
    hook.world, hook.carried, hook.outgoing, hook.pending = 2, None, None, None
    old = [2 * 5.0, 2 * 3.0, 2 * 16.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    hook.load_pending(old, torch.device("cpu"))
    assert hook.collect() == ([NormPair(5.0, 3.0, 16.0, 32.0)], None, None)
    hook.load_pending([*old, 2 * 7.0, 2 * 4.0, 2.0], torch.device("cpu"))
    assert hook.collect() == ([NormPair(5.0, 3.0, 16.0, 32.0)], None,
                              [NormPair(7.0, 4.0, 16.0, 32.0)])
