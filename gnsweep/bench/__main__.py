"""`python -m gnsweep.bench [SUBJECT ...]`: run the named benchmarks (default: all)."""

from __future__ import annotations

import importlib
import sys
import traceback

from gnsweep import allocator
from gnsweep.bench import SUBJECTS

USAGE = f"""usage: python -m gnsweep.bench [SUBJECT ...] [OPTIONS]   (or: gnsweep bench ...)

Run the named benchmarks (default: all of {", ".join(SUBJECTS)}) and print ratios measured side
by side, as a table and as JSON. Options after the subjects go to each of them; see one
subject's options with: python -m gnsweep.bench SUBJECT --help"""


def main(argv: list[str]) -> None:
    # Leading bare words are subjects; everything from the first option on goes to each one.
    split = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    subjects, options = argv[:split] or list(SUBJECTS), argv[split:]
    if not argv[:split] and {"-h", "--help"} & set(options):
        print(USAGE)  # help without a subject: not every subject's help, and nothing run
        return
    unknown = [s for s in subjects if s not in SUBJECTS]
    if unknown:
        sys.exit(f"gnsweep bench: unknown subject {unknown[0]!r}; choose from {SUBJECTS}")
    # Measured as gnsweep's workers train: with their malloc settings (gnsweep.allocator).
    allocator.tune()
    failed = []
    for subject in subjects:
        try:
            module = importlib.import_module(f"gnsweep.bench.{subject}")
        except ModuleNotFoundError as err:
            print(f"bench {subject}: not available ({err})")
            continue
        try:
            module.main(options)
        except Exception:  # one subject's failure leaves the others' numbers, then fails
            traceback.print_exc()
            failed.append(subject)
            print(f"bench {subject}: FAILED (the traceback above); going on with the others",
                  flush=True)
    if failed:
        sys.exit(f"gnsweep bench: {', '.join(failed)} failed (tracebacks above)")


if __name__ == "__main__":
    main(sys.argv[1:])
