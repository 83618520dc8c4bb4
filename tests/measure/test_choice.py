"""noise.method=auto in the training loop (`timed_auto`): the cheaper of per-example norms and
micro-batches where both are right, chosen from the model's layers and its first batch, kept
in the monitor's state, and never changing the gradient trained on."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.choice import MICROBATCH_FROM, TIMED_STEPS
from gnsweep.measure.per_example.tied import WEIGHED_NUMEL
from gnsweep.training.backward import backward, pieces


class _Task:
    """The least of a task that `backward` needs: the batch-mean loss."""

    @staticmethod
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])


def _conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 3))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 8), nn.Tanh(), nn.Linear(8, 3))


class _Scaled(nn.Module):
    """A layer with a parameter per-example norms do not cover."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.inner = nn.Linear(36, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.flatten(1)) * self.scale


def _train(model: nn.Module, batch: int, steps: int, monitor: NoiseScaleMonitor | None = None
           ) -> tuple[NoiseScaleMonitor, list[torch.Tensor], list[torch.Tensor]]:
    """`steps` SGD steps of the loop's backward; each step's gradient trained on, and the
    batch-mean gradient of the same batch by one plain backward."""
    gen = torch.Generator().manual_seed(0)
    monitor = monitor or NoiseScaleMonitor(model, "auto", ema_steps=10, timed_auto=True)
    trained, plain = [], []
    for _ in range(steps):
        x = torch.randn(batch, 1, 6, 6, generator=gen)
        y = torch.randint(0, 3, (batch,), generator=gen)
        model.zero_grad()
        monitor._busy = True  # the reference pass is none of the run's: not counted
        F.cross_entropy(model(x), y).backward()
        monitor._busy = False
        with torch.no_grad():
            plain.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        model.zero_grad()
        k = pieces(monitor, 0, 4, batch)
        backward(model, _Task(), (x, y), k, monitor)
        trained.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
        monitor.step()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return monitor, trained, plain


