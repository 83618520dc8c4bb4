"""`python -m gnsweep.bench [SUBJECT ...]`: run the named benchmarks (default: all)."""

from __future__ import annotations

import importlib
import sys

from gnsweep.bench import SUBJECTS


def main(argv: list[str]) -> None:
    subjects = [a for a in argv if not a.startswith("-")] or list(SUBJECTS)
    for subject in subjects:
        if subject not in SUBJECTS:
            sys.exit(f"gnsweep bench: unknown subject {subject!r}; choose from {SUBJECTS}")
        try:
            module = importlib.import_module(f"gnsweep.bench.{subject}")
        except ModuleNotFoundError as err:
            print(f"bench {subject}: not available ({err})")
            continue
        module.main([a for a in argv if a.startswith("-")])


if __name__ == "__main__":
    main(sys.argv[1:])
