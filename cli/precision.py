"""Commands for reduced precision and engines: ``quantize`` and ``build-engine``.

Each command parses its options, calls one library function and prints; a
FactoryError (an accuracy gate that fails included) becomes a clean message
and exit status 1.
"""

from __future__ import annotations

import click

from model_factory.cli.common import (progress_printer, recipe_argument, recipe_overrides, repository_option,
                                      sandbox_mode, sandbox_options, user_errors)


@click.command()
@recipe_argument
@repository_option
@click.option("--min-accuracy", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Override quantization.min_accuracy (the task's gate vs FP32: docs/models.md, Hugging Face tasks).")
@sandbox_options
@user_errors
def quantize(recipe: str, repository: str | None, min_accuracy: float | None, require_sandbox: bool,
             no_sandbox: bool) -> None:
    """Make the recipe's FP16/INT8 models from its ONNX export and score them against FP32.

    Reads the export in the recipe's work folder (run `model-factory export`
    first), calibrates INT8 on quantization.calibration_data, scores every
    precision on held-out data and writes accuracy.json beside the models.
    A precision below --min-accuracy fails the command with the report.
    It runs walled in as build's quantize stage is (--no-sandbox: unwalled).

    \b
    Example:
      model-factory export examples/minilm.toml
      model-factory quantize examples/minilm.toml --min-accuracy 0.99
    """
    from model_factory.build.pipeline import run_stage
    from model_factory.build_engines.quantize import quantize_existing
    from model_factory.recipe import load_recipe

    spec = load_recipe(recipe, recipe_overrides(repository))
    res = run_stage(spec, "quantize", quantize_existing, spec, min_accuracy=min_accuracy, progress=progress_printer(),
                    sandbox=sandbox_mode(require_sandbox, no_sandbox))
    click.echo(res.report.render())
    for precision, path in res.models.items():
        click.echo(f"{precision}: {path}")
    click.echo(f"report: {res.report_path}")


@click.command("build-engine")
@recipe_argument
@repository_option
@sandbox_options
@user_errors
def build_engine(recipe: str, repository: str | None, require_sandbox: bool, no_sandbox: bool) -> None:
    """Compile TensorRT plans (one per precision) from the recipe's ONNX models.

    Uses tensorrt when installed, else TensorRT-RTX, which compiles on a
    machine without a GPU. Each model.<precision>.plan gets a .plan.json with
    the profiles, versions and the input digest; the timing cache is reused
    across builds. A text-generation recipe gets one FP32 plan with a prefill
    and a decode profile, from a standard-op export of its folder checked
    against the export stage's reference (run export first). It runs walled in as
    build's engine stage is (--no-sandbox: unwalled).

    \b
    Example:
      pip install 'model-factory[tensorrt-rtx]'
      model-factory build-engine examples/minilm.toml
    """
    from model_factory.build_engines.tensorrt import build_engines_existing
    from model_factory.recipe import load_recipe

    spec = load_recipe(recipe, recipe_overrides(repository))
    if spec.is_generative:
        from model_factory.build_engines.lm_tensorrt import build_lm_engines_existing as build_engines_existing
    from model_factory.build.pipeline import run_stage

    results = run_stage(spec, "build-engine", build_engines_existing, spec, progress=progress_printer(),
                        sandbox=sandbox_mode(require_sandbox, no_sandbox))
    for r in results:
        click.echo(f"{r.precision}: {r.plan_path} ({r.size_bytes / 2**20:.1f} MiB, {r.build_seconds:.1f} s)")


COMMANDS = [quantize, build_engine]
