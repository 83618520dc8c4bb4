"""`gnsweep status`: runs in grid order as numbers, a failed run's reason whole."""

from __future__ import annotations

from gnsweep.commands.status import info_lines
from gnsweep.runs import RunSpec
from gnsweep.status_rows import grid_order


def test_runs_sort_by_batch_size_then_learning_rate_as_numbers():
    specs = {s.run_id: s for s in (RunSpec(8, 20.0), RunSpec(8, 5.0), RunSpec(8, 10.0),
                                   RunSpec(16, 5.0), RunSpec(2, 40.0))}
    ordered = sorted(specs, key=lambda r: grid_order(r, specs))
    assert [(specs[r].batch_size, specs[r].learning_rate) for r in ordered] == \
        [(2, 40.0), (8, 5.0), (8, 10.0), (8, 20.0), (16, 5.0)]
    assert sorted(["zzz", *specs], key=lambda r: grid_order(r, specs))[-1] == "zzz"


def test_a_long_reason_is_wrapped_never_cut():
    reason = ("stdout line 90: steps go backwards (step 2 after step 85) outside a resume; " * 4)
    lines = info_lines(reason.strip())
    assert len(lines) > 1 and all(len(line) <= 94 for line in lines)
    assert " ".join(lines).split() == reason.split()
    assert info_lines("max_steps") == ["max_steps"]
