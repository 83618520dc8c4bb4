"""One fact in one place, read from the code: a target's direction, eq. 2.7, the sweep folder's
file names, the results tables' columns; and the arrows between floors that must not exist
(store -> analysis, the launch pre-flight -> training, lr_schedule -> torch)."""

from __future__ import annotations

import ast
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gnsweep import lr_law, store, tables
from gnsweep.targets import FALLING, RISING, Direction

PACKAGE = Path(__file__).resolve().parents[1] / "gnsweep"


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """Every gnsweep module a file imports, at its top or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("gnsweep")}


def test_the_direction_flag_is_named_in_few_files():
    named = [name for name, text in _sources().items() if "higher_is_better" in text]
    # targets.py (the key), config.py (maps the task's flag to a Direction once), the task
    # registry and cartpole (the declared flag of the task protocol).
    assert len(named) <= 6, named


def test_store_imports_no_analysis_module():
    assert not {m for m in _imports(PACKAGE / "store.py") if m.startswith("gnsweep.analysis")}


def test_the_launch_preflight_imports_no_training_module():
    assert not {m for m in _imports(PACKAGE / "tasks" / "launch_check.py")
                if m.startswith("gnsweep.training")}


@pytest.mark.process
def test_lr_schedule_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import gnsweep.training.lr_schedule\n"
            "assert 'gnsweep.training.loop' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("user", ["planner/pilot.py", "schedule.py", "analysis/lr.py"])
def test_eq_2_7_has_one_home(user):
    imported = _imports(PACKAGE / user)
    assert "gnsweep.lr_law.eps_opt" in imported or "gnsweep.lr_law" in imported \
        or "gnsweep.lr_law" in {m.rsplit(".", 1)[0] for m in imported}, imported
    # ... and writes no law of its own (a def named like the law, outside lr_law.py).
    tree = ast.parse((PACKAGE / user).read_text())
    assert not [n.name for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef) and n.name in ("eps_max_from",)]


def test_eq_2_7_closed_form():
    # At B = B_noise the optimal rate is half of eps_max; at B >> B_noise it tends to eps_max.
    assert lr_law.eps_opt(100.0, 0.8, 100.0) == pytest.approx(0.4)
    assert lr_law.eps_opt(1e9, 0.8, 100.0) == pytest.approx(0.8, rel=1e-6)
    assert lr_law.eps_max_from(lr_law.eps_opt(37.0, 0.5, 90.0), 37.0, 90.0) == pytest.approx(0.5)
    from gnsweep.analysis.lr import eps_opt as fitted
    from gnsweep.schedule import eps_of_batch
    assert eps_of_batch(50.0, 1.0, 150.0) == pytest.approx(0.25)
    assert fitted([50.0, 150.0], 1.0, 150.0).tolist() == pytest.approx([0.25, 0.5])


def test_sweep_folder_file_names_live_in_paths():
    names = ['"attempts.jsonl"', '"claim.json"', '".claims.lock"', '"jobs.json"', '"plan.json"',
             '"status.json"', '"metrics.parquet"', '"noise_plan.json"', '"answers.json"']
    elsewhere = {(path, name) for path, text in _sources().items() if path != "paths.py"
                 for name in names if name in text}
    assert not elsewhere
    walked = [path for path, text in _sources().items() if "parent.parent" in text
              and path.split("/")[0] in ("executors", "planner")]
    assert not walked


def test_results_columns_are_typed_once():
    from gnsweep.analysis import adaptive, along, crit_vs_simple, front, lr, pipeline, steps
    assert store.RESULT_SCHEMAS is tables.RESULT_SCHEMAS
    assert store.COMPARE_SCHEMA is tables.COMPARE_SCHEMA
    assert tables.columns("steps") == steps.STEPS_COLUMNS
    assert tables.columns("front") == front.FRONT_COLUMNS
    assert tables.columns("fits") == pipeline.ALL_FIT_COLUMNS
    assert tables.columns("lr_fits") == lr.LR_FIT_COLUMNS
    assert tables.columns("adaptive") == adaptive.ADAPTIVE_COLUMNS
    assert tables.columns("along") == along.ALONG_COLUMNS
    assert tables.columns("compare") == crit_vs_simple.COMPARE_COLUMNS


def test_the_loop_asks_the_monitor():
    for path in ("training/state.py", "training/backward.py"):
        tree = ast.parse((PACKAGE / path).read_text())
        reached = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                   and isinstance(n.value, ast.Attribute) and n.value.attr == "monitor"
                   and n.attr in ("timed", "keep", "method", "warn_once", "needs_microbatches")}
        reached |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name) and n.value.id == "monitor"
                    and n.attr in ("measuring", "needs_microbatches")}
        assert not reached, (path, reached)


def test_direction_closed_forms():
    assert FALLING.reached(0.3, 0.3) and not FALLING.reached(0.31, 0.3)
    assert RISING.reached(200.0, 200.0) and not RISING.reached(199.0, 200.0)
    assert FALLING.better(0.1, 0.2) and RISING.better(0.2, 0.1)
    assert not FALLING.better(0.2, 0.2) and not RISING.better(0.2, 0.2)
    assert FALLING.best([0.5, math.nan, 0.2]) == 0.2 and RISING.best([5.0, math.nan, 9.0]) == 9.0
    assert math.isnan(RISING.best([math.nan]))
    assert FALLING.hardest([0.5, 0.1, 0.3]) == 0.1 and RISING.hardest([100, 400, 200]) == 400
    assert FALLING.in_training_order([0.1, 0.5, 0.3]) == [0.5, 0.3, 0.1]
    assert RISING.in_training_order([400, 100, 200]) == [100, 200, 400]
    assert FALLING.as_loss(2.0) == 2.0 and RISING.as_loss(2.0) == -2.0
    # A branch point at loss 2.0 and fraction 0.9: 1.8; a return of -50 rises to -40 at 0.8.
    assert FALLING.relative_target(2.0, 0.9) == pytest.approx(1.8)
    assert RISING.relative_target(-50.0, 0.8) == pytest.approx(-40.0)
    assert Direction.of(True) is RISING and Direction.of(RISING) is RISING
    assert Direction.from_meta(RISING.to_meta()) == RISING and Direction.from_meta({}) == FALLING


def _floors() -> dict[str, int]:
    """docs/architecture.md's floors table: entry (`store.py`, `measure/`) -> floor."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = text.split("## The floors", 1)[1]
    out: dict[str, int] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for entry in re.findall(r"`([^`]+)`", cells[1]):
                out[entry] = int(cells[0])
    return out


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor_of(module: str, floors: dict[str, int]) -> int | None:
    """The floor of a gnsweep module by its most specific entry in the table."""
    rel = module.split(".")[1:]
    if not rel:
        return floors.get("__init__.py")
    for entry in ("/".join(rel) + ".py", "/".join(rel) + "/__init__.py", f"{rel[0]}/",
                  f"{rel[0]}.py"):
        if entry in floors:
            return floors[entry]
    return None


