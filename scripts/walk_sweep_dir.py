"""Follow the sweep folder through a launch: the rooms it enters, its moves, its climbs.

    .venv/bin/python scripts/walk_sweep_dir.py [--detail]

launches `gnsweep launch sweep=tiny --sweep-dir TMP --workers 1 --quiet` in this process
(Typer's CliRunner, as the tests do) under `sys.setprofile`, and follows every call into a
gnsweep function that receives the sweep folder as an argument: a Path (or str) equal to the
sweep folder, a `SweepFolder`/`SweepPaths` of it, or a `RunPaths` under it. The local
executor's worker is forked, so it inherits the profiler and writes what it sees to a file of
its own, read back here.

- a *room* is a gnsweep module the folder enters; its count is how often it is entered;
- a *move* is a call from one gnsweep module into another (the caller is the nearest gnsweep
  frame above) that passes the folder as an argument (a method of the folder's own object,
  such as `folder.run(run_id)`, is asked, not passed: no move);
- a *climb* is a move to a module on a higher floor than the caller's (docs/architecture.md's
  floor table, read by tests/test_architecture_facts.py), or back into a module already on
  the call stack above the caller;
- a *return up* is a move, in the order the calls happen in one process, whose caller sits
  on a higher floor than the room the previous move entered: the walk climbs back up before
  it goes on, as a reader following the folder through the code does.

To walk another checkout (an older commit, say), run this file with that checkout first on
the path: `PYTHONPATH=OTHER .venv/bin/python scripts/walk_sweep_dir.py`; the floors are those
of the walked checkout's docs/architecture.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path, PurePath
from typing import Any


def _floor_reader(root: Path) -> tuple[Any, dict[str, int]]:
    """The walked checkout's `_floor_of` and floors table (its own test reads them)."""
    spec = importlib.util.spec_from_file_location(
        "_walk_facts", root / "tests" / "test_architecture_facts.py")
    assert spec is not None and spec.loader is not None
    facts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(facts)
    return facts._floor_of, facts._floors()


class Walk:
    """The profiler: one line an event, appended to a file a process."""

    def __init__(self, package: Path, sweep: Path, events: Path, floor_of: Any,
                 floors: dict[str, int]) -> None:
        self.prefix = str(package) + os.sep
        self.sweep = {os.path.abspath(sweep), os.path.realpath(sweep)}
        self.events = events
        self.floor_of, self.floors = floor_of, floors
        self.modules: dict[str, str | None] = {}
        self.fds: dict[int, int] = {}

    def module(self, filename: str) -> str | None:
        name = self.modules.get(filename, "")
        if name == "":
            if filename.startswith(self.prefix):
                parts = Path(filename[len(self.prefix):]).with_suffix("").parts
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                name = ".".join(("gnsweep", *parts))
            else:
                name = None
            self.modules[filename] = name
        return name

    def carries(self, value: Any) -> bool:
        """Whether `value` is the sweep folder: its path, an object of its paths, a run's."""
        if isinstance(value, PurePath):
            return os.path.abspath(value) in self.sweep
        if isinstance(value, str):
            return value.startswith(os.sep) and os.path.abspath(value) in self.sweep
        kind = type(value).__name__
        if kind in ("SweepFolder", "SweepPaths"):  # (not yet its root while it is made)
            root = getattr(value, "root", None)
            return root is not None and os.path.abspath(root) in self.sweep
        if kind == "RunPaths":
            folder = os.path.abspath(getattr(value, "folder", os.sep))
            return any(folder.startswith(s + os.sep) for s in self.sweep)
        return False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        try:
            self.follow(frame)
        except Exception as err:  # never into the walked code
            self.write(f"{os.getpid()}\terror\t{type(err).__name__}: {err}\t\t\n")

    def follow(self, frame: Any) -> None:
        code = frame.f_code
        callee = self.module(code.co_filename)
        if callee is None:
            return
        count = code.co_argcount + code.co_kwonlyargcount
        if not count:
            return
        local = frame.f_locals
        # The folder passed, not asked: a method of the folder's own object (`self`: a
        # SweepFolder asked for a path) is no move.
        if not any(self.carries(local.get(n)) for n in code.co_varnames[:count]
                   if n not in ("self", "cls")):
            return
        back = frame.f_back
        while back is not None and self.module(back.f_code.co_filename) is None:
            back = back.f_back
        caller = None if back is None else self.module(back.f_code.co_filename)
        if caller == callee:
            return
        above = set()
        up = None if back is None else back.f_back
        while up is not None:
            name = self.module(up.f_code.co_filename)
            if name is not None and name != caller:
                above.add(name)
            up = up.f_back
        mine = self.floor_of(callee, self.floors)
        theirs = None if caller is None else self.floor_of(caller, self.floors)
        why = ""
        if caller is not None:
            if callee in above:
                why = "back"
            elif mine is not None and theirs is not None and mine > theirs:
                why = "up"
        self.write(f"{os.getpid()}\t{caller}\t{callee}\t{code.co_name}\t{why}\n")

    def write(self, line: str) -> None:
        pid = os.getpid()
        fd = self.fds.get(pid)
        if fd is None:
            fd = self.fds[pid] = os.open(self.events / f"{pid}.tsv",
                                         os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, line.encode())


