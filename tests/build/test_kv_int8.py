"""An INT8 KV cache (build_engines/kv_int8.py): ONNX Runtime's kernel as the module assumes it, the scales fitted on
the FP32 graph's cache, and a build that keeps its INT4 graph's cache in INT8 and is accepted through the backend."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_factory.backend.contract import Files, GenerationSpec

H, KV, D = 4, 2, 16


def _gqa_session(int8: bool, k_scale=None, v_scale=None):
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper

    kv_type = T.INT8 if int8 else T.FLOAT
    inputs = [helper.make_tensor_value_info("q", T.FLOAT, ["b", "s", H * D]),
              helper.make_tensor_value_info("k", T.FLOAT, ["b", "s", KV * D]),
              helper.make_tensor_value_info("v", T.FLOAT, ["b", "s", KV * D]),
              helper.make_tensor_value_info("pk", kv_type, ["b", KV, "m", D]),
              helper.make_tensor_value_info("pv", kv_type, ["b", KV, "m", D]),
              helper.make_tensor_value_info("sl", T.INT32, ["b"]), helper.make_tensor_value_info("tl", T.INT32, [])]
    names, inits, attrs = ["q", "k", "v", "pk", "pv", "sl", "tl"], [], {}
    if int8:
        names += [""] * 5 + ["ks", "vs"]
        inits = [helper.make_tensor("ks", T.FLOAT, [KV * D], k_scale.tolist()),
                 helper.make_tensor("vs", T.FLOAT, [KV * D], v_scale.tolist())]
        attrs = dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    node = helper.make_node("GroupQueryAttention", names, ["o", "pko", "pvo"], domain="com.microsoft", num_heads=H,
                            kv_num_heads=KV, **attrs)
    outputs = [helper.make_tensor_value_info("o", T.FLOAT, None), helper.make_tensor_value_info("pko", kv_type, None),
               helper.make_tensor_value_info("pvo", kv_type, None)]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_the_kernel_stores_x_over_its_scale_and_attends_to_the_dequantized_cache() -> None:
    """What kv_int8 relies on, on this ONNX Runtime: a new key is stored as round(k / scale) per channel, the past
    rows are left alone, and attention reads the cache as q * scale (as the float kernel on those values, up to the
    INT8 kernel's own rounding)."""
    rng = np.random.default_rng(0)
    b, m, past = 2, 16, 6
    ks, vs = (rng.random(KV * D).astype(np.float32) * 0.04 + 0.01 for _ in range(2))
    pk, pv = (rng.integers(-127, 128, (b, KV, m, D)).astype(np.int8) for _ in range(2))
    q = rng.standard_normal((b, 1, H * D)).astype(np.float32)
    k, v = (rng.standard_normal((b, 1, KV * D)).astype(np.float32) for _ in range(2))
    lens = dict(sl=np.full(b, past, np.int32), tl=np.array(past + 1, np.int32))

    def stored(x, s):  # what the cache keeps of a new row, [b, KV, D]
        return np.clip(np.round(x.reshape(b, KV, D) / s.reshape(KV, D)), -128, 127).astype(np.int8)

    def deq(x, s):
        return x.astype(np.float32) * s.reshape(1, KV, 1, D)

    out8, pk8, pv8 = _gqa_session(True, ks, vs).run(None, dict(q=q, k=k, v=v, pk=pk.copy(), pv=pv.copy(), **lens))
    assert np.array_equal(pk8[:, :, past], stored(k, ks)) and np.array_equal(pv8[:, :, past], stored(v, vs))
    assert np.array_equal(pk8[:, :, :past], pk[:, :, :past]) and np.array_equal(pv8[:, :, :past], pv[:, :, :past])
    new_k = (stored(k, ks).astype(np.float32) * ks.reshape(KV, D)).reshape(b, 1, KV * D)
    new_v = (stored(v, vs).astype(np.float32) * vs.reshape(KV, D)).reshape(b, 1, KV * D)
    out32, _, _ = _gqa_session(False).run(None, dict(q=q, k=new_k, v=new_v, pk=deq(pk, ks), pv=deq(pv, vs), **lens))
    assert np.abs(out8 - out32).max() <= 2e-3 * np.abs(out32).max()


def test_scales_cover_the_cache_and_rotary_pairs_share_theirs(tiny_llm, tmp_path) -> None:
    """Fitted on the FP32 graph's own cache: every cached key and value of the calibration prompts is within 127
    steps; a key channel and its rotary partner get one scale (the rotation moves magnitude between them); the
    rewritten graph keeps its weights, takes int8 caches and prefills close to FP32."""
    import shutil

    import onnx

    from model_factory.build_engines.kv_int8 import fit_kv_scales, quantize_kv_cache
    from model_factory.build_engines.lm_graph import DecoderRunner

    _hf, onnx_dir = tiny_llm
    fp32 = onnx_dir / "model.onnx"
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 2000, n).tolist() for n in (5, 17, 40)]
    scales = fit_kv_scales(fp32, D, prompts)
    assert len(scales) == 2 and all(s.shape == (KV * D,) and (s > 0).all() for pair in scales for s in pair)
    runner = DecoderRunner(fp32, 64, D)
    for prompt in prompts:
        runner.logits(prompt)
        for layer, (ks, vs) in enumerate(scales):
            k = runner.cached(layer, "key")[0, :, :len(prompt)]
            v = runner.cached(layer, "value")[0, :, :len(prompt)]
            assert (np.abs(k) <= 127 * ks.reshape(KV, 1, D) * (1 + 1e-6)).all()
            assert (np.abs(v) <= 127 * vs.reshape(KV, 1, D) * (1 + 1e-6)).all()
    for ks, _vs in scales:  # the builder's rotary embedding is not interleaved: channel i pairs with i + D/2
        per_head = ks.reshape(KV, D)
        assert np.array_equal(per_head[:, : D // 2], per_head[:, D // 2:])

    shutil.copytree(onnx_dir, tmp_path / "g")
    graph = tmp_path / "g" / "model.onnx"
    quantize_kv_cache(graph, scales)
    m = onnx.load(str(graph), load_external_data=False)
    kv_types = {v.type.tensor_type.elem_type for v in list(m.graph.input) + list(m.graph.output)
                if v.name.startswith(("past_key_values.", "present."))}
    assert kv_types == {onnx.TensorProto.INT8}
    gqa = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.input[12] == f"kv_int8.{i}.k_scale" for i, n in enumerate(gqa))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_kv_cache(graph, scales)  # never twice: the scales would be applied to int8 values
    ref, q8 = DecoderRunner(fp32, 64, D), DecoderRunner(graph, 64, D)
    assert q8.shape.kv_dtype == np.int8
    for prompt in prompts:
        a, b = ref.logits(prompt), q8.logits(prompt)
        assert np.abs(a - b).max() <= 0.05 * np.abs(a).max()


@pytest.fixture(scope="module")
def llama_kv_int8(tmp_path_factory, causal_lm_folders, generative_keys):
    """The tiny llama built FP32 + INT4 (awq) with its INT4 graph's KV cache in INT8, serving INT4, signed."""
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe
    from model_factory.signing import SignerConfig
    from tests.build.conftest import write_generative_recipe

    root = tmp_path_factory.mktemp("llama-kv8")
    path = write_generative_recipe(root, causal_lm_folders["llama"], "tiny-llama-kv8", ("fp32", "int4"), "int4",
                                   extra='kv_cache = "int8"')
    return build(load_recipe(path), signer=SignerConfig(generative_keys.private_key))


def test_a_build_keeps_its_int4_cache_in_int8_gated_and_accepted(llama_kv_int8) -> None:
    """The INT4 graph takes int8 caches, its gate was scored with them, generation.json sizes its slots at a byte
    per value, and `accept` runs it through the backend's batched scheduler on int8 slots."""
    import onnx

    from model_factory.serving.acceptance import accept_model

    vd = llama_kv_int8.version_dir
    m = onnx.load(str(vd / "model.int4.onnx"), load_external_data=False)
    past = {i.name: i.type.tensor_type.elem_type for i in m.graph.input if i.name.startswith("past_key_values.")}
    assert past and set(past.values()) == {onnx.TensorProto.INT8}
    acc = json.loads((vd / "accuracy.json").read_text())
    row = {r["precision"]: r for r in acc["results"]}["int4"]
    assert row["kv_cache"] == "int8" and row["passed"]
    assert any(s.get("kv_cache") == "int8" for s in acc["search"] if s.get("step") == "gate")
    spec = GenerationSpec.from_json((vd / Files.GENERATION).read_text())
    assert dict(spec.kv_dtypes) == {"int4": "int8"} and spec.kv_dtype == "float32"
    assert spec.for_precision("int4").kv_bytes_per_token * 4 == spec.kv_bytes_per_token
    accepted = accept_model(vd.parent)
    assert accepted.passed, accepted.reason
    assert accepted.file == "model.int4.onnx" and abs(accepted.score - row["score"]) < 0.1


def test_an_onnxruntime_too_old_for_an_int8_cache_is_refused_before_the_build(monkeypatch) -> None:
    import onnxruntime

    from model_factory.build_engines.kv_int8 import check_runtime
    from model_factory.errors import FactoryError

    check_runtime()  # the installed one: the tests above ran its INT8 cache
    monkeypatch.setattr(onnxruntime, "__version__", "1.22.1")
    with pytest.raises(FactoryError, match=r"needs onnxruntime >= 1\.32.*this one is 1\.22\.1\. Fix: "):
        check_runtime()


def test_calibration_text_without_a_token_is_refused_with_the_fix(tiny_llm) -> None:
    from model_factory.build_engines.kv_int8 import fit_kv_scales
    from model_factory.errors import FactoryError

    _hf, onnx_dir = tiny_llm
    with pytest.raises(FactoryError, match="none of quantization.calibration_data's samples has a token. Fix: "):
        fit_kv_scales(onnx_dir / "model.onnx", D, [[], []])
