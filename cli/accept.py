"""The ``accept`` command: replay each model's golden inputs through the engine it would be served with here."""

from __future__ import annotations

import json
from pathlib import Path

import click

from model_factory.cli.common import user_errors


@click.command()
@click.argument("repository", type=click.Path(file_okay=False, path_type=Path))
@click.option("--model", help="Accept only this model (default: every model in REPOSITORY).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record per model.")
@click.option("--gpu-product", metavar="LABEL",
              help="As serve --gpu-product: only TensorRT plans built on this GPU product count.")
@click.option("--int8-kernels", type=click.Choice(["auto", "integer", "integer-7bit", "simulated"]), default=None,
              help="As serve --int8-kernels: INT8 on the CPU with ONNX Runtime's integer kernels or Q/DQ in float.")
@click.pass_context
@user_errors
def accept(ctx: click.Context, repository: Path, model: str | None, as_json: bool, gpu_product: str | None,
           int8_kernels: str | None) -> None:
    """Check that each model's engine computes the right answer on this machine.

    Loads exactly the engine the backend would serve here (same loader, same choice:
    TensorRT plan, ONNX Runtime CUDA, torch or ONNX Runtime CPU), runs the version's
    acceptance inputs (held-out data written by package) through it and scores the
    outputs against the FP32 references with the task's metric. Prints a table with
    the engine and device of each model; exit status 1 when any model is below its gate.

    \b
    Examples:
      model-factory accept model_repository
      model-factory accept --model minilm --json model_repository > accept.json
    """
    from model_factory.serving.acceptance import accept_repository, render

    results = accept_repository(repository, model, gpu_product=gpu_product or None,
                                int8_kernels=int8_kernels)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        click.echo(render(results))
    if not all(r.passed for r in results):
        ctx.exit(1)


COMMANDS = [accept]
