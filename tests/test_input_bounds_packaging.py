"""Packaging finds each index input's bounds (recipe, Hugging Face config, ONNX graph) and writes them for
the backend; a one-row token-type table gets no token_type_ids input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from model_factory.errors import FactoryError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_models import make_lookup_onnx as lookup_onnx  # noqa: E402


def _generic(tmp_path: Path, inputs=None):
    from model_factory.recipe import parse_recipe

    lookup_onnx(tmp_path / "lookup.onnx")
    data = {"model": {"name": "lookup", "task": "generic"}, "source": {"kind": "onnx", "path": "lookup.onnx"},
            "shapes": {"max_batch": 4, "max_sequence_length": 16, "sequence_buckets": [16]},
            "repository": {"path": str(tmp_path / "repo"), "instance_count": 1}}
    if inputs is not None:
        data |= {"inputs": inputs, "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1, 8]}]}
    return parse_recipe(data, tmp_path)


def test_the_graph_implies_each_lookup_tables_size(tmp_path: Path) -> None:
    import onnx

    from model_factory.build.bounds import graph_gather_bounds

    model = onnx.load(str(lookup_onnx(tmp_path / "m.onnx", rows=7, positions=3)))
    assert graph_gather_bounds(model) == {"ids": (0, 6), "pos": (0, 2)}


def test_recipe_range_intersects_the_graph_and_a_conflict_names_the_fix(tmp_path: Path) -> None:
    from model_factory.build.bounds import input_bounds

    ints = [{"name": "ids", "dtype": "INT64", "dims": [-1], "range": [1, 80]},
            {"name": "pos", "dtype": "INT64", "dims": [-1]}]
    recipe = _generic(tmp_path, ints)
    assert recipe.inputs[0].range == (1, 80)
    assert input_bounds(recipe, tmp_path / "lookup.onnx") == {"ids": (1, 49), "pos": (0, 15)}
    ints[0]["range"] = [60, 70]
    with pytest.raises(FactoryError, match="'ids' has no allowed value.*Fix: correct \\[\\[inputs\\]\\] range"):
        input_bounds(_generic(tmp_path, ints), tmp_path / "lookup.onnx")


@pytest.mark.parametrize("bad", [[3, 1], [0], "0..5", [0, 1.5], [True, 2]])
def test_a_malformed_range_is_refused_with_the_field(tmp_path: Path, bad) -> None:
    with pytest.raises(FactoryError, match=r"inputs\[0\]\.range.*Fix: give range = \[low, high\]"):
        _generic(tmp_path, [{"name": "ids", "dtype": "INT64", "dims": [-1], "range": bad},
                            {"name": "pos", "dtype": "INT64", "dims": [-1]}])
    with pytest.raises(FactoryError, match=r"inputs\[0\]\.range"):  # a float input has no index range
        _generic(tmp_path, [{"name": "ids", "dtype": "FP32", "dims": [-1], "range": [0, 1]}])


def test_packaging_writes_the_bounds_parameter_and_the_packaged_model_passes_its_load_check(tmp_path: Path) -> None:
    from model_factory.backend.requests.input_bounds import parse_bounds
    from model_factory.build.loadcheck import check_packaged
    from model_factory.build.repository import config_parameters, package_model, read_config

    recipe = _generic(tmp_path)
    res = package_model(recipe, {"model.onnx": tmp_path / "lookup.onnx"}, check=check_packaged,
                        parameters={"cost_model": "0.001,1e-6,1e-9"})
    assert parse_bounds(config_parameters(read_config(res.model_dir))["input_bounds"]) == {"ids": (0, 49),
                                                                                           "pos": (0, 15)}


def _hf_folder(tmp_path: Path, **cfg) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 32, "vocab_size": 500,
                                                    "max_position_embeddings": 66, **cfg}))
    return folder


@pytest.mark.parametrize("types,expected", [(1, False), (2, True), (None, False)])
def test_token_type_ids_only_for_a_table_of_two_rows_or_more(tmp_path: Path, types, expected) -> None:
    from model_factory.build.bounds import hf_bounds
    from model_factory.recipe import parse_recipe

    folder = _hf_folder(tmp_path, **({} if types is None else {"type_vocab_size": types}))
    recipe = parse_recipe({"model": {"name": "r"}, "source": {"kind": "huggingface", "path": str(folder)}}, tmp_path)
    assert ("token_type_ids" in {s.name for s in recipe.inputs}) is expected
    bounds = hf_bounds(folder)
    assert bounds["input_ids"] == (0, 499) and bounds["attention_mask"] == (0, 1) and bounds["position_ids"] == (0, 65)
    assert bounds.get("token_type_ids") == (None if types is None else (0, types - 1))
