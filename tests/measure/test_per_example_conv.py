"""Per-example gradient norms of convolutions and sequence Linear layers against brute force
(each example's own backward), on shapes that take each of the two forms: the Gram ("ghost")
form where positions are few and channels many, the explicit per-example gradient elsewhere."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gnsweep.measure import NoiseScaleMonitor
from gnsweep.measure.per_example import (
    CONV_CHUNK,
    PATCH_BYTES,
    gram_is_cheaper,
    patches_are_cheaper,
)


class _Pool(nn.Module):
    """Mean over positions: (B, C, ...) -> (B, C)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).mean(2)


def _cases() -> dict[str, tuple[nn.Module, torch.Tensor, list[str]]]:
    """name -> (model, inputs, for each weight layer the form expected: "gram", "patches" or
    "kernel" (the explicit per-example gradient from patches and a matmul, or from the
    backend's grouped conv kernel), "explicit" (a Linear's)); "+sum" where a measured step
    also takes the conv's weight gradient as the sum of those per-example gradients (zero
    padding given as numbers)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    return {
        # Few positions (4), wide channels: 4 * (96 + 32) < 96 * 32.
        "conv1d_gram": (nn.Sequential(nn.Conv1d(32, 32, 3, padding=1), nn.Tanh(), _Pool(),
                                      nn.Linear(32, 2)),
                        torch.randn(5, 32, 4, generator=g), ["gram", "explicit"]),
        # Many positions, narrow: explicit; stride, dilation, reflect padding, groups.
        "conv1d_explicit": (nn.Sequential(
            nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=2, padding_mode="reflect",
                      groups=2), nn.Tanh(), nn.Conv1d(6, 16, 5, padding="same"), nn.Tanh(),
            nn.Conv1d(16, 4, 3, stride=2, dilation=2, groups=2), _Pool(), nn.Linear(4, 2)),
            torch.randn(5, 4, 40, generator=g),
            ["patches", "patches", "kernel+sum", "explicit"]),
        "conv2d_gram": (nn.Sequential(nn.Conv2d(24, 24, 3, padding=1), nn.Tanh(), _Pool(),
                                      nn.Linear(24, 2)),
                        torch.randn(5, 24, 2, 2, generator=g), ["gram", "explicit"]),
        "conv2d_explicit": (nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=(2, 1), dilation=(1, 2), padding=(1, 2)), nn.ReLU(),
            nn.Conv2d(8, 4, (2, 3), padding="same", padding_mode="circular", bias=False),
            nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, padding_mode="replicate", groups=4),
            nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1, groups=2), nn.ReLU(inplace=True),
            nn.Conv2d(6, 8, 1, bias=False), _Pool(), nn.Linear(8, 2)),
            torch.randn(5, 3, 9, 8, generator=g),
            ["patches+sum", "kernel", "kernel", "patches+sum", "patches+sum", "explicit"]),
        # More examples than one call of the explicit form takes: a full chunk and a partial.
        "conv1d_explicit_chunks": (nn.Sequential(
            nn.Conv1d(2, 8, 3, padding=1, padding_mode="replicate"), nn.Tanh(),
            nn.Conv1d(8, 4, 3, padding=1), _Pool(), nn.Linear(4, 2)),
            torch.randn(CONV_CHUNK + 6, 2, 12, generator=g),
            ["patches", "kernel+sum", "explicit"]),
        # More patches than PATCH_BYTES per CONV_CHUNK examples: smaller chunks.
        "conv2d_patch_chunks": (nn.Sequential(nn.Conv2d(3, 2, 3, padding=1), _Pool(),
                                              nn.Linear(2, 2)),
                                torch.randn(30, 3, 80, 80, generator=g),
                                ["patches+sum", "explicit"]),
        "sequence_linear": (nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 3),
                                          nn.Flatten(), nn.Linear(12, 2)),
                            torch.randn(6, 4, 30, generator=g), ["gram", "explicit", "explicit"]),
    }


def _expected_form(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The form `gram_is_cheaper` and, for an explicit conv, `patches_are_cheaper` pick for
    each weight layer at its shapes; whether some conv's explicit form takes several chunks
    (of CONV_CHUNK examples or PATCH_BYTES of patches)."""
    forms: list[str] = []

    def record(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            taps = module.weight[0, 0].numel()
            channels = module.in_channels // module.groups
            if gram_is_cheaper(output[0, 0].numel(), taps * channels,
                               module.out_channels // module.groups):
                forms.append("gram")
            else:
                patches = patches_are_cheaper(channels, module.groups, taps,
                                              output[0, 0].numel(), "cpu")
                summed = module.padding_mode == "zeros" and not isinstance(module.padding, str)
                forms.append(("patches" if patches else "kernel") + ("+sum" if summed else ""))
        elif isinstance(module, nn.Linear):
            positions = inputs[0][0].numel() // module.in_features
            gram = positions > 1 and gram_is_cheaper(positions, module.in_features,
                                                     module.out_features)
            forms.append("gram" if gram else "explicit")

    handles = [m.register_forward_hook(record) for m in model.modules()
               if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return forms


def _patch_chunk(model: nn.Module, x: torch.Tensor) -> int:
    """The fewest examples per chunk any conv's patches allow (PATCH_BYTES)."""
    sizes = [PATCH_BYTES // (4 * m.weight[0].numel() * m.groups * o[0, 0].numel())
             for m, o in _outputs(model, x) if isinstance(m, (nn.Conv1d, nn.Conv2d))]
    return min(sizes, default=CONV_CHUNK)


def _outputs(model: nn.Module, x: torch.Tensor) -> list[tuple[nn.Module, torch.Tensor]]:
    seen: list[tuple[nn.Module, torch.Tensor]] = []
    handles = [m.register_forward_hook(lambda m, i, o: seen.append((m, o)))
               for m in model.modules()]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("name", list(_cases()))
def test_per_example_norms_match_brute_force(name: str) -> None:
    model, x, forms = _cases()[name]
    assert _expected_form(model, x) == forms  # the case exercises the forms it is named for
    assert ("chunks" in name) == (len(x) > min(CONV_CHUNK, _patch_chunk(model, x)))
    y = torch.randn(model(x).shape, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    expected = 0.0
    for i in range(len(x)):  # each example's own loss, its own backward
        grads = torch.autograd.grad(loss(model(x[i:i + 1]), y[i:i + 1]), params)
        expected += sum(float((gr.double() ** 2).sum()) for gr in grads) / len(x)
    exact = copy.deepcopy(model).double()  # the true gradient, to float64 rounding
    loss(exact(x.double()), y.double()).backward()
    monitor = NoiseScaleMonitor(model, "per_example")
    assert not monitor.needs_microbatches  # every layer has per-example norms
    model.zero_grad()
    with _backward_kinds(model) as kinds:
        loss(model(x), y).backward()
    estimate = monitor.step()
    monitor.close()
    assert estimate is not None
    assert estimate.sq_norm_small == pytest.approx(expected, rel=1e-5)
    # The convs marked "+sum" took their weight gradient as the sum of the per-example ones:
    # the gradient to float32 rounding.
    assert kinds == ["sum" if form.endswith("+sum") else "backend"
                     for form in forms if form != "explicit" and "conv" in name]
    _assert_close_grads(model, exact)


@contextmanager
def _backward_kinds(model: nn.Module) -> Iterator[list[str]]:
    """For each conv of a forward, in order: "sum" where its output's backward is the summed
    per-example weight gradient, "backend" where it is the convolution's own."""
    kinds: list[str] = []

    def record(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        name = type(output.grad_fn).__name__
        kinds.append("sum" if name == "ConvWeightByExamplesBackward" else "backend")

    handles = [m.register_forward_hook(record) for m in model.modules()
               if isinstance(m, (nn.Conv1d, nn.Conv2d))]
    try:
        yield kinds
    finally:
        for handle in handles:
            handle.remove()


def _assert_close_grads(model: nn.Module, exact: nn.Module, rel: float = 1e-5) -> None:
    """Every parameter's gradient within `rel` (relative norm) of `exact`'s, in its own dtype
    (`exact` may be a float64 copy: the backend's own float32 bias gradient of a conv over
    many positions is off by up to 5e-4 here, the summed per-example one by 1e-7)."""
    for (name, p), q in zip(model.named_parameters(), exact.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert p.grad.dtype == p.dtype, name
            error = float((p.grad.double() - q.grad.double()).norm() / q.grad.double().norm())
            assert error < rel, (name, error)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _brute_force(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The mean over examples of `|g_i|^2` of the trained parameters, each example's own
    backward."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = 0.0
    for i in range(len(x)):
        grads = torch.autograd.grad(_mse(model(x[i:i + 1]), y[i:i + 1]), params)
        total += sum(float((gr.double() ** 2).sum()) for gr in grads)
    return total / len(x)


def _small(variant: str) -> tuple[nn.Module, torch.Tensor]:
    """A conv net whose convs take the summed per-example form, changed by `variant`."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if variant == "conv1d":
        return (nn.Sequential(nn.Conv1d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                              nn.Conv1d(8, 4, 3, padding=2, dilation=2, groups=2), _Pool(),
                              nn.Linear(4, 2)), torch.randn(5, 3, 20, generator=g))
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=variant != "no_bias"),
                          nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1, groups=2), _Pool(),
                          nn.Linear(4, 2))
    x = torch.randn(5, 3, 8, 8, generator=g)
    if variant == "frozen_bias":
        model[0].bias.requires_grad_(False)
    if variant == "frozen_weight":  # its output hook measures the bias; the backend's gradient
        model[2].weight.requires_grad_(False)
    if variant == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return model, x


@pytest.mark.parametrize("variant", ["no_bias", "frozen_bias", "frozen_weight", "channels_last",
                                     "conv1d", "input_grad", "memory_chunks"])
def test_measured_conv_gradients_and_norms(variant: str, monkeypatch) -> None:
    """Gradients of a measured step (the convs' weights as sums of per-example gradients)
    against a float64 copy, the input's gradient too; the norms against brute force. With
    `memory_chunks` the per-example gradients are held 2 examples at a time (GRADIENT_BYTES)."""
    if variant == "memory_chunks":
        from gnsweep.measure.per_example import layers

        monkeypatch.setattr(layers, "GRADIENT_BYTES", 2 * 4 * 8 * 3 * 3 * 3)
    model, x = _small(variant)
    y = torch.randn(len(x), 2, generator=torch.Generator().manual_seed(1))
    expected = _brute_force(model, x, y)
    exact = copy.deepcopy(model).double()
    x64 = x.double().requires_grad_(variant == "input_grad")
    _mse(exact(x64), y.double()).backward()
    x = x.requires_grad_(variant == "input_grad")
    monitor = NoiseScaleMonitor(model, "per_example")
    with _backward_kinds(model) as kinds:
        _mse(model(x), y).backward()
    estimate = monitor.step()
    monitor.close()
    assert kinds == ["sum", "backend" if variant == "frozen_weight" else "sum"]
    assert estimate is not None
    assert estimate.sq_norm_small == pytest.approx(expected, rel=1e-5)
    _assert_close_grads(model, exact)
    if variant == "input_grad":
        assert x.grad is not None and x64.grad is not None
        assert float((x.grad.double() - x64.grad).norm() / x64.grad.norm()) < 1e-5


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_second_derivatives_hooks_and_unmeasured_steps() -> None:
    """`backward(create_graph=True)` on a measured step: the same gradients and second
    derivatives as a float64 copy's, and the norms; hooks on the weight and on its
    accumulation fire with that gradient; a step not measured (`every=2`) keeps the
    backend's backward."""
    model, x = _small("plain")
    y = torch.randn(len(x), 2, generator=torch.Generator().manual_seed(1))
    expected = _brute_force(model, x, y)
    exact = copy.deepcopy(model).double()
    monitor = NoiseScaleMonitor(model, "per_example", every=2)
    seen: dict[str, torch.Tensor] = {}

    def keep(key: str, grad: torch.Tensor | None) -> None:
        assert grad is not None
        seen.setdefault(key, grad.detach().clone())

    model[0].weight.register_hook(lambda grad: keep("hook", grad))
    model[0].weight.register_post_accumulate_grad_hook(lambda p: keep("accumulated", p.grad))
    results = []
    for net, inputs, targets in ((model, x, y), (exact, x.double(), y.double())):
        with _backward_kinds(net) as kinds:
            _mse(net(inputs), targets).backward(create_graph=True)
        if net is model:  # before a second backward through the same graph adds its own
            estimate = monitor.step()
            assert estimate is not None
            assert estimate.sq_norm_small == pytest.approx(expected, rel=1e-5)
        params = [p for p in net.parameters() if p.grad is not None]
        curvature = sum((p.grad ** 2).sum() for p in params)  # its gradient: 2 H g
        results.append((kinds, torch.autograd.grad(curvature, params)))
    assert results[0][0] == ["sum", "sum"]
    for measured, truth in zip(results[0][1], results[1][1], strict=True):
        assert float((measured.double() - truth).norm() / truth.norm()) < 1e-5
    truth = exact[0].weight.grad.detach()
    for grad in seen.values():
        assert float((grad.double() - truth).norm() / truth.norm()) < 1e-5
    assert set(seen) == {"hook", "accumulated"}
    for p in model.parameters():
        p.grad = None
    with _backward_kinds(model) as kinds:
        _mse(model(x), y).backward()
    monitor.step()
    assert kinds == ["backend", "backend"]
    monitor.close()


def test_autocast_and_reuse_keep_the_backend_backward() -> None:
    """Under autocast (bf16) and for a conv called twice per forward the convs keep the
    backend's backward: gradients equal an unmeasured copy's exactly; the reused conv's step
    is not measured."""
    model, x = _small("plain")
    y = torch.randn(len(x), 2, generator=torch.Generator().manual_seed(1))
    plain = copy.deepcopy(model)
    monitor = NoiseScaleMonitor(model, "per_example")
    for net in (model, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16), _backward_kinds(net) as kinds:
            _mse(net(x).float(), y).backward()
    assert kinds == ["backend", "backend"]
    assert monitor.step() is not None
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
        p.grad = q.grad = None

    twice = nn.Sequential(model[0], nn.ReLU(), nn.Conv2d(8, 3, 1), model[0], _Pool(),
                          nn.Linear(8, 2))
    again = copy.deepcopy(twice)
    monitor.close()
    monitor = NoiseScaleMonitor(twice, "per_example")
    for net in (twice, again):
        _mse(net(x), y).backward()
    assert monitor.step() is None  # skipped, said once
    monitor.close()
    for p, q in zip(twice.parameters(), again.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_an_earlier_forward_hook_keeps_the_original_output() -> None:
    """A forward hook registered before the monitor may hook the conv's output gradient: that
    conv keeps the backend's backward, the hook fires with the true gradient, the norms are
    right; a conv without such a hook takes the summed form."""
    model, x = _small("plain")
    y = torch.randn(len(x), 2, generator=torch.Generator().manual_seed(1))
    expected = _brute_force(model, x, y)
    exact = copy.deepcopy(model).double()
    outputs: list[torch.Tensor] = []

    def hook_output(module: nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: outputs.append(grad.double()))

    for net in (exact, model):
        net[2].register_forward_hook(hook_output)
    _mse(exact(x.double()), y.double()).backward()
    monitor = NoiseScaleMonitor(model, "per_example")
    with _backward_kinds(model) as kinds:
        _mse(model(x), y).backward()
    estimate = monitor.step()
    monitor.close()
    assert kinds == ["sum", "backend"]
    assert len(outputs) == 2
    assert float((outputs[1] - outputs[0]).norm() / outputs[0].norm()) < 1e-5
    assert estimate is not None
    assert estimate.sq_norm_small == pytest.approx(expected, rel=1e-5)
    _assert_close_grads(model, exact)


def test_activation_checkpointing_keeps_the_backend_backward() -> None:
    """Convs inside a non-reentrant activation checkpoint keep the backend's backward (the
    recomputation must save what the forward saved): the step trains on the true gradient and,
    the layers being called again in the recomputation, is not measured (said once)."""
    model, x = _small("plain")
    y = torch.randn(len(x), 2, generator=torch.Generator().manual_seed(1))
    exact = copy.deepcopy(model).double()
    _mse(exact(x.double()), y.double()).backward()
    monitor = NoiseScaleMonitor(model, "per_example")
    with _backward_kinds(model) as kinds:
        out = checkpoint(model[:4], x, use_reentrant=False)
        _mse(model[4](out), y).backward()
    assert kinds[:2] == ["backend", "backend"]  # then the recomputation's
    assert monitor.step() is None
    monitor.close()
    _assert_close_grads(model, exact)


class _StandardisedConv(nn.Conv2d):
    """Weight standardisation (timm's StdConv2d): the conv runs on a function of its weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class _ScaledConv(nn.Conv2d):
    """An equalised learning rate (StyleGAN): the weight scaled inside the conv."""

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return super()._conv_forward(x, weight * 0.5, bias)


@pytest.mark.parametrize("layer", [_StandardisedConv, _ScaledConv])
def test_a_conv_computing_its_own_forward_is_not_measured_from_its_hooks(layer) -> None:
    # Its output is not conv(x, weight): per-example norms (and a weight gradient) from the
    # stock formula would be wrong. It is measured by its own forward instead
    # (gnsweep.measure.per_example.functional), and a measured step trains on the true gradient.
    torch.manual_seed(0)
    model = nn.Sequential(layer(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 2))
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 6, 6), torch.randint(2, (8,))
    monitor = NoiseScaleMonitor(model, "per_example")
    assert not monitor.needs_microbatches and monitor._per_example.functional == {id(model[0])}
    for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
        (nn.functional.cross_entropy(model(xs), ys) / 2).backward()
        monitor.accumulate()
    monitor.step()
    monitor.close()
    nn.functional.cross_entropy(plain(x), y).backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
