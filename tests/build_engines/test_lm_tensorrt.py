"""TensorRT for text generation: the standard-op export checked against transformers, and a TensorRT-RTX plan
with a prefill and a decode profile, packaged and signed with the version."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_factory.backend.contract import ATTENTION_MASK, INPUT_IDS, LOGITS_POSITIONS, POSITION_IDS, past_name


def test_the_prefill_profile_has_no_past_and_the_decode_profile_one_new_token() -> None:
    from model_factory.build_engines.lm_tensorrt import profiles

    prefill, decode = profiles(num_layers=2, kv_heads=3, head_dim=64, max_context=256, max_batch=32)
    assert (prefill["name"], decode["name"]) == ("prefill", "decode")
    p, d = prefill["inputs"], decode["inputs"]
    assert p[past_name(1, "value")] == {"min": [1, 3, 0, 64], "opt": [1, 3, 0, 64], "max": [8, 3, 0, 64]}
    assert p[INPUT_IDS]["max"] == [8, 256] and p[ATTENTION_MASK]["max"] == [8, 256]
    assert d[INPUT_IDS] == {"min": [1, 1], "opt": [8, 1], "max": [32, 1]}
    assert d[past_name(0, "key")]["max"] == [32, 3, 255, 64] and d[ATTENTION_MASK]["max"] == [32, 256]
    assert d[POSITION_IDS]["max"] == [32, 1] and d[LOGITS_POSITIONS]["max"] == [32, 1]
    assert set(p) == set(d) and len(p) == 4 + 2 * 2


@pytest.mark.slow
def test_a_text_generation_build_with_tensorrt_packages_a_checked_plan(tmp_path) -> None:
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    from model_factory.build_engines.tensorrt import tensorrt_available

    if tensorrt_available() is None:
        pytest.skip("neither tensorrt nor tensorrt_rtx imports here: pip install 'model-factory[tensorrt-rtx]'")
    from build.conftest import write_generative_recipe
    from generative_models import make_causal_lm

    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = make_causal_lm("llama", tmp_path / "llama", vocab_size=512)
    recipe = load_recipe(write_generative_recipe(tmp_path, folder, "tiny-trt", ("fp32", "fp16", "int8", "int4"),
                                                 extra="[tensorrt]\nenabled = true\n"))
    from model_factory.signing import SignerConfig, generate_keypair

    lines: list[str] = []
    result = build(recipe, signer=SignerConfig(generate_keypair(tmp_path / "keys").private_key), progress=lines.append)
    assert result.engines == ("fp32", "fp16", "int8", "int4"), lines
    plan = result.version_dir / "model.fp32.plan"
    assert plan.is_file() and plan.stat().st_size > 0
    meta = json.loads((result.version_dir / "model.fp32.plan.json").read_text())
    assert meta["strongly_typed"] is True and meta["kv_layout"] == "concat" and meta["task"] == "text-generation"
    assert [p["name"] for p in meta["profiles"]] == ["prefill", "decode"]
    assert [p["past_tokens"] for p in meta["profiles"]] == [[0, 0], [1, 255]]
    check = meta["export_check"]
    assert check["prompts"] and all(p["identical"] and p["checked_tokens"] > 0 for p in check["prompts"])
    assert check["max_abs_logits_error"] <= check["tolerance"]
    names = {i["name"] for i in meta["inputs"]}
    assert {INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS_POSITIONS, past_name(1, "value")} <= names
    assert not any(n.endswith(".onnx.data") and "tensorrt" in n for n in result.artifacts)  # the export is not packaged
    # INT8 / INT4: weight-only Q/DQ of the same graph, checked against the reference (the recipe's gate, 0.4 here),
    # plans with the same two profiles.
    for precision, granularity in (("int8", "per output channel"), ("int4", "blocks of 32 along K")):
        q = json.loads((result.version_dir / f"model.{precision}.plan.json").read_text())
        woq = q["weight_only"]
        assert woq["granularity"] == granularity and woq["quantized_matmuls"] > 0 and woq["gate"] == 0.4
        assert 0.4 <= woq["agreement"] <= 1 and woq["compared_tokens"] > 0, woq
        assert [p["name"] for p in q["profiles"]] == ["prefill", "decode"] and q["strongly_typed"] is True
        assert any(f"{precision} weight-only graph: agreement" in line for line in lines), lines
    # FP16: the same graph in half precision (KV cache and logits too), checked the same way, then planned.
    half = json.loads((result.version_dir / "model.fp16.plan.json").read_text())
    form = half["half_precision"]
    assert form["form"] == "fp16" and form["gate"] == 0.4 and form["compared_tokens"] > 0
    assert form["agreement"] >= 0.9 and form["max_abs_logits_error_vs_fp32"] < 0.05, form
    dtypes = {i["name"]: i["dtype"] for i in half["inputs"] + half["outputs"]}
    assert dtypes[past_name(0, "key")] == "HALF" and dtypes["logits"] == "HALF" and dtypes[INPUT_IDS] == "INT64"
    assert half["strongly_typed"] is True and [p["name"] for p in half["profiles"]] == ["prefill", "decode"]
    # `model-factory build-engine` on the same recipe (from the work dir's export: the same checked plan), with a
    # stricter gate: a weight-only graph below it gets no plan, said in one line; FP32's (and any that passes) still
    # built. (One call for both: each call compiles every plan again, about 20 s on 2 cores.)
    from dataclasses import replace

    from model_factory.build_engines.lm_tensorrt import build_lm_engines_existing

    said: list[str] = []
    strict = replace(recipe, quantization=replace(recipe.quantization, min_token_agreement=1.0))
    again = build_lm_engines_existing(strict, progress=said.append)
    kept = [e.precision for e in again]
    assert kept[0] == "fp32" and "int4" not in kept, said
    assert again[0].plan_path == recipe.work_dir / "engines" / "model.fp32.plan"
    assert json.loads(again[0].metadata_path.read_text())["export_check"]["prompts"] == check["prompts"]
    assert any(line.startswith("[build-engine] skipped: the int4 TensorRT plan") and "below the gate 1" in line
               and "Fix:" in line for line in said), said
    assert not (recipe.work_dir / "engines" / "model.int4.plan").exists()
    # rebuild --check from the signed provenance: every file the same but the plan (listed, with the reason).
    from model_factory.build.rebuild import rebuild_check

    report = rebuild_check(result.version_dir)
    assert report.ok and not report.differences and not report.input_changes, (report.differences, report.input_changes)
    assert {n.split(":")[0] for n in report.not_compared} >= {f"1/model.{p}.plan{j}" for p in ("fp32", "fp16", "int8",
                                                                                        "int4") for j in ("", ".json")}


def test_weight_only_quantization_rounds_within_half_a_step_and_packs_int4_low_nibble_first() -> None:
    from model_factory.build_engines.lm_weight_only import _int4_raw, quantize_weight

    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (64, 24)).astype(np.float32)
    w[:32, 3] = 0.0  # an all-zero block keeps a usable scale
    q4, s4 = quantize_weight(w, "int4", 32)
    assert q4.shape == (64, 24) and s4.shape == (2, 24) and q4.min() >= -8 and q4.max() <= 7
    back = (q4.reshape(2, 32, 24) * s4[:, None, :]).reshape(64, 24)
    assert np.all(np.abs(back - w) <= s4.repeat(32, axis=0) / 2 + 1e-7)
    q8, s8 = quantize_weight(w, "int8", 32)
    assert s8.shape == (24,) and np.abs(q8).max() == 127
    assert np.all(np.abs(q8 * s8 - w) <= s8 / 2 + 1e-7)
    assert quantize_weight(np.ones((48, 4), np.float32), "int4", 32) is None  # 48 rows are not whole blocks
    assert _int4_raw(np.array([1, -1, 7], np.int8)) == bytes([0xF1, 0x07])


def test_build_engine_of_a_text_generation_recipe_needs_its_export_first(tmp_path) -> None:
    from build.conftest import write_generative_recipe

    from model_factory.build_engines.lm_tensorrt import build_lm_engines_existing
    from model_factory.errors import FactoryError
    from model_factory.recipe import load_recipe

    pytest.importorskip("transformers")
    from generative_models import make_causal_lm

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = make_causal_lm("llama", tmp_path / "llama", vocab_size=512)
    recipe_path = write_generative_recipe(tmp_path, folder, "no-export")
    recipe = load_recipe(recipe_path)
    with pytest.raises(FactoryError, match="run model-factory export RECIPE first"):
        build_lm_engines_existing(recipe)
    # The command routes a text-generation recipe there: one line and exit 1, no traceback.
    from click.testing import CliRunner

    from model_factory.cli.main import main

    out = CliRunner().invoke(main, ["build-engine", str(recipe_path)])
    assert out.exit_code == 1 and "run model-factory export RECIPE first" in out.output, out.output
    assert "Traceback" not in out.output
    assert not (recipe.work_dir / "engines").exists()


def test_a_gpt2_gets_plans_from_its_gemm_projections(tmp_path) -> None:
    """GPT-2's Conv1D projections export as Gemm: the weight-only form quantizes them as it does MatMuls."""
    pytest.importorskip("transformers")
    from model_factory.build_engines.tensorrt import tensorrt_available

    if tensorrt_available() is None:
        pytest.skip("neither tensorrt nor tensorrt_rtx imports here: pip install 'model-factory[tensorrt-rtx]'")
    from build.conftest import write_generative_recipe
    from generative_models import make_causal_lm

    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = make_causal_lm("gpt2", tmp_path / "gpt2", vocab_size=512)
    recipe = load_recipe(write_generative_recipe(tmp_path, folder, "tiny-gpt2-trt", ("fp32", "int4"),
                                                 extra="[tensorrt]\nenabled = true\n"))
    lines: list[str] = []
    result = build(recipe, progress=lines.append)
    assert result.engines == ("fp32", "int4"), lines
    woq = json.loads((result.version_dir / "model.int4.plan.json").read_text())["weight_only"]
    assert woq["quantized_matmuls"] >= 4 * 2 and not woq["float_matmuls"], woq  # 4 projections a layer, 2 layers
    assert json.loads((result.version_dir / "model.fp32.plan.json").read_text())["export_check"]["prompts"]