def _all_imports() -> dict[str, set[str]]:
    """module -> the gnsweep modules it imports (a name imported from a package that is a
    module of its own counts as that module)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.startswith("gnsweep"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                deps |= subs
                if node.module != "gnsweep" or not subs:
                    deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("gnsweep")}
        out[name] = deps - {name}
    return out


def test_every_module_has_a_floor_and_no_import_climbs():
    floors = _floors()
    assert floors, "docs/architecture.md has no floors table"
    imports = _all_imports()
    homeless = sorted(m for m in imports if _floor_of(m, floors) is None)
    assert not homeless, f"modules without a floor in docs/architecture.md: {homeless}"
    climbs = []
    for module, deps in imports.items():
        own = _floor_of(module, floors)
        assert own is not None
        for dep in deps:
            theirs = _floor_of(dep, floors)
            if theirs is not None and theirs > own:
                climbs.append(f"{module} (floor {own}) imports {dep} (floor {theirs})")
    assert not climbs, "\n".join(sorted(climbs))


def test_the_floor_rule_sees_a_climb():
    # The rule must be able to fail: a store that imported the analysis would climb.
    floors = _floors()
    assert _floor_of("gnsweep.store", floors) < _floor_of("gnsweep.analysis.pipeline", floors)
    assert _floor_of("gnsweep.analysis.fit", floors) < _floor_of("gnsweep.analysis", floors)


FOLDER_READERS = ("gnsweep.store", "gnsweep.runs", "gnsweep.folder", "gnsweep.executors")
"""What reads or writes a sweep folder: the analysis imports none of them."""
FILE_CALLS = {"open", "read_text", "read_bytes", "read_json", "read_table", "ParquetFile",
              "read_metrics", "iterdir", "glob", "rglob", "scandir", "listdir"}
"""Calls that open or list files."""


def _analysis_sources() -> dict[str, Path]:
    return {str(p.relative_to(PACKAGE)): p for p in sorted((PACKAGE / "analysis").rglob("*.py"))}


def test_the_analysis_reads_no_folder():
    # The folder object reads the runs and hands the analysis frames and curves.
    reach = {path: sorted(m for m in _imports(p) if m.startswith(FOLDER_READERS))
             for path, p in _analysis_sources().items()}
    assert not {path: m for path, m in reach.items() if m}
    # ... and opens no file itself, but the user's own table given by path (`--table FILE`).
    opened = {}
    for path, p in _analysis_sources().items():
        if path == "analysis/external.py":
            continue
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                 for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Call)}
        if calls & FILE_CALLS:
            opened[path] = sorted(calls & FILE_CALLS)
    assert not opened


def test_the_config_sits_on_the_bottom_floor():
    # The schemas import the errors, a target's direction and the noise methods, nothing else
    # of gnsweep (no task registry, no store): every floor may read a config.
    assert not {m for m in _imports(PACKAGE / "config.py")
                if m != "gnsweep" and m.split(".")[1] not in ("errors", "targets", "noise")}
    assert _floors()["config.py"] == 0


def test_no_module_but_the_folder_parses_the_sweep_config():
    readers = {path for path, text in _sources().items() if "read_sweep_config(" in text}
    # store defines it; the folder (`read_config`) reads it, once per open.
    assert readers <= {"store.py", "folder.py"}, readers


def _folder_names() -> tuple[set[str], set[str]]:
    """paths.py's names of the sweep folder's files: (the constants, the names on disk)."""
    from gnsweep import paths

    constants, on_disk = set(), set()
    for name, value in vars(paths).items():
        if not name.isupper():
            continue
        values = value if isinstance(value, tuple) else (value,)
        if all(isinstance(v, str) for v in values):
            constants.add(name)
            on_disk.update(values)
    return constants, on_disk


NOT_THE_FOLDER = {("compose.py", "config.yaml")}
"""Literals that name another folder's file: Hydra's conf/config.yaml."""


def _joins(tree: ast.AST, rel: str, constants: set[str], on_disk: set[str]) -> list[str]:
    """Where a module joins a file name of the sweep folder itself: `x / "status.json"`,
    `x / paths.STATUS`, `x / f"{STATUS}..."`, `x.joinpath(...)`, `os.path.join(...)`,
    `Path(x, ...)` or `x.with_name(...)` with such a name."""

    def names_in(node: ast.AST) -> set[str]:
        found = set()
        for part in ast.walk(node):
            if isinstance(part, ast.Constant) and isinstance(part.value, str) \
                    and part.value in on_disk and (rel, part.value) not in NOT_THE_FOLDER:
                found.add(repr(part.value))
            elif isinstance(part, ast.Attribute) and part.attr in constants:
                found.add(part.attr)
            elif isinstance(part, ast.Name) and part.id in constants:
                found.add(part.id)
        return found

    out = []
    for node in ast.walk(tree):
        operands: list[ast.AST] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            operands = [node.right]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            os_path = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute) \
                and func.value.attr == "path"
            if called in ("joinpath", "with_name", "Path", "PurePath") \
                    or (called == "join" and os_path):
                operands = list(node.args)
        for operand in operands:
            for name in sorted(names_in(operand)):
                out.append(f"{rel}:{node.lineno} {name}")
    return out


def test_only_the_paths_join_the_folders_file_names():
    # Every path of the sweep folder is derived in paths.py (SweepPaths, RunPaths, OutPaths)
    # from the names it holds: `x / "status.json"` or `x / paths.STATUS` anywhere else, store
    # included, is a second home for the layout.
    constants, on_disk = _folder_names()
    assert {"RUNS", "SWEEP_CONFIG", "STATUS", "METRICS", "HISTORY", "NOISE_PLAN", "ANSWERS",
            "FITS_JSON", "COMPARE", "LAWS_JSON", "QUEUE", "NOTICES"} <= constants
    assert {"status.json", "config.yaml", "runs", "answers.json", "stdout.log"} <= on_disk
    joined = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if rel != "paths.py":
            tree = ast.parse(path.read_text())
            joined += _joins(tree, rel, constants, on_disk) + _aliases(tree, rel, constants)
    assert not joined, joined


def _aliases(tree: ast.AST, rel: str, constants: set[str]) -> list[str]:
    """A second name for a file name (`FOLDER = paths.CHECKPOINTS`), which the join rule
    would no longer see in `x / FOLDER`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            value = node.value
            name = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", "")
            if name in constants:
                out.append(f"{rel}:{node.lineno} = {name}")
    return out


