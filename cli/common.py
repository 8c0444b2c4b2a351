"""Shared pieces of the click layer: the one place where FactoryError becomes a clean message."""

from __future__ import annotations

import functools
import sys
import time
from typing import IO, Any, Callable

import click

from model_factory.errors import FactoryError


def debug_enabled() -> bool:
    """Whether ``model-factory --debug`` was given (then errors show their stack)."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and isinstance(root.obj, dict) and root.obj.get("debug"))


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn an error into one line (exit 1, no traceback): a FactoryError's message (problem and fix), any
    other exception's type and message with the way to see its stack. With ``--debug`` the stack is shown."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FactoryError as exc:
            if debug_enabled():
                raise
            raise click.ClickException(str(exc)) from None
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # a bug or an environment problem: one line here, the stack with --debug
            if debug_enabled():
                raise
            text = " ".join(str(exc).split())
            raise click.ClickException(f"{type(exc).__name__}: {text[:500]}. Fix: rerun as model-factory --debug "
                                       f"{click.get_current_context().info_name} ... to see where it failed, "
                                       "and report it if the cause is not yours") from None

    return wrapper


def progress_printer(stream: IO[str] | None = None) -> Callable[[str], None]:
    """A progress callback that prints one timestamped line per stage message, like a tool's output.

    ``HH:MM:SS message``: no source-file column, and never wrapped by us. On a terminal the time is
    dimmed (rich) and the terminal folds long lines; anywhere else (a pipe, a log file, CI) the lines
    are plain text, so a path in a message stays whole on its line. Multi-line messages (the accuracy
    report table) are printed as they are.
    """
    out = stream if stream is not None else sys.stderr
    console = None
    if out.isatty():
        try:
            from rich.console import Console

            console = Console(file=out, highlight=False, soft_wrap=True)
        except ImportError:  # rich is a dependency, but keep the CLI usable without it
            console = None

    def show(msg: str) -> None:
        if "\n" in msg:
            if console is not None:
                console.print(msg, markup=False, highlight=False)
            else:
                click.echo(msg, file=out)
            return
        stamp = time.strftime("%H:%M:%S")
        if console is not None:
            from rich.text import Text

            console.print(Text.assemble((stamp, "dim"), " ", msg))
        else:
            click.echo(f"{stamp} {msg}", file=out)

    return show


recipe_argument = click.argument("recipe", type=click.Path(dir_okay=False, path_type=str))
repository_option = click.option("--repository", "-r", type=click.Path(file_okay=False), default=None,
                                 help="Override repository.path of the recipe.")


def recipe_overrides(repository: str | None) -> dict[str, Any]:
    """Recipe overrides from common options."""
    from pathlib import Path

    return {"repository.path": str(Path(repository).resolve())} if repository else {}


def sandbox_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--require-sandbox`` and ``--no-sandbox``, for every command that runs a source's code (build, export,
    quantize, build-engine); :func:`sandbox_mode` turns them into the library's ``sandbox`` argument."""
    fn = click.option("--no-sandbox", is_flag=True,
                      help="Run the stages unwalled (a source you trust, a kernel that breaks it).")(fn)
    return click.option("--require-sandbox", is_flag=True,
                        help="Refuse to run where the kernel cannot wall in the stages (Landlock and seccomp).")(fn)


def sandbox_mode(require_sandbox: bool, no_sandbox: bool) -> str:
    """``"require"``, ``"off"`` or ``"auto"`` from :func:`sandbox_options`' flags; a FactoryError for both."""
    from model_factory.errors import FactoryError

    if require_sandbox and no_sandbox:
        raise FactoryError("--require-sandbox and --no-sandbox contradict each other. Fix: pass one of them")
    return "off" if no_sandbox else "require" if require_sandbox else "auto"
