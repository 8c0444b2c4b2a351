"""A LoRA adapter's build (build/adapter.py, build_engines/lora.py): the conversion to the base graph's projections,
what is refused by name, and the whole build on the session's tiny Llama (checked against transformers + peft,
gated, packaged as its own signed entry tied to the base version's digests)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_factory.build_engines.lora import graph_pairs
from model_factory.errors import FactoryError

HF = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16, "intermediate_size": 24}


def _pair(rng, r: int, fan_in: int, fan_out: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.normal(size=(r, fan_in)).astype(np.float32), rng.normal(size=(fan_out, r)).astype(np.float32)


def test_q_k_v_packed_into_one_projection_give_each_hugging_face_module_its_own_delta() -> None:
    rng = np.random.default_rng(0)
    q, v, o = _pair(rng, 3, 16, 16), _pair(rng, 3, 16, 8), _pair(rng, 2, 16, 16)
    tensors = {}
    for proj, (a, b) in (("q_proj", q), ("v_proj", v), ("o_proj", o)):
        tensors[f"base_model.model.model.layers.0.self_attn.{proj}.lora_A.weight"] = a
        tensors[f"base_model.model.model.layers.0.self_attn.{proj}.lora_B.weight"] = b
    config = {"r": 3, "lora_alpha": 6, "alpha_pattern": {"o_proj": 8}}
    pairs = graph_pairs(config, tensors, HF, {"layers.0.attn.qkv_proj", "layers.0.attn.o_proj"})
    x = rng.normal(size=(5, 16)).astype(np.float32)
    a_all, b_all = pairs["layers.0.attn.qkv_proj"]
    got = x @ a_all @ b_all  # [5, q 16 | k 8 | v 8]

    def peft(pair, scaling):  # PEFT's LoRA forward: lora_B(lora_A(x)) * scaling
        return (x @ pair[0].T @ pair[1].T) * scaling

    np.testing.assert_allclose(got[:, :16], peft(q, 2.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[:, 16:24], 0.0)  # k was not adapted
    np.testing.assert_allclose(got[:, 24:], peft(v, 2.0), rtol=1e-5, atol=1e-5)
    a, b = pairs["layers.0.attn.o_proj"]
    np.testing.assert_allclose(x @ a @ b, peft(o, 8 / 2), rtol=1e-5, atol=1e-5)  # alpha_pattern, its own rank


@pytest.mark.parametrize("config, key, words", [
    ({"use_dora": True}, "layers.0.self_attn.q_proj.lora_A.weight", "use_dora"),
    ({"bias": "all"}, "layers.0.self_attn.q_proj.lora_A.weight", "bias"),
    ({"modules_to_save": ["lm_head"]}, "layers.0.self_attn.q_proj.lora_A.weight", "modules_to_save"),
    ({}, "base_model.model.model.embed_tokens.lora_embedding_A", "embed_tokens"),
])
def test_what_the_graph_cannot_serve_is_refused_by_name(config, key, words) -> None:
    with pytest.raises(FactoryError, match=words) as err:
        graph_pairs(config, {key: np.zeros((2, 16), np.float32)}, HF, {"layers.0.attn.qkv_proj"})
    assert "Fix: " in str(err.value)


def test_a_lora_recipe_names_its_base(tmp_path) -> None:
    from model_factory.recipe import load_recipe

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    recipe = tmp_path / "a.toml"
    recipe.write_text('[model]\nname = "a"\ntask = "text-generation"\n[source]\nkind = "lora"\npath = "adapter"\n'
                      '[adapter]\nbase = "repo/llm"\nbase_source = "hf"\n')
    with pytest.raises(FactoryError, match="recipe field 'adapter.base'.*no version"):
        load_recipe(recipe)
    recipe.write_text('[model]\nname = "a"\ntask = "text-generation"\n[source]\nkind = "lora"\npath = "adapter"\n')
    with pytest.raises(FactoryError, match="recipe field 'adapter'"):
        load_recipe(recipe)


@pytest.mark.slow
def test_an_adapter_is_checked_gated_packaged_and_signed_tied_to_its_base(tiny_llm, tmp_path) -> None:
    from model_factory.backend.lora_contract import AdapterSpec
    from model_factory.build.adapter import build_adapter
    from model_factory.build_engines.lora import base_digests
    from model_factory.recipe import load_recipe
    from model_factory.signing import SignerConfig, generate_keypair, verify_repository
    from model_factory.demo import write_key_policy
    from model_factory.signing import load_policy
    from tests.generative_repository import layout_generative_model
    from tests.lora_adapters import ADAPTERS, adapter_recipe, train_adapter

    hf, _ = tiny_llm
    repo = tmp_path / "repo"
    vdir = layout_generative_model(hf, None, repo, "llm")
    peft_dir = train_adapter(hf, tmp_path / "peft", **ADAPTERS["contracts"])
    keys = generate_keypair(tmp_path / "keys")
    said: list[str] = []
    built = build_adapter(load_recipe(adapter_recipe(tmp_path / "r", "contracts", peft_dir, repo / "llm", hf, repo)),
                          signer=SignerConfig(private_key=keys.private_key, password=None), progress=said.append)
    assert sorted(p.name for p in built.version_dir.iterdir()) == [
        "accuracy.json", "adapter.json", "adapter.npz", "metadata.json"]
    spec = AdapterSpec.from_json((built.version_dir / "adapter.json").read_text())
    assert (spec.base, spec.base_version) == ("llm", 1) and spec.base_digests == base_digests(vdir)
    assert "model.onnx" in spec.base_digests and spec.rank == 2 and len(spec.modules) == 10  # (qkv for k, o, 3 MLP) x 2
    report = json.loads((built.version_dir / "accuracy.json").read_text())
    assert report["check"]["greedy_identical"] and report["gate"]["passed"]
    assert report["gate"]["perplexity_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert report["check"]["tokens_differing_from_base"] > 0  # trained: it changes the model
    assert any("greedy identical to transformers + peft" in line for line in said)
    policy = load_policy(write_key_policy(tmp_path / "policy.toml", [keys.public_key], require_provenance=False))
    results = {r.model: r for r in verify_repository(repo, policy)}
    assert results["contracts"].ok, results["contracts"].reasons


@pytest.mark.slow
def test_a_gemma3_adapter_builds_onto_a_base_whose_weights_are_hard_linked_data(tmp_path) -> None:
    """Gemma 3's graph (the builder's packed qkv_proj, head_dim given by the config) with its weights in a data file
    of several hard links, as every packaged build's is (Gemma 3 270M's 1.1 GB): onnx's own loader refuses such a
    file as a "hardlink attack", so the check reads the graph without its weights and ONNX Runtime reads them."""
    import os

    import onnx
    import torch
    from peft import LoraConfig, get_peft_model
    import transformers

    from model_factory.build.adapter import build_adapter
    from model_factory.recipe import load_recipe
    from tests.generative_models import make_causal_lm
    from tests.generative_repository import layout_generative_model
    from tests.lora_adapters import adapter_recipe

    hf = make_causal_lm("gemma3_text", tmp_path / "hf", hidden=64, heads=4, kv_heads=1, layers=2)
    repo = tmp_path / "repo"
    vdir = layout_generative_model(hf, None, repo, "llm")
    graph = vdir / "model.onnx"
    model = onnx.load(str(graph))
    graph.unlink()
    onnx.save_model(model, str(graph), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    os.link(vdir / "model.onnx.data", tmp_path / "another-link")  # as the build folder's copy is
    assert (vdir / "model.onnx.data").stat().st_nlink == 2
    peft_model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    built = build_adapter(load_recipe(adapter_recipe(tmp_path / "r", "g", tmp_path / "peft", repo / "llm", hf, repo)))
    report = json.loads((built.version_dir / "accuracy.json").read_text())
    spec = json.loads((built.version_dir / "adapter.json").read_text())
    assert report["check"]["greedy_identical"] and report["gate"]["passed"], report
    assert report["check"]["tokens_differing_from_base"] > 0
    assert "model.onnx.data" in spec["base_digests"]
    assert sorted(m.rsplit(".", 1)[1] for m in spec["modules"] if m.startswith("layers.0.")) == [
        "down_proj", "gate_proj", "o_proj", "qkv_proj", "up_proj"]
