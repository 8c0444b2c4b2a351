"""Degrade before shedding, build side: the recipe key, the package it writes, the gate it checks (one line)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from model_factory.build.repository import (FALLBACK_QUEUE_BATCHES, config_parameters, package_model, read_config)
from model_factory.errors import FactoryError
from model_factory.backend.contract import SHED_AGE_BOUND_FACTOR


def _artifacts(tmp_path: Path, int8_score: float = 0.995, min_accuracy: float | None = 0.99):
    build = tmp_path / "build"
    build.mkdir()
    artifacts = {}
    for name in ("model.onnx", "model.int8.onnx", "model.int8.w7.onnx"):
        (build / name).write_bytes(name.encode())
        artifacts[name] = build / name
    report = build / "accuracy.json"
    report.write_text(json.dumps({"min_accuracy": min_accuracy, "results": [
        {"precision": "int8", "metric": "cosine", "score": int8_score, "extra": {}}]}))
    return artifacts, report


def _recipe(minilm_recipe, tmp_path: Path, **repository):
    return replace(minilm_recipe, precisions=("fp32", "int8"),
                   repository=replace(minilm_recipe.repository, path=tmp_path / "repo", **repository))


def test_degrade_to_keeps_its_files_declares_the_precision_output_and_doubles_the_auto_bound(minilm_recipe, tmp_path):
    artifacts, report = _artifacts(tmp_path)
    result = package_model(_recipe(minilm_recipe, tmp_path, degrade_to="int8", degrade_backlog=8), artifacts,
                           extra_files=[report])
    files = {p.name for p in result.version_dir.iterdir()}
    assert {"model.onnx", "model.int8.onnx", "model.int8.w7.onnx", "accuracy.json"} <= files
    config = read_config(result.model_dir)
    params = config_parameters(config)
    assert (params["precision"], params["degrade_to"], params["degrade_backlog"]) == ("fp32", "int8", "8")
    assert [o.data_type for o in config.output if o.name == "precision"] == [13]  # TYPE_STRING, dims [1]
    assert config.dynamic_batching.default_queue_policy.max_queue_size == \
        2 * SHED_AGE_BOUND_FACTOR * FALLBACK_QUEUE_BATCHES * minilm_recipe.shapes.max_batch  # by age: 8x, a cap
    # The signed metadata lists the degrade precision's files (signed with the rest).
    meta = json.loads((result.version_dir / "metadata.json").read_text())
    assert {"model.int8.onnx", "model.int8.w7.onnx", "accuracy.json"} <= set(meta["files"])


def test_without_degrade_to_nothing_changes(minilm_recipe, tmp_path):
    artifacts, report = _artifacts(tmp_path)
    result = package_model(_recipe(minilm_recipe, tmp_path), artifacts, extra_files=[report])
    config = read_config(result.model_dir)
    assert "degrade_to" not in config_parameters(config)
    assert not [o for o in config.output if o.name == "precision"]
    assert not (result.version_dir / "model.int8.onnx").exists()
    assert config.dynamic_batching.default_queue_policy.max_queue_size == \
        SHED_AGE_BOUND_FACTOR * FALLBACK_QUEUE_BATCHES * minilm_recipe.shapes.max_batch


@pytest.mark.parametrize("score, gate, said", [
    (0.95, 0.99, "it failed its accuracy gate (cosine 0.95 < min_accuracy 0.99)"),
    (0.999, None, "has no gate"),
])
def test_a_degrade_precision_that_failed_or_has_no_gate_is_refused_in_one_line(minilm_recipe, tmp_path, score, gate,
                                                                                said):
    artifacts, report = _artifacts(tmp_path, score, gate)
    with pytest.raises(FactoryError) as exc:
        package_model(_recipe(minilm_recipe, tmp_path, degrade_to="int8"), artifacts, extra_files=[report])
    assert said in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "repo" / minilm_recipe.name).exists()  # nothing written


def test_a_degrade_precision_not_built_is_refused(minilm_recipe, tmp_path):
    artifacts, report = _artifacts(tmp_path)
    del artifacts["model.int8.onnx"]
    with pytest.raises(FactoryError, match=r"degrade_to = \"int8\" but the int8 model model.int8.onnx was not built"):
        package_model(_recipe(minilm_recipe, tmp_path, degrade_to="int8"), artifacts, extra_files=[report])


def test_the_recipe_key_is_checked_against_precisions_and_serve(tmp_path):
    from model_factory.recipe import load_recipe
    from tests.conftest import EXAMPLE

    recipe = load_recipe(EXAMPLE, {"repository.degrade_to": "int8"})
    assert recipe.repository.degrade_to == "int8" and recipe.repository.degrade_backlog == 0
    with pytest.raises(FactoryError, match="degrade_to.*not among precisions"):
        load_recipe(EXAMPLE, {"repository.degrade_to": "int8", "precisions": ["fp32"]})
    with pytest.raises(FactoryError, match="degrade_to.*is the precision served"):
        load_recipe(EXAMPLE, {"repository.degrade_to": "int8", "repository.serve": "int8"})
    with pytest.raises(FactoryError, match="degrade_to"):
        load_recipe(EXAMPLE, {"repository.degrade_to": "int4"})
