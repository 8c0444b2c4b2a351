"""``[serving]``: the backend parameters that schedule a text-generation model, set from the recipe (their keys,
types and choices are the contract's), checked when the recipe is read and written into the signed config.pbtxt."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from model_factory.backend.contract import parse_parameters
from model_factory.errors import FactoryError
from model_factory.recipe import parse_recipe
from model_factory.recipe.schema import SERVING_DESCRIPTIONS, SERVING_PARAMETERS, recipe_json_schema

TOKENIZER = {"added_tokens": [{"id": 0, "content": "<s>"}, {"id": 7, "content": "</s>"}], "model": {"vocab": {}}}


def _llm(tmp_path: Path, serving: dict) -> dict:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512,
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100, "eos_token_id": 7}))
    (folder / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    return {"model": {"name": "m", "task": "text-generation"}, "source": {"kind": "huggingface", "path": "m"},
            "serving": serving}


def _refused(tmp_path: Path, data: dict) -> str:
    with pytest.raises(FactoryError) as err:
        parse_recipe(data, tmp_path)
    assert "\n" not in str(err.value) and ". Fix: " in str(err.value)
    return str(err.value)


def test_the_keys_are_the_contracts_serving_parameters_each_described() -> None:
    table = recipe_json_schema()["$defs"]["ServingTable"]["properties"]
    assert list(table) == list(SERVING_PARAMETERS) == list(SERVING_DESCRIPTIONS)
    assert table["speculative"]["enum"] == ["off", "prompt_lookup", "draft"]


def test_a_text_generation_recipe_carries_its_serving_parameters_as_the_backend_reads_them(tmp_path: Path) -> None:
    serving = {"speculative": "prompt_lookup", "num_speculative_tokens": 6, "prefill_chunk_tokens": "off",
               "max_itl_ratio": 1.5, "kv_layout": "blocks", "memory_budget_mib": 0}
    recipe = parse_recipe(_llm(tmp_path, serving), tmp_path)
    assert dict(recipe.serving) == {"speculative": "prompt_lookup", "num_speculative_tokens": "6",
                                    "prefill_chunk_tokens": "off", "max_itl_ratio": "1.5", "kv_layout": "blocks",
                                    "memory_budget_mib": "0"}
    assert [k for k, _ in recipe.serving] == [k for k in SERVING_PARAMETERS if k in serving]  # the contract's order
    typed = parse_parameters(dict(recipe.serving))
    assert (typed.speculative, typed.num_speculative_tokens, typed.prefill_chunk_tokens, typed.max_itl_ratio) == \
        ("prompt_lookup", 6, 0, 1.5)
    assert parse_recipe(_llm(tmp_path, {}), tmp_path).serving == ()  # nothing set: nothing written, defaults apply


def test_bad_values_are_refused_naming_the_key_and_what_it_takes(tmp_path: Path) -> None:
    assert _refused(tmp_path, _llm(tmp_path, {"speculative": "ngram"})) == (
        "recipe field 'serving.speculative': 'ngram' is not allowed. Fix: use one of: off, prompt_lookup, draft")
    assert "give 0 (off) or a number above 1" in _refused(tmp_path, _llm(tmp_path, {"max_itl_ratio": 0.5}))
    assert "at least 1" in _refused(tmp_path, _llm(tmp_path, {"max_active_sequences": 0}))
    message = _refused(tmp_path, _llm(tmp_path, {"max_batch": 8}))
    assert message.startswith("recipe field 'serving.max_batch': unknown key") and "max_active_sequences" in message
    message = _refused(tmp_path, _llm(tmp_path, {"prompt_lookup_min": 5, "prompt_lookup_max": 3}))
    assert message.startswith("recipe field 'serving.prompt_lookup_min': 5 is above prompt_lookup_max 3")


def test_a_draft_is_a_built_precision_other_than_the_served_one_and_goes_with_speculative_draft(tmp_path: Path) -> None:
    def llm(serving, precisions=("fp32", "int4")):
        data = _llm(tmp_path, serving)
        data["precisions"] = list(precisions)
        data["quantization"] = {"calibration_data": "calib.txt"}
        return data

    (tmp_path / "calib.txt").write_text("some text\n")
    recipe = parse_recipe(llm({"speculative": "draft", "speculative_draft": "int4"}), tmp_path)
    assert dict(recipe.serving) == {"speculative": "draft", "speculative_draft": "int4"}
    assert _refused(tmp_path, llm({"speculative": "draft"})).startswith(
        "recipe field 'serving.speculative': draft takes the precision whose graph drafts, and none is named")
    assert "not among the precisions built" in _refused(tmp_path, llm({"speculative": "draft",
                                                                       "speculative_draft": "int8"}))
    assert "the precision served" in _refused(tmp_path, llm({"speculative": "draft", "speculative_draft": "fp32"}))
    assert _refused(tmp_path, llm({"speculative_draft": "int4"})).startswith(
        "recipe field 'serving.speculative_draft': a draft precision (int4) is for speculative = \"draft\"")


def test_another_task_has_no_serving_table(tmp_path: Path) -> None:
    (tmp_path / "tiny.onnx").write_bytes(b"placeholder")
    data = {"model": {"name": "e"}, "source": {"kind": "onnx", "path": "tiny.onnx"},
            "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
            "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}], "serving": {"max_active_sequences": 4}}
    assert _refused(tmp_path, data).startswith("recipe field 'serving.max_active_sequences': [serving] schedules a "
                                               "text-generation model, not task 'embedding'")


def test_packaging_writes_them_into_the_config_and_a_parameter_given_to_packaging_wins(minilm_recipe,
                                                                                     tmp_path: Path) -> None:
    from model_factory.build.repository import config_parameters, package_model, read_config

    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=tmp_path / "repo"),
                     serving=(("max_active_sequences", "6"), ("speculative", "prompt_lookup")))
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"onnx bytes")
    params = config_parameters(read_config(package_model(recipe, {"model.onnx": onnx}).model_dir))
    assert (params["max_active_sequences"], params["speculative"]) == ("6", "prompt_lookup")
    params = config_parameters(read_config(package_model(recipe, {"model.onnx": onnx},
                                                         parameters={"max_active_sequences": "2"}).model_dir))
    assert (params["max_active_sequences"], params["speculative"]) == ("2", "prompt_lookup")


def test_packaging_keeps_the_draft_precisions_graph_beside_the_served_one(minilm_recipe, tmp_path: Path) -> None:
    from model_factory.build.repository import package_model

    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=tmp_path / "repo"),
                     serving=(("speculative", "draft"), ("speculative_draft", "int8")))
    files = {}
    for name in ("model.onnx", "model.fp16.onnx", "model.int8.onnx"):
        files[name] = tmp_path / name
        files[name].write_bytes(name.encode())
    version = package_model(recipe, files).version_dir
    assert sorted(p.name for p in version.glob("*.onnx")) == ["model.int8.onnx", "model.onnx"]  # fp16: not served
    del files["model.int8.onnx"]
    with pytest.raises(FactoryError, match='speculative_draft = "int8" but the int8 model model.int8.onnx was not built'):
        package_model(recipe, files)


def test_an_adapters_recipe_leaves_scheduling_to_its_base() -> None:
    from model_factory.recipe.loading import _serving
    from model_factory.recipe.schema import ServingTable

    assert _serving(ServingTable(), "text-generation", "lora", ("fp32",), "fp32") == ()  # nothing set: nothing to say
    with pytest.raises(FactoryError, match="recipe field 'serving.max_loras': a LoRA adapter is served by its base's"):
        _serving(ServingTable(max_loras=8), "text-generation", "lora", ("fp32",), "fp32")
