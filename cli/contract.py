"""``model-factory contract diff OLD NEW``: what a client relied on in OLD that NEW breaks."""

from __future__ import annotations

from pathlib import Path

import click

from model_factory.cli.common import user_errors


@click.group()
def contract() -> None:
    """A version's data contract (contract.json: inputs, outputs, limits, tokenizer golden ids)."""


@contract.command("diff")
@click.argument("old", type=click.Path(exists=True, path_type=Path))
@click.argument("new", type=click.Path(exists=True, path_type=Path))
@user_errors
def diff(old: Path, new: Path) -> None:
    """Compare the contracts of two versions; exit 1 when NEW breaks a client of OLD.

    OLD and NEW are version folders (REPO/MODEL/VERSION) or their contract.json. Breaking: an input or
    output gone or retyped, a new required input, a limit lowered, a bound narrowed, a golden text
    tokenized to other ids. A rebuild of the same model prints no change and exits 0.

    \b
    Examples:
      model-factory contract diff released/minilm/1 model_repository/minilm/2
    """
    from model_factory.build.data_contract import diff_contracts, load_contract

    changes = diff_contracts(load_contract(old), load_contract(new))
    for change in changes:
        click.echo(f"{'BREAKING' if change.breaking else 'change  '}  {change.what}")
    breaking = sum(c.breaking for c in changes)
    if breaking:
        raise click.exceptions.Exit(_report(f"{breaking} breaking change(s): {new} breaks clients of {old}", 1))
    click.echo("no change" if not changes else f"{len(changes)} change(s), none breaking")


def _report(message: str, code: int) -> int:
    click.echo(message, err=True)
    return code


COMMANDS = [contract]