def walk(detail: bool) -> dict[str, Any]:
    from typer.testing import CliRunner

    import gnsweep

    package = Path(gnsweep.__file__).resolve().parent
    floor_of, floors = _floor_reader(package.parent)
    from gnsweep.cli import app

    with tempfile.TemporaryDirectory(prefix="walk-") as scratch:
        sweep, events = Path(scratch) / "tiny", Path(scratch) / "events"
        events.mkdir()
        profiler = Walk(package, sweep, events, floor_of, floors)
        threading.setprofile(profiler)
        sys.setprofile(profiler)
        try:
            result = CliRunner().invoke(app, ["launch", "sweep=tiny", "--sweep-dir", str(sweep),
                                              "--workers", "1", "--quiet"])
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
        if result.exit_code != 0:
            raise SystemExit(f"the launch failed ({result.exit_code}): {result.output[-2000:]}")
        lines = [line.split("\t") for file in sorted(events.iterdir())
                 for line in file.read_text().splitlines()]
    main = str(os.getpid())
    figures = _figures(lines, main, floor_of, floors)
    asked = _figures([line for line in lines if not _derives(line[2], line[3])], main,
                     floor_of, floors)
    moves, climbs, entries = figures["moves"], figures["climbs"], figures["entries"]
    up = sum(n for k, n in climbs.items() if k[3] == "up")
    print(f"rooms: {len(entries)}   moves: {sum(moves.values())} ({len(moves)} distinct; "
          f"launcher {figures['launcher']}, workers {figures['workers']})   "
          f"climbs: {sum(climbs.values())} (to a higher floor {up}, back into a module on "
          f"the stack {sum(climbs.values()) - up})   returns up: {figures['returns']}")
    print("entries per room: " + ", ".join(
        f"{m.removeprefix('gnsweep.')} {n}" for m, n in entries.most_common()))
    print(f"without the calls that only derive a path (paths.py): rooms "
          f"{len(asked['entries'])}, moves {sum(asked['moves'].values())} "
          f"({len(asked['moves'])} distinct), climbs {sum(asked['climbs'].values())}, "
          f"returns up {asked['returns']}")
    if detail:
        print("\nmoves (caller -> callee.function: times):")
        for (caller, callee, function), n in sorted(moves.items()):
            print(f"  {caller} -> {callee}.{function}: {n}")
        print("\nclimbs:")
        for (caller, callee, function, why), n in sorted(climbs.items()):
            print(f"  {caller} -> {callee}.{function} ({why}): {n}")
    return figures


DERIVE = {"run_dir", "sweep_of", "result_file"}
"""Path derivations an older checkout kept in store.py (they live in paths.py now)."""


def _derives(module: str, function: str) -> bool:
    """Whether a call only derives a path from the folder's root."""
    return module == "gnsweep.paths" or (module == "gnsweep.store" and function in DERIVE)


def _figures(lines: list[list[str]], main: str, floor_of: Any,
             floors: dict[str, int]) -> dict[str, Any]:
    """The rooms, moves, climbs and returns up of the walk's events, in the order they came."""
    entries: Counter[str] = Counter()
    moves: Counter[tuple[str, str, str]] = Counter()
    climbs: Counter[tuple[str, str, str, str]] = Counter()
    by_process: Counter[str] = Counter()
    returns = 0
    last: dict[str, str] = {}  # process -> the room its previous move entered
    for pid, caller, callee, function, why in lines:
        entries[callee] += 1
        if caller == "None":
            continue  # the entry: Typer calls the verb
        moves[(caller, callee, function)] += 1
        by_process["launcher" if pid == main else "workers"] += 1
        if why:
            climbs[(caller, callee, function, why)] += 1
        before = last.get(pid)
        if before is not None and caller != before \
                and (floor_of(caller, floors) or 0) > (floor_of(before, floors) or 0):
            returns += 1
        last[pid] = callee
    return {"entries": entries, "moves": moves, "climbs": climbs, "returns": returns,
            "launcher": by_process["launcher"], "workers": by_process["workers"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--detail", action="store_true",
                        help="list every move and climb, with how often")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    walk(args.detail)


if __name__ == "__main__":
    main()
