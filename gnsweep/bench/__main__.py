"""`python -m gnsweep.bench [SUBJECT ...]`: run the named benchmarks (default: all)."""

from __future__ import annotations

import importlib
import sys

from gnsweep.bench import SUBJECTS


def main(argv: list[str]) -> None:
    # Leading bare words are subjects; everything from the first option on goes to each one.
    split = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    subjects, options = argv[:split] or list(SUBJECTS), argv[split:]
    for subject in subjects:
        if subject not in SUBJECTS:
            sys.exit(f"gnsweep bench: unknown subject {subject!r}; choose from {SUBJECTS}")
        try:
            module = importlib.import_module(f"gnsweep.bench.{subject}")
        except ModuleNotFoundError as err:
            print(f"bench {subject}: not available ({err})")
            continue
        module.main(options)


if __name__ == "__main__":
    main(sys.argv[1:])
