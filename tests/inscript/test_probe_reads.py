"""The in-script probe's reads and rows, in the probe's own process: a step's squared norms
against float64 sums of squares, and a row's JSON against the standard library's."""

from __future__ import annotations

import json
import math

import torch

from gnsweep.inscript.probe import FLAT_MAX, FlatNorms, _json_line, _sq_sum


def _exact(grads: list[torch.Tensor]) -> float:
    return sum(float(g.double().square().sum()) for g in grads)


def test_flat_norms_are_the_sum_of_squares_whatever_the_pass_reaches() -> None:
    torch.manual_seed(0)
    params = [torch.zeros(64, 64), torch.zeros(64), torch.zeros(3, 5, 7), torch.zeros(10)]
    flat = FlatNorms.make(torch, params)
    assert flat is not None
    every = [torch.randn_like(p) for p in params]
    assert math.isclose(flat.sq_sum(params, every), _exact(every), rel_tol=1e-6)
    # A pass that reached two of the parameters, in another order, after one that reached all:
    # what the others held before must not count.
    some = [torch.randn(10) * 3, torch.randn(64, 64)]
    assert math.isclose(flat.sq_sum([params[3], params[0]], some), _exact(some), rel_tol=1e-6)
    # A gradient laid out unlike its parameter (transposed strides) is read as its values.
    odd = torch.randn(64, 64).t()
    assert math.isclose(flat.sq_sum([params[0]], [odd]), _exact([odd]), rel_tol=1e-6)
    assert math.isclose(_sq_sum(torch, every), _exact(every), rel_tol=1e-6)


def test_flat_norms_only_serve_small_fp32_cpu_models() -> None:
    assert FlatNorms.make(torch, [torch.zeros(3, dtype=torch.float64)]) is None
    assert FlatNorms.make(torch, [torch.zeros(3), torch.zeros(2, dtype=torch.float16)]) is None
    assert FlatNorms.make(torch, [torch.zeros(FLAT_MAX + 1)]) is None
    assert FlatNorms.make(torch, []) is None


def test_a_row_is_the_json_the_standard_library_writes() -> None:
    row = {"step": 12, "span": 16, "b_simple": 123.456789012345, "g2": -1e-300,
           "drift": math.nan, "b_noise": math.inf, "trace_sigma": -math.inf, "zero": 0.0}
    line = _json_line(row)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert line.decode() == json.dumps(row, allow_nan=True) + "\n"
    note = {"note": "a sentence, with \"quotes\""}
    assert json.loads(_json_line(note)) == note
