"""What the OpenAI / TEI frontend reads of a packaged encoder: task, tensors, size, labels, Matryoshka sizes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from model_factory.build.repository import package_model
from model_factory.serving.encoder_models import encoder_models


def _package(recipe, tmp_path: Path, **changes):
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"onnx bytes")
    recipe = replace(recipe, repository=replace(recipe.repository, path=tmp_path / "repo"), **changes)
    return package_model(recipe, {"model.onnx": onnx})


def test_an_embedding_model_as_the_frontend_calls_it(minilm_recipe, tmp_path: Path) -> None:
    res = _package(minilm_recipe, tmp_path)
    assert "embedding" not in json.loads((res.version_dir / "metadata.json").read_text())
    model = encoder_models(tmp_path / "repo", ["minilm"])["minilm"]
    assert (model.task, model.output, model.dimensions, model.normalized, model.text_input) == \
        ("embedding", "embedding", 384, True, True)
    assert model.max_batch == 64 and model.matryoshka_dimensions == ()
    assert (model.max_length, model.long_inputs) == (128, "refuse")  # read as the backend reads them (contract)
    assert model.tokens.count(["a b"]) == [0]  # packaged without a tokenizer: nothing to count with


def test_matryoshka_sizes_travel_in_the_signed_metadata(minilm_recipe, tmp_path: Path) -> None:
    res = _package(minilm_recipe, tmp_path, matryoshka_dimensions=(128, 256))
    assert json.loads((res.version_dir / "metadata.json").read_text())["embedding"] == \
        {"matryoshka_dimensions": [128, 256]}
    assert encoder_models(tmp_path / "repo", ["minilm"])["minilm"].matryoshka_dimensions == (128, 256)


def test_other_models_are_not_encoders(minilm_recipe, tmp_path: Path) -> None:
    _package(minilm_recipe, tmp_path, task="generic")
    assert encoder_models(tmp_path / "repo", ["minilm"]) == {}


def test_the_tokenizer_is_read_at_start_and_counts_untruncated(minilm_recipe, minilm_export, tmp_path: Path) -> None:
    import pytest

    from model_factory.errors import FactoryError

    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"onnx bytes")
    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=tmp_path / "repo"))
    res = package_model(recipe, {"model.onnx": onnx}, tokenizer_dir=minilm_export.tokenizer_dir)
    model = encoder_models(tmp_path / "repo", ["minilm"])["minilm"]
    assert model.tokens.count(["hello world", "word " * 300]) == [4, 302]  # [CLS] hello world [SEP]; no cut at 128
    (res.version_dir / "tokenizer" / "tokenizer.json").write_text("not a tokenizer")
    with pytest.raises(FactoryError, match="cannot be read as a tokenizer"):
        encoder_models(tmp_path / "repo", ["minilm"])