def test_convolutions_at_a_large_batch_are_measured_with_microbatches():
    torch.manual_seed(0)
    model = _conv()
    monitor, trained, plain = _train(model, MICROBATCH_FROM, 2 + TIMED_STEPS)
    assert monitor.method == "microbatch" and monitor.choice is not None
    assert monitor.choice["method"] == "microbatch" and monitor.choice["batch"] == MICROBATCH_FROM
    assert "Conv2d" in monitor.choice["reason"]
    assert monitor.choice["step_seconds"] > 0  # timed after the choice
    assert monitor.needs_microbatches
    # The gradient trained on is the batch mean whichever method measured.
    for got, want in zip(trained, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert monitor.estimate is not None and monitor.estimate.b_small < MICROBATCH_FROM


def test_small_batches_and_models_without_positions_keep_per_example_norms():
    torch.manual_seed(0)
    small, _, _ = _train(_conv(), 16, 2)
    assert small.method == "per_example" and "16 <" in small.choice["reason"]
    mlp, _, _ = _train(_mlp(), MICROBATCH_FROM, 2)
    assert mlp.method == "per_example" and not mlp.needs_microbatches
    assert mlp.choice is not None and mlp.choice["method"] == "per_example"
    # Layers per-example norms do not cover need micro-batches anyway: the hooks only add.
    rest, trained, plain = _train(_Scaled(), 16, 2)
    assert rest.method == "microbatch" and rest._per_example is None
    torch.testing.assert_close(trained[-1], plain[-1], rtol=1e-5, atol=1e-7)


def test_the_choice_is_part_of_the_monitors_state():
    torch.manual_seed(0)
    model = _conv()
    monitor, _, _ = _train(model, MICROBATCH_FROM, 2)
    state = monitor.state_dict()
    assert state["choice"]["method"] == "microbatch" and state["timing"] is not None
    monitor.close()
    again = NoiseScaleMonitor(model, "auto", ema_steps=10, timed_auto=True)
    assert again.method == "per_example"
    again.load_state_dict(state)
    assert again.method == "microbatch" and again.choice == state["choice"]
    assert again.state_dict()["timing"] == state["timing"]
    # The per-example hooks are gone: a measured step captures nothing per example.
    _train(model, MICROBATCH_FROM, 1, again)
    assert again.method == "microbatch"


def test_a_runs_result_says_the_choice():
    from gnsweep.config import Config, SweepConfig, TaskConfig
    from gnsweep.runs import RunSpec
    from gnsweep.training import train

    config = Config(task=TaskConfig(name="linreg", options={"dim": 8}),
                    sweep=SweepConfig(batch_sizes=[16], learning_rates=[0.05], targets=[1e-9],
                                      max_steps=2 + TIMED_STEPS))
    result = train(config, RunSpec(batch_size=16, learning_rate=0.05), None)
    assert result.noise_method is not None
    assert result.noise_method["method"] == "per_example" and result.noise_method["batch"] == 16
    assert result.noise_method["step_seconds"] > 0


def test_sequence_layers_switch_by_tokens_and_convolutions_by_examples():
    from gnsweep.measure.choice import SEQUENCE_MICROBATCH_TOKENS, cheaper_method

    assert cheaper_method(["Conv2d", "Linear"], MICROBATCH_FROM, False, 12)[0] == "microbatch"
    assert cheaper_method(["Conv1D", "Linear"], MICROBATCH_FROM, False, 12)[0] == "per_example"
    # batch x positions: 256 examples of 12 tokens switch, as do 32 of 96; 31 of 96 do not.
    assert cheaper_method(["Linear"], SEQUENCE_MICROBATCH_TOKENS // 12, False, 12)[0] == \
        "microbatch"
    assert cheaper_method(["Conv1D"], SEQUENCE_MICROBATCH_TOKENS // 96, False, 96)[0] == \
        "microbatch"
    assert cheaper_method(["Embedding"], SEQUENCE_MICROBATCH_TOKENS // 96 - 1, False, 96)[0] \
        == "per_example"
    # A conv front-end under a transformer (speech): either rule switches it.
    assert cheaper_method(["Conv1d", "Linear"], 64, False, 1500)[0] == "microbatch"
    # Hooks that weigh by Adam's P: per-position layers need explicit per-example gradients
    # (micro-batches, however few tokens); layers on rows need none (per-example norms).
    assert cheaper_method(["Embedding", "Linear"], 2, False, 4, in_hooks=True)[0] == \
        "microbatch"
    assert cheaper_method([], 4096, False, 0, in_hooks=True)[0] == "per_example"
    assert cheaper_method(["Conv1d", "Linear"], 16, False, 12)[0] == "per_example"


def test_the_monitor_counts_the_tokens_of_a_sequence_model():
    # A transformer's first measured step sees its sequence length: 40 examples of 96 tokens
    # (3840 tokens) switch to micro-batches, 40 of 12 tokens (480) keep per-example norms.
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.out = nn.Linear(8, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(x))

    for length, expected in ((96, "microbatch"), (12, "per_example")):
        torch.manual_seed(0)
        model = Tokens()
        monitor = NoiseScaleMonitor(model, "auto", timed_auto=True)
        x = torch.randint(16, (40, length))
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        monitor.accumulate()
        monitor.step()
        monitor.close()
        assert monitor.method == expected, (length, monitor.choice)


def test_an_adaptive_optimizer_keeps_per_example_norms_that_weigh_by_p():
    """Under Adam the per-example hooks give the preconditioned pair themselves (every layer of
    this MLP has P-norms): auto keeps per-example norms and no measured step is split."""
    torch.manual_seed(0)
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = NoiseScaleMonitor(model, "auto", ema_steps=10, timed_auto=True,
                                optimizer=optimizer)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2 + TIMED_STEPS):
        x = torch.randn(16, 1, 6, 6, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        optimizer.zero_grad()
        assert monitor.microbatches(4, 16) == 1
        F.cross_entropy(model(x), y).backward()
        monitor.step()
        optimizer.step()
    monitor.close()
    assert monitor.choice is not None and monitor.method == "per_example"
    assert monitor.estimate is not None and monitor.estimate.b_small == 1.0
    assert monitor.preconditioned.ema.estimate().b_small == 1.0  # the hooks' P-norm pair


def test_an_adaptive_optimizer_is_measured_with_the_microbatches_it_needs_anyway():
    """A large weight tied across layers has no P-weighted per-example norms, so Adam's
    preconditioned pair splits every measured step into micro-batches; per-example hooks on
    top would only add, so auto keeps micro-batches, for B_simple too, whatever the crossovers
    say (a small model at a small batch would keep per-example norms under SGD)."""
    torch.manual_seed(0)
    model = _tied()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = NoiseScaleMonitor(model, "auto", ema_steps=10, timed_auto=True,
                                optimizer=optimizer)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2 + TIMED_STEPS):
        x = torch.randn(16, 1, 6, 6, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        optimizer.zero_grad()
        monitor._busy = True  # the reference pass is none of the run's
        F.cross_entropy(model(x), y).backward()
        monitor._busy = False
        plain = [p.grad.clone() for p in model.parameters()]
        optimizer.zero_grad()
        backward(model, _Task(), (x, y), pieces(monitor, 0, 4, 16), monitor)
        for p, want in zip(model.parameters(), plain, strict=True):
            torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-7)
        monitor.step()
        optimizer.step()
    monitor.close()
    assert monitor.choice is not None and monitor.method == "microbatch"
    assert "b_simple_precond" in monitor.choice["reason"]
    assert monitor._per_example is None  # the per-example hooks are gone
    assert monitor.estimate is not None and monitor.estimate.b_small == 4.0  # 16 / 4 pieces


def _tied() -> nn.Module:
    """An MLP whose two hidden layers share one weight (`measure.per_example.tied.Tied`) larger than
    `tied.WEIGHED_NUMEL` (no P-weighted per-example norms)."""
    width = 1 + int(WEIGHED_NUMEL ** 0.5)
    first, second = nn.Linear(width, width), nn.Linear(width, width)
    second.weight = first.weight
    return nn.Sequential(nn.Flatten(), nn.Linear(36, width), nn.Tanh(), first, nn.Tanh(), second,
                         nn.Tanh(), nn.Linear(width, 3))

def test_a_split_step_chooses_microbatches_before_any_crossover():
    from gnsweep.measure.choice import cheaper_method

    assert cheaper_method([], 8, False, 1, split=True)[0] == "microbatch"
    assert cheaper_method(["Linear"], 2, False, 12, split=True)[0] == "microbatch"
    assert cheaper_method([], 8, False, 1)[0] == "per_example"
