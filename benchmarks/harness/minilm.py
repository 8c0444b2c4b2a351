"""The one set-up benchmarks share: export the shipped MiniLM recipe once, package variants, serve them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "model_factory" / "examples" / "minilm.toml"
TEXTS = ROOT / "benchmarks" / "texts.txt"


def export_minilm(work: Path, overrides: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
    """The example recipe (FP32 only unless ``overrides`` say) exported once under ``work``: (recipe, export)."""
    from model_factory.build_engines.export import export_model
    from model_factory.recipe import load_recipe

    recipe = load_recipe(EXAMPLE, {"repository.path": str(work / "model_repository"), "precisions": ["fp32"],
                                   **(overrides or {})})
    return recipe, export_model(recipe)


def package_variant(recipe: Any, exported: Any, repo: Path | None = None, *,
                    artifacts: Mapping[str, Path] | None = None, **kwargs: Any) -> Path:
    """Package ``recipe`` (its repository moved to ``repo`` when given) from one export; returns the repository."""
    import dataclasses

    from model_factory.build.repository import package_model

    if repo is not None:
        recipe = dataclasses.replace(recipe, repository=dataclasses.replace(recipe.repository, path=repo))
    package_model(recipe, dict(artifacts or {"model.onnx": exported.onnx_path}),
                  tokenizer_dir=exported.tokenizer_dir, **kwargs)
    return Path(recipe.repository.path)


def start_server(repo: Path, models: Sequence[str] = ("minilm",), **options: Any) -> Any:
    """The real tritonserver on ``repo`` with free ports (``options``: ServerOptions fields, ``log_file``)."""
    from model_factory.serving.server import ServerOptions, TritonServer

    log_file = options.pop("log_file", None)
    return TritonServer(repo, list(models), ServerOptions(0, 0, 0, **options), log_file=log_file).start()
