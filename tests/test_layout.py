"""The tests mirror the package (docs/architecture.md, "Where a new test goes"): each test folder
is a package of gnsweep/ (or the stories, or the helpers), each has an `__init__.py` so that two
folders may hold files of the same name, the helpers hold no test, and a top-level test file is
named after a top-level module of gnsweep/ or tests the package as a whole."""

from __future__ import annotations

from locations import ROOT

TESTS = ROOT / "tests"
PACKAGE = ROOT / "gnsweep"
OWN_FOLDERS = {"stories", "helpers", "baseline"}
"""Folders of tests/ that mirror no package: the end-to-end stories, the modules the tests start,
the committed fit baseline."""
WHOLE_PACKAGE = {"test_architecture.py", "test_architecture_facts.py", "test_packaging.py",
                 "test_layout.py"}
"""Top-level test files about gnsweep as a whole rather than one module."""


def _folders() -> list:
    return sorted(p for p in TESTS.rglob("*") if p.is_dir() and p.name != "__pycache__"
                  and not p.name.startswith("."))


def test_each_test_folder_mirrors_a_package_of_gnsweep():
    strays = []
    for folder in _folders():
        relative = folder.relative_to(TESTS)
        if relative.parts[0] in OWN_FOLDERS:
            continue
        if not (PACKAGE / relative / "__init__.py").is_file():
            strays.append(str(relative))
    assert not strays, (f"tests/ folders with no package of the same path in gnsweep/: {strays}; "
                        "a unit test goes in tests/<package>/, an end-to-end one in tests/stories/")


def test_each_folder_of_tests_is_a_package():
    missing = [str(f.relative_to(TESTS)) for f in [TESTS, *_folders()]
               if any(f.glob("test_*.py")) and not (f / "__init__.py").is_file()]
    assert not missing, f"test folders without __init__.py: {missing}"


def test_helpers_hold_no_tests_and_tests_hold_no_helpers():
    assert not list((TESTS / "helpers").rglob("test_*.py"))
    loose = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py")
             if p.parent.name != "helpers" and not p.name.startswith("test_")
             and p.name not in {"__init__.py", "conftest.py"}]
    assert not loose, f"modules that are not tests outside tests/helpers/: {loose}"


def test_each_top_level_test_file_is_named_after_a_top_level_module():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    named = {f"test_{m}" for m in modules}
    strays = [p.name for p in sorted(TESTS.glob("test_*.py")) if p.name not in WHOLE_PACKAGE
              and not any(p.stem == n or p.stem.startswith(f"{n}_") for n in named)]
    assert not strays, (f"top-level test files named after no module of gnsweep/: {strays}; "
                        "move each to tests/<package>/ or tests/stories/")