def test_the_join_rule_sees_a_join():
    # The rule must be able to fail: each way of joining a name is seen.
    constants, on_disk = _folder_names()
    for code in ('run / "status.json"', "run / paths.STATUS", 'run / f"{STATUS}.tmp"',
                 'run.joinpath("metrics.parquet")', 'os.path.join(run, "attempts.jsonl")',
                 'Path(root, "runs", run_id)', 'run.with_name("claim.json")'):
        assert _joins(ast.parse(code), "x.py", constants, on_disk), code
    assert not _joins(ast.parse('RunPaths(run).status; f"{STATUS} is missing"'), "x.py",
                      constants, on_disk)
    assert _aliases(ast.parse("FOLDER = store.CHECKPOINTS"), "x.py", constants)


def test_no_module_names_a_file_through_store():
    # The names live in paths.py: code (a test, a script) reading one from store
    # (store.METRICS) would keep working only while store happens to import it.
    root = PACKAGE.parent
    files = [*PACKAGE.rglob("*.py"), *(root / "tests").rglob("*.py"),
             *(root / "scripts").glob("*.py")]
    through = {f"{path.relative_to(root)}:{node.lineno} store.{node.attr}"
               for path in files
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
               and node.value.id == "store"
               and node.attr in _folder_names()[0] | {"run_dir", "sweep_of", "result_file"}}
    assert not through, sorted(through)
