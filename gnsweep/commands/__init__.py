"""One module per verb of the `gnsweep` command: read the folder, call the pure code, write.

launch, preflight (the checks before a sweep folder is written), status, branch, plan, analyze,
recommend, plot, report, compare, check, laws. `gnsweep.cli` parses the command line and calls one
function here; messages go out through the `echo` a function is given (`typer.echo` from the
command line), and a verb that can fail returns its exit code. Nothing below this floor imports
it (`gnsweep bench`, beside it, times `analyze_sweep` and `plan`).
"""

from __future__ import annotations

from typing import Protocol


class Echo(Protocol):
    """Prints one message: on stdout, or on stderr with err=True (`typer.echo`)."""

    def __call__(self, message: str, *, err: bool = False) -> None: ...

