"""The ``model-factory`` command: a click group over the library.

Each command parses its options, calls one library function and prints; the
commands live in topic modules that each export ``COMMANDS``.
"""

from __future__ import annotations

import importlib

import click

from model_factory import __version__

# Topic modules; each is imported cheaply (heavy libraries load inside the commands).
_COMMAND_MODULES = (
    "model_factory.cli.factory",
    "model_factory.cli.rollout",
    "model_factory.cli.precision",
    "model_factory.cli.signing",
    "model_factory.cli.release",
    "model_factory.cli.rebuild",
    "model_factory.cli.accept",
    "model_factory.cli.wheelhouse",
    "model_factory.cli.bench",
    "model_factory.cli.recipe",
    "model_factory.cli.distribution",
    "model_factory.cli.report",
    "model_factory.cli.tensors",
    "model_factory.cli.contract",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="model-factory")
@click.option("--debug", is_flag=True, help="Show the full stack of an error (and Triton's full load errors).")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Turn a model into a signed, fast Triton deployment, offline.

    \b
    Typical use:
      model-factory build recipe.toml --key keys/signing-key.pem
      model-factory verify --policy policy.toml model_repository
      model-factory accept model_repository
      model-factory serve --policy policy.toml model_repository
    """
    ctx.ensure_object(dict)["debug"] = debug


for _name in _COMMAND_MODULES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as _exc:
        if _exc.name != _name:  # a missing dependency inside the module is a real error
            raise
        continue
    for _cmd in _module.COMMANDS:
        main.add_command(_cmd)


if __name__ == "__main__":  # pragma: no cover
    main()
