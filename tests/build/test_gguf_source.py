"""``[source] kind = "gguf"`` end to end, and precision ``gguf`` (the GGUF's blocks carried into MatMulNBits).

A tiny random Llama is written as a GGUF in the test (tests/gguf_models.py: Q8_0, Q4_0, Q5_0 tensors, a packed QKV
that mixes them, Llama's Q/K rows permuted as llama.cpp's converter writes them) and built through the recipe, in
the walled child processes ``model-factory build`` uses, FP32 + gguf, serving gguf, signed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from model_factory.errors import FactoryError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.slow


def _gguf_recipe(folder: Path, gguf_file: Path, name: str, precisions=("fp32", "gguf"), serve="gguf") -> Path:
    from build.conftest import write_generative_recipe

    path = write_generative_recipe(folder, gguf_file, name, precisions, serve)
    path.write_text(path.read_text().replace('kind = "huggingface"', 'kind = "gguf"'))
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, causal_lm_folders):
    from gguf_models import write_tiny_gguf

    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("tiny-gguf")
    (root / "gguf").mkdir()
    return write_tiny_gguf(causal_lm_folders["llama"], root / "gguf" / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def gguf_build(tmp_path_factory, tiny_gguf, generative_keys):
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe
    from model_factory.signing import SignerConfig

    root = tmp_path_factory.mktemp("gguf-build")
    recipe = load_recipe(_gguf_recipe(root, tiny_gguf, "tiny-gguf"))
    return recipe, build(recipe, signer=SignerConfig(generative_keys.private_key), isolate=True)


def _transformers_on_gguf(path: Path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tok


def test_the_recipe_reads_the_gguf_header(tiny_gguf, tmp_path):
    from model_factory.recipe import load_recipe

    recipe = load_recipe(_gguf_recipe(tmp_path, tiny_gguf, "hdr"))
    assert recipe.source.kind == "gguf" and recipe.source.path.resolve() == tiny_gguf.resolve()
    assert recipe.generation.family == "llama" and recipe.generation.max_positions == 512
    assert recipe.generation.eos_token_ids == (2,)  # <|im_end|>, tokenizer.ggml.eos_token_id


def test_the_folder_holds_the_gguf_tokenizer_template_and_generation_defaults(gguf_build, tiny_gguf):
    recipe, result = gguf_build
    folder = recipe.work_dir / "source"
    record = json.loads((folder / "gguf_source.json").read_text())
    assert record["sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert record["tensor_types"] == {"F32": 6, "Q4_0": 6, "Q5_0": 4, "Q8_0": 5}
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 0
    tc = json.loads((result.version_dir / "tokenizer" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in (tc.get("chat_template") or (result.version_dir / "tokenizer" /
                                                           "chat_template.jinja").read_text())


def test_the_gguf_sha256_is_the_source_digest_of_provenance_and_metadata(gguf_build, tiny_gguf):
    from model_factory.build.pipeline import provenance_for

    recipe, result = gguf_build
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert json.loads((result.version_dir / "export.json").read_text())["source_digest"] == sha
    meta = json.loads((result.version_dir / "metadata.json").read_text())
    assert sha in json.dumps(meta)
    facts = provenance_for(recipe, {"source_digest": sha}, None)
    assert Path(facts["source_model"]).resolve() == tiny_gguf.resolve() and facts["source_model_digest"] == sha
    bundle = "".join(p.read_text(errors="ignore") for p in result.model_dir.glob("*.sig"))
    bom = "".join(p.read_text() for p in result.version_dir.glob("*bom*.json"))
    assert sha in bom or sha in bundle or not bom  # the BOM (with the distribution extra) names it


def test_fp32_greedy_equals_transformers_on_the_same_gguf(gguf_build, tiny_gguf):
    import torch

    from model_factory.backend.contract import Files, GenerationSpec
    from model_factory.build_engines.lm_graph import DecoderRunner

    recipe, result = gguf_build
    report = json.loads((result.version_dir / Files.EXPORT_REPORT).read_text())
    assert report["check"]["greedy_identical"], report["check"]
    model, tok = _transformers_on_gguf(tiny_gguf)
    spec = GenerationSpec.from_json((result.version_dir / Files.GENERATION).read_text())
    runner = DecoderRunner(result.version_dir / "model.onnx", 128, spec.head_dim)
    ids = tok("The license grants the right to")["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None)[0, len(ids):].tolist()
    assert runner.greedy(ids, 24) == want


def test_gguf_precision_matmulnbits_hold_the_gguf_blocks(gguf_build, tiny_gguf):
    import gguf
    import onnx
    from onnx import numpy_helper

    from model_factory.build_engines.gguf_carry import packed_values

    _recipe, result = gguf_build
    m = onnx.load(str(result.version_dir / "model.gguf.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    nodes = {n.name: n for n in m.graph.node if n.op_type == "MatMulNBits"}
    assert len(nodes) == 2 * 5 + 1 and not [n for n in m.graph.node if n.op_type == "MatMul"]
    reader = gguf.GGUFReader(str(tiny_gguf))
    tensors = {t.name: t for t in reader.tensors}

    def terms(name):
        node = nodes[name]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        return [inits[i] for i in node.input[1:]], attrs

    # The LM head (Q8_0): each block's bytes are the GGUF's int8 codes + 128, its scale the block's fp16 d.
    (b, s, z), attrs = terms("/lm_head/MatMul")
    assert (attrs["bits"], attrs["block_size"]) == (8, 32) and np.all(z == 128)
    raw = tensors["output.weight"].data.reshape(-1, 34)
    assert np.array_equal(b.reshape(-1, 32), (raw[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8))
    assert np.array_equal(s, raw[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1))
    # o_proj (Q4_0, 4 bits): the GGUF's nibbles (element j low, j+16 high) re-packed in MatMulNBits' order.
    (b, s, z), attrs = terms("/model/layers.0/attn/o_proj/MatMul")
    assert (attrs["bits"], attrs["block_size"]) == (4, 32) and np.all(z == 0x88)
    qs = tensors["blk.0.attn_output.weight"].data.reshape(-1, 18)[:, 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    assert np.array_equal(b.reshape(-1, 16), (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
    # Every MatMulNBits stands for the GGUF's dequantized values (gguf.quants), Q/K rows in transformers' order.
    heads, kv = 4, 2
    for name, node in nodes.items():
        (b, s, z), attrs = terms(name)
        got = packed_values(b, s, z, attrs["bits"], attrs["block_size"], attrs["N"], attrs["K"])
        if name == "/lm_head/MatMul":
            parts = ["output.weight"]
        else:
            layer = name.split("/")[2].split(".")[1]
            kind = name.split("/")[4]
            parts = {"qkv_proj": ["attn_q", "attn_k", "attn_v"], "o_proj": ["attn_output"], "gate_proj": ["ffn_gate"],
                     "up_proj": ["ffn_up"], "down_proj": ["ffn_down"]}[kind]
            parts = [f"blk.{layer}.{p}.weight" for p in parts]
        want = []
        for p in parts:
            t = tensors[p]
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, attrs["K"])
            if p.endswith(("attn_q.weight", "attn_k.weight")):  # transformers' reverse of the converter's permute
                h = heads if "attn_q" in p else kv
                w = w.reshape(h, w.shape[0] // h // 2, 2, -1).swapaxes(2, 1).reshape(w.shape)
            want.append(w)
        assert np.array_equal(got, np.concatenate(want)), name
    carried = json.loads((result.version_dir / "gguf_carry.json").read_text())
    assert all(v["exact"] for v in carried["by_type"].values()), carried["by_type"]


def test_gguf_precision_logits_agree_with_fp32_at_float_activations(gguf_build, tiny_gguf, tmp_path):
    """At accuracy level 1 (float activations) the carried graph computes transformers' dequantized model: its
    logits are FP32's to float rounding; the packaged graph (level 4: int8 activations per block) passed the gate."""
    from model_factory.backend.contract import Files, GenerationSpec
    from model_factory.build_engines.gguf_carry import carry_gguf
    from model_factory.build_engines.lm_graph import DecoderRunner
    from model_factory.recipe import read_hf_config

    recipe, result = gguf_build
    data = recipe.work_dir / "export" / "model.onnx.data"
    os.link(data, tmp_path / "another-link")  # as packaging links it: onnx's loader refuses such a file, ours reads it
    graph, report = carry_gguf(recipe.work_dir / "export" / "model.onnx", tiny_gguf, tmp_path / "level1",
                               read_hf_config(recipe.work_dir / "source"), accuracy_level=1)
    spec = GenerationSpec.from_json((result.version_dir / Files.GENERATION).read_text())
    fp32 = DecoderRunner(result.version_dir / "model.onnx", 128, spec.head_dim)
    carried = DecoderRunner(graph, 128, spec.head_dim)
    ids = list(range(5, 60))
    a, b = fp32.logits(ids), carried.logits(ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max(), np.abs(a - b).max()
    assert carried.greedy(ids[:8], 32) == fp32.greedy(ids[:8], 32)
    acc = json.loads((result.version_dir / "accuracy.json").read_text())
    row = {r["precision"]: r for r in acc["results"]}["gguf"]
    assert row["passed"] and row["method"] == "gguf" and row["perplexity_ratio"] < 1.05


def test_the_signed_gguf_version_verifies_and_serves_gguf(gguf_build, generative_keys, tmp_path):
    from model_factory.signing import load_policy, verify_model_version

    recipe, result = gguf_build
    policy = tmp_path / "policy.toml"
    policy.write_text(f'version = 1\n[[keys]]\nname = "k"\npath = "{generative_keys.public_key}"\n'
                      "[provenance]\nrequired = true\n")
    verdict = verify_model_version(result.model_dir, recipe.version, load_policy(policy))
    assert verdict.ok, verdict
    assert "model.gguf.onnx" in result.files
    from model_factory.serving.acceptance import accept_model

    accepted = accept_model(result.version_dir.parent)  # the backend's engine and scheduler on the gguf graph
    assert accepted.passed, accepted.reason
    assert accepted.file == "model.gguf.onnx", accepted.file


def test_a_file_that_is_not_a_gguf_is_refused_with_the_fix(tmp_path):
    from model_factory.recipe import load_recipe

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(FactoryError) as err:
        load_recipe(_gguf_recipe(tmp_path, fake, "fake"))
    msg = str(err.value)
    assert "source.path" in msg and "is not a GGUF file" in msg and "Fix:" in msg


def test_an_architecture_the_factory_does_not_build_is_refused(tmp_path):
    import gguf

    from model_factory.recipe import load_recipe

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_context_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(FactoryError, match="architecture 'bert' is not one the factory builds"):
        load_recipe(_gguf_recipe(tmp_path, path, "bert"))


def test_gguf_precision_needs_a_gguf_source(tmp_path, causal_lm_folders):
    from build.conftest import write_generative_recipe

    from model_factory.recipe import load_recipe

    with pytest.raises(FactoryError, match="gguf carries a GGUF's own quantized blocks"):
        load_recipe(write_generative_recipe(tmp_path, causal_lm_folders["llama"], "hf", ("fp32", "gguf"), "gguf"))


def test_a_gguf_source_is_text_generation_only(tmp_path, tiny_gguf):
    from model_factory.recipe import load_recipe

    path = _gguf_recipe(tmp_path, tiny_gguf, "emb", ("fp32",), "fp32")
    path.write_text(path.read_text().replace('task = "text-generation"', 'task = "embedding"'))
    with pytest.raises(FactoryError, match="a gguf source is a language model"):
        load_recipe(path)


os.environ.setdefault("HF_HUB_OFFLINE", "1")
