"""The ``schema`` command: the recipe's JSON Schema, for editors that complete and check recipes."""

from __future__ import annotations

from pathlib import Path

import click

from model_factory.cli.common import user_errors


@click.command()
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the schema to this file (atomically) instead of printing it.")
@click.option("--prompt", is_flag=True, help="A prompt template's recipe's schema instead (docs/models.md).")
@user_errors
def schema(output: Path | None, prompt: bool) -> None:
    """Print the recipe's JSON Schema (every key, its type, default and meaning).

    \b
    Point your editor at it, e.g. a first line in the recipe for Taplo / VS Code's Even Better TOML:
      #:schema ./recipe.schema.json
    Example:
      model-factory schema -o recipe.schema.json
      model-factory schema --prompt -o prompt.schema.json
    """
    from model_factory.recipe.reference import schema_text, write_schema

    if output is None:
        click.echo(schema_text(prompt), nl=False)
    else:
        click.echo(f"wrote {write_schema(output, prompt)}")


COMMANDS = [schema]
