"""``task = "text-generation"``: what a causal-LM folder must be, refused in one line naming the fix.

Folders here are config and tokenizer files only (nothing loads weights before these checks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_factory.errors import FactoryError
from model_factory.recipe import parse_recipe
from model_factory.recipe.causal_lm import FAMILIES

TOKENIZER = {"added_tokens": [{"id": 0, "content": "<s>"}, {"id": 7, "content": "</s>"}], "model": {"vocab": {}}}


def _folder(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512,
           "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100, "eos_token_id": 7}
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    (folder / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    return folder


def _recipe(tmp_path: Path, **extra):
    data = {"model": {"name": "m", "task": "text-generation"}, "source": {"kind": "huggingface", "path": "m"}}
    for key, value in extra.items():
        section, _, name = key.partition("__")
        if name:
            data.setdefault(section, {})[name] = value
        else:
            data[section] = value
    return parse_recipe(data, tmp_path)


def _refused(tmp_path, match, **extra):
    with pytest.raises(FactoryError, match=match) as err:
        _recipe(tmp_path, **extra)
    assert "\n" not in str(err.value) and ". Fix: " in str(err.value)
    return str(err.value)


def test_a_llama_folder_is_a_text_generation_recipe(tmp_path):
    _folder(tmp_path)
    recipe = _recipe(tmp_path, precisions=["fp32", "int8", "int4"], quantization__heldout_data="h.txt",
                     generation__temperature=0.7)
    assert recipe.is_generative and recipe.generation.family == "llama"
    assert recipe.generation.eos_token_ids == (7,) and recipe.shapes.max_context == 512
    assert recipe.generation.defaults == {"temperature": 0.7}
    assert [s.name for s in recipe.inputs][:2] == ["text_input", "prompt_ids"]
    assert recipe.outputs[0].name == "text_output"
    assert recipe.quantization.int4_method == "awq" and recipe.quantization.max_perplexity_ratio == 1.1 and recipe.quantization.min_token_agreement == 0.8


@pytest.fixture(autouse=True)
def _heldout(tmp_path):
    (tmp_path / "h.txt").write_text("some held-out text\n")


def test_the_models_own_code_is_refused(tmp_path):
    _folder(tmp_path, auto_map={"AutoModelForCausalLM": "modeling_x.X"})
    assert "never runs a model's code" in _refused(tmp_path, "auto_map")


def test_dynamic_rope_scaling_is_refused_with_the_static_types_named(tmp_path):
    _folder(tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    message = _refused(tmp_path, "dynamic")
    assert "length" in message and "linear, llama3" in message


def test_an_unsupported_family_names_the_supported_ones(tmp_path):
    _folder(tmp_path, model_type="falcon", architectures=["FalconForCausalLM"])
    message = _refused(tmp_path, "falcon")
    assert all(f in message for f in FAMILIES) and "gpt2" in FAMILIES


@pytest.mark.parametrize("family,arch", [("gemma2", "Gemma2ForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM"),
                                         ("granite", "GraniteForCausalLM"), ("phi", "PhiForCausalLM"),
                                         ("nemotron", "NemotronForCausalLM"), ("ernie4_5", "Ernie4_5ForCausalLM")])
def test_the_families_the_exporter_builds_are_recipes(tmp_path, family, arch):
    """Gemma 3 270M as transformers 5 saves it (rope_parameters nested per layer type) is a recipe."""
    _folder(tmp_path, model_type=family, architectures=[arch],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert _recipe(tmp_path).generation.family == family


@pytest.mark.parametrize("family,arch,missing", [
    ("smollm3", "SmolLM3ForCausalLM", "no_rope_layers"), ("olmo2", "Olmo2ForCausalLM", "no Olmo2ForCausalLM"),
    ("gemma3", "Gemma3ForConditionalGeneration", "vision and text"),
    ("falcon_h1", "FalconH1ForCausalLM", "no graph of it")])
def test_a_refused_family_says_what_is_missing_in_one_line(tmp_path, family, arch, missing):
    _folder(tmp_path, model_type=family, architectures=[arch])
    assert missing in _refused(tmp_path, family)


def test_a_gpt2_folder_reads_its_own_config_names(tmp_path):
    """GPT-2's config.json says n_positions / n_embd / n_layer / n_head: the recipe reads them as the others'."""
    _folder(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"], max_position_embeddings=None,
            hidden_size=None, num_attention_heads=None, num_hidden_layers=None, n_positions=256, n_embd=64, n_head=4,
            n_layer=2)
    recipe = _recipe(tmp_path)
    assert recipe.generation.family == "gpt2" and recipe.generation.max_positions == 256
    assert recipe.shapes.max_context == 256
    _refused(tmp_path, "longer than the 256 positions", shapes__max_context=512)


def test_a_folder_without_a_language_model_head(tmp_path):
    _folder(tmp_path, architectures=["LlamaModel"])
    _refused(tmp_path, "language-model head")


def test_a_folder_without_an_eos_token(tmp_path):
    _folder(tmp_path, eos_token_id=None)
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {}}}))
    _refused(tmp_path, "no end-of-sequence token")


def test_the_eos_token_is_found_in_the_tokenizer(tmp_path):
    _folder(tmp_path, eos_token_id=None)
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert _recipe(tmp_path).generation.eos_token_ids == (7,)


def test_a_context_longer_than_the_positions(tmp_path):
    _folder(tmp_path)
    _refused(tmp_path, "longer than the 512 positions", shapes__max_context=1024)


def test_fp16_is_built_for_generation_and_gated_on_heldout_text(tmp_path):
    _folder(tmp_path)
    (tmp_path / "h.txt").write_text("held-out text\n")
    assert _recipe(tmp_path, precisions=["fp32", "fp16"], quantization__heldout_data="h.txt").precisions == (
        "fp32", "fp16")
    _refused(tmp_path, "fp16 is gated on held-out text", precisions=["fp32", "fp16"])


def test_quantized_precisions_need_heldout_text(tmp_path):
    _folder(tmp_path)
    _refused(tmp_path, "held-out text", precisions=["fp32", "int4"])


def test_int4_is_for_generation_only(tmp_path):
    (tmp_path / "x.onnx").write_bytes(b"")
    with pytest.raises(FactoryError, match="int4"):
        parse_recipe({"model": {"name": "m"}, "source": {"kind": "onnx", "path": "x.onnx"}, "precisions": ["fp32", "int4"],
                      "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
                      "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}]}, tmp_path)


def test_generation_keys_on_another_task_are_refused(tmp_path):
    (tmp_path / "x.onnx").write_bytes(b"")
    with pytest.raises(FactoryError, match="max_context"):
        parse_recipe({"model": {"name": "m"}, "source": {"kind": "onnx", "path": "x.onnx"},
                      "shapes": {"max_context": 64}, "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
                      "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}]}, tmp_path)


def test_declared_inputs_are_refused(tmp_path):
    _folder(tmp_path)
    _refused(tmp_path, "inputs", inputs=[{"name": "x", "dtype": "FP32", "dims": [-1]}],
             outputs=[{"name": "y", "dtype": "FP32", "dims": [-1]}])


def test_an_int8_kv_cache_is_for_quantized_generative_graphs_fitted_on_calibration_text(tmp_path):
    _folder(tmp_path)
    (tmp_path / "h.txt").write_text("held-out text\n")
    (tmp_path / "c.txt").write_text("calibration text\n")
    given = dict(quantization__heldout_data="h.txt", quantization__kv_cache="int8")
    recipe = _recipe(tmp_path, precisions=["fp32", "int4"], quantization__calibration_data="c.txt", **given)
    assert recipe.quantization.kv_cache == "int8"
    assert _recipe(tmp_path, precisions=["fp32", "int4"], quantization__heldout_data="h.txt").quantization.kv_cache == (
        "float")
    _refused(tmp_path, "fits its scales on calibration text", precisions=["fp32", "int4"], **given)
    _refused(tmp_path, "int8 and int4 graphs and precisions lists neither", precisions=["fp32", "fp16"],
             quantization__calibration_data="c.txt", **given)
    _refused(tmp_path, "kv_cache", precisions=["fp32", "int4"], quantization__calibration_data="c.txt",
             quantization__heldout_data="h.txt", quantization__kv_cache="int4")


def test_an_int8_kv_cache_is_refused_for_an_encoder(tmp_path):
    (tmp_path / "x.onnx").write_bytes(b"")
    (tmp_path / "c.txt").write_text("calibration text\n")
    with pytest.raises(FactoryError, match="KV cache is a text-generation model's"):
        parse_recipe({"model": {"name": "m"}, "source": {"kind": "onnx", "path": "x.onnx"}, "precisions": ["fp32", "int8"],
                      "quantization": {"calibration_data": "c.txt", "kv_cache": "int8"},
                      "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
                      "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}]}, tmp_path)


def test_a_gpu_instance_serves_the_fp16_graph(tmp_path):
    """ONNX Runtime's CUDA attention computes in float16 only: a GPU text-generation recipe serves fp16."""
    _folder(tmp_path)
    message = _refused(tmp_path, "serves the fp16 graph", repository__instance_kind="gpu")
    assert 'serve = "fp16"' in message and 'instance_kind = "cpu"' in message
    recipe = _recipe(tmp_path, precisions=["fp32", "fp16"], quantization__heldout_data="h.txt",
                     repository__instance_kind="gpu", repository__serve="fp16")
    assert recipe.repository.instance_kind == "gpu" and recipe.repository.serve == "fp16"
