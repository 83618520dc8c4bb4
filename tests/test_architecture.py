"""The package's floors, checked from outside: reporting in gnsweep/report/ writes no file, each
verb's shell is a module of gnsweep/commands/, the command line stays thin, and the results type
has one name."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gnsweep"
VERBS = ("launch", "status", "branch", "plan", "analyze", "plot", "report",
         "compare", "check", "laws", "recommend")
# Writing a file: pathlib's writers, open() for writing or appending, matplotlib's savefig, a
# DataFrame or Arrow table to disk, the store's atomic writers.
WRITES = re.compile(r"\.write_text\(|\.write_bytes\(|\bopen\([^)]*['\"][wax]b?\+?['\"]|"
                    r"\.savefig\(|\.to_parquet\(|\.to_csv\(|write_table\(|store\.write_|"
                    r"atomic_path\(")


def test_the_report_package_writes_no_file():
    modules = sorted((PACKAGE / "report").glob("*.py"))
    assert {p.stem for p in modules} >= {"views", "answers", "console", "figures",
                                         "compare_figures", "html"}
    writers = [f"{p.name}:{n}: {line.strip()}" for p in modules
               for n, line in enumerate(p.read_text().splitlines(), 1) if WRITES.search(line)]
    assert writers == []
    upward = [p.name for p in modules
              if re.search(r"(from|import) gnsweep\.commands\b", p.read_text())]
    assert upward == []


def test_the_old_reporting_modules_are_gone_from_the_package_top():
    for name in ("plots", "figures", "compare_plots", "comparison", "html_report"):
        assert not (PACKAGE / f"{name}.py").exists(), name
    for name in ("report", "console", "views"):
        assert not (PACKAGE / "analysis" / f"{name}.py").exists(), name


def test_one_module_per_verb_and_a_thin_command_line():
    assert {p.stem for p in (PACKAGE / "commands").glob("*.py")} >= set(VERBS)
    # Each verb's flags live in its own module; cli.py is the table that registers them.
    assert len((PACKAGE / "cli.py").read_text().splitlines()) <= 400
    from gnsweep.cli import VERBS as TABLE
    for name, (module, function, _) in TABLE.items():
        assert f"def {function}(" in (PACKAGE / "commands" / f"{module}.py").read_text(), name


def test_no_verb_imports_another():
    # What two verbs share (an analysed folder, a figure written, the pre-flight) sits on the
    # floor below them; a verb may import the package (its `Echo`), never another verb.
    climbs = []
    for path in sorted((PACKAGE / "commands").glob("*.py")):
        for other in re.findall(r"(?:from|import) gnsweep\.commands\.(\w+)", path.read_text()):
            if other != path.stem:
                climbs.append(f"{path.stem} imports {other}")
    assert climbs == []


def test_nothing_below_the_commands_imports_them():
    # The command line and the benchmarks (`gnsweep bench`, a verb's tool) sit beside them.
    above = {PACKAGE / "cli.py", PACKAGE / "__main__.py"}
    importers = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p not in above and "commands" not in p.parts and "bench" not in p.parts
                 and re.search(r"(from|import) gnsweep\.commands\b|from gnsweep import commands",
                               p.read_text())]
    assert importers == []


def test_the_results_type_has_one_name():
    aliases = [f"{p.relative_to(PACKAGE)}: {line.strip()}" for p in PACKAGE.rglob("*.py")
               for line in p.read_text().splitlines()
               if re.match(r"\s*(Analysis|SweepTables)\s*=", line)]
    assert aliases == []
