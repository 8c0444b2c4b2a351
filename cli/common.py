"""Shared pieces of the click layer: the one place where FactoryError becomes a clean message."""

from __future__ import annotations

import functools
from typing import Any, Callable

import click

from model_factory.errors import FactoryError


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a FactoryError into a click error (message, exit 1, no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FactoryError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


def progress_printer() -> Callable[[str], None]:
    """A progress callback that prints timestamped stage messages (rich when available)."""
    try:
        from rich.console import Console

        console = Console(stderr=True, highlight=False)
        def show(msg: str) -> None:
            # markup=False: stage tags like [export] are text, not rich markup. Tables (the
            # accuracy report) print unwrapped, without the log column squeezing them.
            if "\n" in msg:
                console.print(msg, markup=False, highlight=False, soft_wrap=True)
            else:
                console.log(msg, markup=False)

        return show
    except ImportError:  # rich is a dependency, but keep the CLI usable without it
        return lambda msg: click.echo(msg, err=True)


recipe_argument = click.argument("recipe", type=click.Path(dir_okay=False, path_type=str))
repository_option = click.option("--repository", "-r", type=click.Path(file_okay=False), default=None,
                                 help="Override repository.path of the recipe.")


def recipe_overrides(repository: str | None) -> dict[str, Any]:
    """Recipe overrides from common options."""
    from pathlib import Path

    return {"repository.path": str(Path(repository).resolve())} if repository else {}
