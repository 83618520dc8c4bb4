"""`make paper`: every built-in family's default sweep, analysed, then `gnsweep compare`.

    python scripts/paper.py [--paper-dir runs/paper] [--tasks digits linreg ...]
                            [--sweep NAME] [--workers N] [--set KEY=VALUE ...] [--dry-run]

For each task that `gnsweep tasks` lists and that has a default sweep (conf/sweep/<task>.yaml):
`gnsweep launch task=<task> sweep=<task> --sweep-dir $PAPER_DIR/<task>`, then
`gnsweep analyze $PAPER_DIR/<task>`; then `gnsweep compare` over every analysed sweep into
$PAPER_DIR/compare/. Resumable: a relaunch trains only the runs that are missing (that is what
`gnsweep launch` does on an existing folder) and re-analyses only a sweep whose runs changed
since its fits.parquet. `--sweep` and `--set` replace the default sweep and add overrides for
every task (tests use them to make the sweeps tiny); a changed setting on an existing folder is
refused by `gnsweep launch`, so use a fresh --paper-dir.

Each invocation appends its wall times (per task and in all) to $PAPER_DIR/timings.json, so
the first, complete run's time stays there for the README. Exit status: 0 when
every task was compared, 1 when one could not be (its line says why), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from gnsweep import store, tasks
from gnsweep.compose import conf_dir
from gnsweep.paths import METRICS, STATUS, SweepPaths


def gnsweep(*args: str) -> subprocess.CompletedProcess:
    """One `gnsweep` command in a child process (as a user would type it), output shown."""
    print("$ gnsweep " + " ".join(args), flush=True)
    return subprocess.run([sys.executable, "-m", "gnsweep", *args], check=False)


def analysed_since(sweep_dir: Path) -> bool:
    """Whether fits.parquet is newer than every run's status and metrics."""
    folder = SweepPaths(sweep_dir)
    fits = folder.result("fits")
    if not fits.is_file():
        return False
    newest = max((p.stat().st_mtime for p in folder.runs_dir.glob("*/*")
                  if p.name in (STATUS, METRICS)), default=0.0)
    return fits.stat().st_mtime > newest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paper-dir", type=Path, default=Path("runs/paper"))
    parser.add_argument("--tasks", nargs="+", default=None,
                        help="tasks to run (default: every one `gnsweep tasks` lists)")
    parser.add_argument("--sweep", default=None,
                        help="sweep for every task (default: the task's own, sweep=<task>)")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--dry-run", action="store_true",
                        help="print which task runs which sweep, and exit")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="a Hydra override for every launch")
    args = parser.parse_args(argv)

    known = tasks.task_names()
    chosen = args.tasks or known
    unknown = [t for t in chosen if t not in known]
    if unknown:
        print(f"paper: error: task {unknown[0]} is not one of {', '.join(known)}",
              file=sys.stderr)
        return 2
    paper = args.paper_dir
    began = time.perf_counter()
    timings: dict[str, dict[str, float | str]] = {}
    analysed: list[Path] = []
    problems: list[str] = []
    for task in chosen:
        sweep = args.sweep or task
        if not (conf_dir() / "sweep" / f"{sweep}.yaml").is_file():
            problems.append(f"{task}: no default sweep (conf/sweep/{sweep}.yaml); skipped")
            continue
        folder = paper / task
        if args.dry_run:
            print(f"{task}: sweep={sweep} -> {folder}")
            continue
        start = time.perf_counter()
        launch = ["launch", f"task={task}", f"sweep={sweep}", *args.overrides,
                  "--sweep-dir", str(folder), "--quiet"]
        if args.workers:
            launch += ["--workers", str(args.workers)]
        code = gnsweep(*launch).returncode
        launched = time.perf_counter()
        if code not in (0, 1):  # 1: some runs failed; the others still make an analysis
            problems.append(f"{task}: gnsweep launch exited {code}; skipped")
            continue
        if code == 1:
            problems.append(f"{task}: some runs failed (gnsweep status {folder})")
        if not analysed_since(folder) and gnsweep("analyze", str(folder)).returncode != 0:
            problems.append(f"{task}: gnsweep analyze failed; left out of the comparison")
            continue
        analysed.append(folder)
        timings[task] = {"launch_s": round(launched - start, 1),
                         "analyze_s": round(time.perf_counter() - launched, 1),
                         "sweep_dir": str(folder)}
    if args.dry_run:
        for line in problems:
            print(line)
        return 0
    if analysed and gnsweep("compare", *map(str, analysed), "--out",
                            str(paper / "compare")).returncode != 0:
        problems.append("gnsweep compare failed")
    if timings:
        log = paper / "timings.json"
        history = store.read_json(log) if log.is_file() else []
        history.append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "tasks": timings,
                        "total_s": round(time.perf_counter() - began, 1)})
        store.write_json(log, history)
    for line in problems:
        print(f"paper: {line}", file=sys.stderr)
    if not analysed:
        print("paper: no sweep could be analysed; nothing to compare", file=sys.stderr)
    return 1 if problems or not analysed else 0


if __name__ == "__main__":
    sys.exit(main())
