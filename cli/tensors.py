"""``model-factory diff``: which tensors changed between two models (trust per tensor)."""

from __future__ import annotations

from pathlib import Path

import click

from model_factory.cli.common import user_errors


@click.command("diff")
@click.argument("old", type=click.Path(exists=True, path_type=Path))
@click.argument("new", type=click.Path(exists=True, path_type=Path))
@click.option("--exit-code", is_flag=True, help="Exit 1 when any tensor differs (for scripts).")
@user_errors
def diff(old: Path, new: Path, exit_code: bool) -> None:
    """Name the tensors that differ between OLD and NEW, or say the weights are identical.

    Each side is a Hugging Face folder or .safetensors file (its tensors), an .onnx file (its
    initializers), or a version folder of a repository (the tensors its signed BOM lists: the
    source's and each built ONNX file's; without a BOM, as after model-factory sign, its .onnx
    files' initializers). Tensors are compared by name, dtype, shape and the
    SHA-256 of their bytes, so a re-saved copy reads "identical weights" and a fine-tune that
    changed one tensor names exactly that one.

    \b
    Example:
      model-factory diff base-model/ fine-tuned-model/
      model-factory diff /releases/old/model_repository/minilm/1 model_repository/minilm/2
    """
    from model_factory.signing.tensors import diff_paths

    diffs = diff_paths(old, new)
    for d in diffs:
        for line in d.lines():
            click.echo(line)
    if exit_code and not all(d.identical for d in diffs):
        raise SystemExit(1)


COMMANDS = [diff]
