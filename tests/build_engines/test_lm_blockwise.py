"""The factory's block-wise INT4/INT8 weights: the search, the packing ONNX Runtime's MatMulNBits reads, the layers
llama.cpp's Q4_K_M keeps wider, the embedding as an 8-bit table."""

from __future__ import annotations

import numpy as np
import pytest

from model_factory.build_engines.lm_blockwise import (dequantize_blocks, more_bits_layers, pack, quantize_blocks,
                                                      wide_nodes)


def _weights(n=48, k=96, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[rng.random((n, k)) < 0.02] *= 8  # a few outliers, as trained weights have
    return w


def _matmulnbits(x, q, scales, zeros, bits, block, k, n, zero_points=True):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    packed, zp = pack(q, zeros, bits, block)
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")]
    inputs = ["x", "B", "scales"]
    if zero_points:
        inits.append(numpy_helper.from_array(zp, "zp"))
        inputs.append("zp")
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("bits,block,symmetric", [(4, 32, False), (4, 16, False), (4, 32, True), (8, 32, False)])
def test_packed_blocks_compute_in_matmulnbits_what_they_dequantize_to(bits, block, symmetric):
    w = _weights(k=80)  # K not a multiple of 32: the last block padded
    q, scales, zeros = quantize_blocks(w, bits, block, symmetric)
    deq = dequantize_blocks(q, scales, zeros, block, w.shape[1])
    x = np.random.default_rng(1).standard_normal((5, w.shape[1])).astype(np.float32)
    got = _matmulnbits(x, q, scales, zeros, bits, block, w.shape[1], w.shape[0])
    np.testing.assert_allclose(got, x @ deq.T, rtol=1e-4, atol=1e-3)


def test_symmetric_zero_point_is_matmulnbits_default():
    w = _weights()
    q, scales, zeros = quantize_blocks(w, 4, 32, symmetric=True)
    assert (zeros == 8).all()
    x = np.random.default_rng(2).standard_normal((3, w.shape[1])).astype(np.float32)
    np.testing.assert_allclose(_matmulnbits(x, q, scales, zeros, 4, 32, w.shape[1], w.shape[0], zero_points=False),
                               _matmulnbits(x, q, scales, zeros, 4, 32, w.shape[1], w.shape[0]), rtol=1e-5, atol=1e-5)


def _rtn_symmetric(w, block):
    n, k = w.shape
    g = w.reshape(n, -1, block)
    s = np.abs(g).max(-1, keepdims=True) / 7
    return (np.clip(np.rint(g / s), -8, 7) * s).reshape(n, k)


def test_the_search_lowers_the_error_below_symmetric_round_to_nearest():
    w = _weights(n=64, k=128)
    rtn = np.sum((_rtn_symmetric(w, 32) - w) ** 2)
    plain = quantize_blocks(w, 4, 32, steps=0)
    searched = quantize_blocks(w, 4, 32)
    err_plain = np.sum((dequantize_blocks(*plain, 32, 128) - w) ** 2)
    err_searched = np.sum((dequantize_blocks(*searched, 32, 128) - w) ** 2)
    assert err_searched < err_plain < rtn
    sym = np.sum((dequantize_blocks(*quantize_blocks(w, 4, 32, symmetric=True), 32, 128) - w) ** 2)
    assert sym < rtn


def test_importance_moves_the_error_to_the_channels_that_matter_less():
    w = _weights(n=64, k=64, seed=3)
    imp = np.ones(64, np.float32)
    imp[::4] = 100.0  # these inputs carry large activations
    x = np.random.default_rng(4).standard_normal((256, 64)).astype(np.float32) * np.sqrt(imp)

    def out_err(blocks):
        return np.sum((x @ (dequantize_blocks(*blocks, 32, 64) - w).T) ** 2)

    assert out_err(quantize_blocks(w, 4, 32, importance=imp)) < out_err(quantize_blocks(w, 4, 32))


def test_q4_k_m_keeps_the_first_and_last_eighth_and_every_third_layer_wider():
    assert more_bits_layers(18) == [0, 1, 4, 7, 10, 13, 15, 16, 17]  # Gemma 3 270M's GGUF: attn_v Q8_0, ffn_down Q6_K
    assert more_bits_layers(32) == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    names = [f"/model/layers.{i}/{p}/MatMul" for i in range(18)
             for p in ("attn/qkv_proj", "attn/o_proj", "mlp/gate_proj", "mlp/down_proj")] + ["/lm_head/MatMul"]
    assert wide_nodes(names, ("last_matmul:int8",), "/lm_head/MatMul") == {"/lm_head/MatMul"}
    mixed = wide_nodes(names, ("mixed_layers:int8",), "/lm_head/MatMul")
    assert mixed == {f"/model/layers.{i}/{p}/MatMul" for i in more_bits_layers(18)
                     for p in ("attn/qkv_proj", "mlp/down_proj")}


@pytest.mark.parametrize("tie", [True, False])
def test_a_builder_graph_rewritten_blockwise_runs_close_to_fp32(tmp_path, tie):
    """The builder's FP32 graph of a small Llama: every weight MatMul becomes a MatMulNBits with zero points, the
    head at 8 bits when asked, the embedding an 8-bit GatherBlockQuantized (the head's own table when tied); the
    importance comes from the graph's own activations; the logits stay near FP32's."""
    import os
    import sys
    from pathlib import Path

    import onnx

    pytest.importorskip("onnxruntime_genai")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from generative_models import make_causal_lm

    from model_factory.build_engines.causal_lm import run_builder
    from model_factory.build_engines.lm_blockwise import BlockwiseInput
    from model_factory.build_engines.lm_graph import DecoderRunner

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = make_causal_lm("llama", tmp_path / "llama", vocab_size=512, tie=tie)
    fp32 = run_builder(src, tmp_path / "fp32", "fp32")
    ids = [list(range(3, 40)), list(range(50, 90))]
    blocks = BlockwiseInput.prepare(src, src, fp32, tmp_path / "unused", ids, 16)
    assert blocks.fp32 == fp32 and not (tmp_path / "unused").exists()
    head = blocks.importance.pop("/lm_head/MatMul")
    assert head.shape == (64,) and (head > 0).all()  # the head at 8 bits: its mean squares only
    assert all(v.shape in ((64, 64), (128, 128)) for v in blocks.importance.values())  # E[x xᵀ]: GPTQ's Hessians
    blocks.importance["/lm_head/MatMul"] = head
    graph, layout = blocks.write(tmp_path / "int4", 32, ("last_matmul:int8",))
    m = onnx.load(str(graph), load_external_data=False)
    nbits = {n.name: {a.name: a.i for a in n.attribute} for n in m.graph.node if n.op_type == "MatMulNBits"}
    assert "MatMul" not in {n.op_type for n in m.graph.node}
    assert nbits.pop("/lm_head/MatMul_Q8")["bits"] == 8 and {v["bits"] for v in nbits.values()} == {4}
    assert all(len(n.input) == 4 for n in m.graph.node if n.op_type == "MatMulNBits")  # zero points
    gather = [n for n in m.graph.node if n.op_type == "GatherBlockQuantized"]
    assert len(gather) == 1 and {a.name: a.i for a in gather[0].attribute}["bits"] == 8
    assert layout["embedding"] == ("8 bits, the LM head's table" if tie else "8 bits")
    assert layout["int8_matmuls"] == ["/lm_head/MatMul"]
    ref, got = DecoderRunner(fp32, 64, 16).logits(ids[0]), DecoderRunner(graph, 64, 16).logits(ids[0])
    assert np.corrcoef(ref.ravel(), got.ravel())[0, 1] > 0.95


def test_gptq_error_feedback_lowers_the_output_error_on_correlated_activations():
    rng = np.random.default_rng(5)
    w = _weights(n=32, k=64, seed=6)
    mix = rng.standard_normal((64, 64)).astype(np.float32)
    x = rng.standard_normal((512, 64)).astype(np.float32) @ mix  # correlated inputs: what GPTQ's feedback uses
    h = x.T @ x / len(x)

    def out_err(blocks):
        return np.sum((x @ (dequantize_blocks(*blocks, 32, 64) - w).T) ** 2)

    searched = quantize_blocks(w, 4, 32, importance=np.diag(h))
    gptq = quantize_blocks(w, 4, 32, importance=np.diag(h), hessian=h)
    assert out_err(gptq) < 0.8 * out_err(searched)
