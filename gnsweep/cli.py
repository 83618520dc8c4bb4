"""The `gnsweep` command: a table of the verbs, each module of `gnsweep.commands` holding its
own flags (`VERBS`); parse the command line, call the one verb named, exit.

User mistakes (bad config, missing or corrupt files) end with one line on stderr and exit code 2,
never a traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from functools import wraps
from typing import Annotated, Any, TypeVar

import typer
import typer.main
from typer.core import TyperGroup
from typer.models import CommandInfo

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 2) -> typer.Exit:
    from gnsweep import redact

    typer.echo(f"gnsweep: error: {one_line(redact.text(message))}", err=True)
    return typer.Exit(code)


def one_line(message: str) -> str:
    """`message` as one line: a control character (a line break or carriage return inside a
    setting's name or a file's value that the message quotes) shown escaped, as repr shows it."""
    return "".join(ch if ch == "\t" or ch.isprintable() else repr(ch)[1:-1] for ch in message)


def user_errors(func: F) -> F:
    """Turn the errors a user can cause into one line and exit code 2: the project's own
    (bad config, missing or corrupt files) and the operating system's (a folder that cannot be
    created or written, a full disk, permission denied), which name the path and the reason."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from gnsweep.config import ConfigError
        from gnsweep.errors import LauncherSignal, os_error_message
        from gnsweep.store import StoreError

        try:
            return func(*args, **kwargs)
        except (ConfigError, StoreError) as err:
            raise fail(str(err)) from None
        except LauncherSignal as err:
            raise fail(f"stopped by signal {err.signum}; its runs went back to pending: "
                       "relaunch the same command to continue", 128 + err.signum) from None
        except KeyboardInterrupt:
            raise fail("interrupted; relaunch the same command to continue", 130) from None
        except BrokenPipeError:
            raise  # the reader went away (`| head`): main() exits quietly
        except OSError as err:
            raise fail(os_error_message(err)) from None

    return wrapper  # type: ignore[return-value]


class _App(typer.Typer):
    """Every command registered here reports user errors the same way (`user_errors`): the
    one place, so a new command cannot forget it."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:
        def decorator(func: F) -> F:
            help_text = kwargs.get("help") or reflow(func.__doc__ or "")
            super(_App, self).command(*args, **{**kwargs, "help": help_text})(user_errors(func))
            return func

        return decorator


def reflow(doc: str) -> str:
    """A docstring as help text: each paragraph's lines joined into one line, which the help
    wraps at the terminal's width (the source's line breaks would otherwise stay and cut
    sentences in two); a line starting with "Example" or "- " keeps its own line."""
    import inspect

    paragraphs = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            line = line.strip()
            if lines and not line.startswith(("Example", "- ")):
                lines[-1] += " " + line
            else:
                lines.append(line)
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}
"""A verb that passes Hydra overrides through takes arguments its signature does not name."""

VERBS: dict[str, tuple[str, str, dict[str, bool] | None]] = {
    "launch": ("launch", "command", EXTRA_ARGS),
    "plan": ("plan", "command", EXTRA_ARGS),
    "branch": ("branch", "command", EXTRA_ARGS),
    "status": ("status", "command", None),
    "analyze": ("analyze", "command", None),
    "recommend": ("recommend", "command", None),
    "baseline": ("check", "baseline_command", None),
    "check": ("check", "check_command", None),
    "plot": ("plot", "command", None),
    "report": ("report", "command", None),
    "compare": ("compare", "command", None),
    "laws": ("laws", "command", None),
}
"""The verbs: name -> (module of `gnsweep.commands`, the function holding its flags, context
settings). Each verb's flags live beside it; this table only registers them."""


def verb_info(name: str) -> CommandInfo:
    """A verb's command, its module imported now (only the verb that runs is imported: `gnsweep
    status` loads no analysis), its help reflowed and its user errors one line."""
    module, function, context = VERBS[name]
    callback = getattr(importlib.import_module(f"gnsweep.commands.{module}"), function)
    return CommandInfo(name=name, callback=user_errors(callback), context_settings=context,
                       help=reflow(callback.__doc__ or ""))


class _Verbs(TyperGroup):
    """The command group: the verbs of `VERBS`, built when named, then the commands registered
    on `app` itself."""

    def list_commands(self, ctx: Any) -> list[str]:
        return [*VERBS, *(n for n in super().list_commands(ctx) if n not in VERBS)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in VERBS and cmd_name not in self.commands:
            self.commands[cmd_name] = typer.main.get_command_from_info(
                verb_info(cmd_name), pretty_exceptions_short=app.pretty_exceptions_short,
                rich_markup_mode=app.rich_markup_mode)
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in VERBS and args[0] not in self.commands:
            for name in VERBS:  # a mistyped verb: its suggestion ("Did you mean") sees them all
                self.get_command(ctx, name)
        return super().resolve_command(ctx, args)


app = _App(
    help="Sweep batch size x learning rate, measure the gradient noise scale, and find the "
         "critical batch size (McCandlish et al. 2018).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=_Verbs,
)


@app.command()
def tasks() -> None:
    """List the built-in tasks and their options.

    Example: gnsweep tasks
    """
    from gnsweep.tasks import describe

    for name, text in describe().items():
        typer.echo(f"{name:<10} {text}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    subjects: Annotated[list[str] | None, typer.Argument(
        help="noise, analysis, executors (default: all), then options for them, e.g. "
             "--runs 100")] = None,
) -> None:
    """Run benchmarks and print ratios measured side by side (table and JSON).

    Example: gnsweep bench noise
    """
    from gnsweep.bench.__main__ import main as run_bench

    run_bench(list(subjects or []))


def main() -> None:
    from gnsweep import allocator

    # The analysis's large arrays and the workers forked from `launch` alike: temporaries on the
    # heap, not page-faulted back on every use.
    allocator.tune()
    try:
        app()
    except BrokenPipeError:
        sys.exit(1)
