"""A noise method is compared as `gnsweep.noise.Method`, not as a bare string: a method renamed
or misspelt in one comparison would otherwise pass every test that does not reach that line.

Counted from the code with `ast`: a comparison (`==`, `!=`, `in`, `not in`) of a method's name
written as a string (alone, or in a tuple, list or set) with an expression that names a method
(its text says `method` or `requested`, as every variable holding one here does)."""

from __future__ import annotations

import ast
from pathlib import Path

from gnsweep.noise import METHOD_NAMES, Method

PACKAGE = Path(__file__).resolve().parents[1] / "gnsweep"
MOST = 10


def _names_a_method(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in METHOD_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_method(e) for e in node.elts)
    return False


def bare_comparisons(source: str) -> list[str]:
    """The comparisons of a method's bare name with a method in `source`, as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        bare = [o for o in operands if _names_a_method(o)]
        others = " ".join(ast.unparse(o) for o in operands if o not in bare)
        if bare and ("method" in others or "requested" in others):
            found.append(ast.unparse(node))
    return found


def test_the_counter_sees_bare_names_and_not_the_enum():
    code = ('a = x.method == "ddp"\nb = requested in ("auto", "fsdp")\n'
            'c = method == Method.DDP\nd = every != "auto"\ne = state["method"] != "none"\n')
    assert bare_comparisons(code) == ["x.method == 'ddp'", "requested in ('auto', 'fsdp')",
                                      "state['method'] != 'none'"]


def test_few_bare_method_names_are_compared():
    found = [f"{path.relative_to(PACKAGE)}: {c}" for path in sorted(PACKAGE.rglob("*.py"))
             for c in bare_comparisons(path.read_text())]
    assert len(found) <= MOST, "\n".join(found)


def test_the_enum_compares_equal_to_the_names_stored():
    # status.json and checkpoints hold plain strings: a comparison with the enum reads them.
    assert Method.MICROBATCH == "microbatch" and "ddp" in (Method.AUTO, Method.DDP)
    assert tuple(m.value for m in Method) == METHOD_NAMES
