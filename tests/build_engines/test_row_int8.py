"""down_proj in integers with an activation scale per row: each row's output independent of its batch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("onnxruntime_genai")


def test_down_proj_per_row_is_integer_close_to_float_and_row_independent(tmp_path):
    import onnx
    import onnxruntime as ort
    from generative_models import make_causal_lm

    from model_factory.build_engines.causal_lm import run_builder
    from model_factory.build_engines.lm_graph import DecoderRunner
    from model_factory.build_engines.lm_quantize import dynamic_int8
    from model_factory.build_engines.row_int8 import per_row_matmuls

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = make_causal_lm("llama", tmp_path / "llama", vocab_size=512)
    fp32 = run_builder(src, tmp_path / "fp32", "fp32")
    graph = dynamic_int8(fp32, tmp_path / "q", ("down_proj",))
    assert per_row_matmuls(graph, ("down_proj",)) == 2  # the tiny model's two layers
    nodes = onnx.load(str(graph), load_external_data=False).graph.node
    assert not [n.name for n in nodes if n.op_type == "MatMul"]
    assert sum("/down_proj/row_int8/MatMulInteger" in n.name for n in nodes) == 2
    ids = list(range(3, 40))
    ref = DecoderRunner(fp32, len(ids), 16).logits(ids)
    got = DecoderRunner(graph, len(ids), 16).logits(ids)
    assert float(np.max(np.abs(got - ref))) < 0.1 * float(np.max(np.abs(ref)))

    # one down_proj alone: a row's output is the same whatever it is batched with (a scale per row)
    node = next(n for n in nodes if n.name.endswith("/down_proj/row_int8/RowScale"))
    model = onnx.load(str(graph))
    sub = onnx.utils.Extractor(model).extract_model([next(n for n in nodes if n.name.endswith(
        "/down_proj/row_int8/Abs")).input[0]], [node.output[0]])
    sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((1, 4, sess.get_inputs()[0].shape[-1])).astype(np.float32)
    loud = rows.copy()
    loud[0, 0] *= 1000  # an outlier row beside the others
    alone = sess.run(None, {name: rows[:, 1:]})[0]
    batched = sess.run(None, {name: loud})[0]
    np.testing.assert_array_equal(batched[:, 1:], alone)


def test_down_proj_per_row_and_group_keeps_a_loud_group_from_the_others(tmp_path):
    """A scale per row and per group of inputs (the weight's per group and column): integer products whose sum is
    the float product's, and an outlier in one group of inputs no longer coarsens the row's other inputs."""
    import onnx
    import onnxruntime as ort
    from generative_models import make_causal_lm
    from onnx import numpy_helper

    from model_factory.build_engines.causal_lm import run_builder
    from model_factory.build_engines.lm_graph import DecoderRunner
    from model_factory.build_engines.lm_quantize import dynamic_int8
    from model_factory.build_engines.row_int8 import per_row_matmuls

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = make_causal_lm("llama", tmp_path / "llama", vocab_size=512)
    fp32 = run_builder(src, tmp_path / "fp32", "fp32")
    model32 = onnx.load(str(fp32))
    inits = {t.name: t for t in model32.graph.initializer}
    down = next(n for n in model32.graph.node if n.op_type == "MatMul" and "layers.0/mlp/down_proj/" in n.name)
    w = numpy_helper.to_array(inits[down.input[1]])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, w.shape[0])).astype(np.float32)
    x[:, :, :16] = np.where(x[:, :, :16] < 0, -600, 600)  # one loud group in every row (exact at either scale)
    ids = list(range(3, 40))
    ref = DecoderRunner(fp32, len(ids), 16).logits(ids)
    errors = {}
    for group in (0, 16):
        graph = dynamic_int8(fp32, tmp_path / f"q{group}", ("down_proj",))
        assert per_row_matmuls(graph, ("down_proj",), group=group) == 2
        model = onnx.load(str(graph))
        assert not [n.name for n in model.graph.node if n.op_type == "MatMul"]
        assert sum("/down_proj/row_int8/MatMulInteger" in n.name for n in model.graph.node) == \
            2 * (w.shape[0] // group if group else 1)  # a MatMulInteger per group
        got = DecoderRunner(graph, len(ids), 16).logits(ids)
        assert float(np.max(np.abs(got - ref))) < 0.1 * float(np.max(np.abs(ref)))
        out = next(n for n in model.graph.node if n.name.startswith(down.name.rsplit("/", 1)[0] + "/row_int8/")
                   and n.output[0] == down.output[0])
        sub = onnx.utils.Extractor(model).extract_model([down.input[0]], [out.output[0]])
        sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
        stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        p = out.name.rsplit("/", 1)[0]
        if group:  # the groups' weights, their scales per group and column
            wq = np.stack([stored[f"{p}.weight_q.{i}"] for i in range(w.shape[0] // group)]).astype(np.float32) \
                * stored[f"{p}.weight_scale"][:, None]
        else:
            wq = stored[f"{p}.weight_q"].astype(np.float32) * stored[f"{p}.weight_scale"]  # the weight as stored
        assert float(np.max(np.abs(wq.reshape(w.shape) - w))) <= float(np.max(np.abs(w))) / 64
        got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
        errors[group] = float(np.max(np.abs(got - x @ wq.reshape(w.shape))))  # the activations' rounding alone
    assert errors[16] < 0.2 * errors[0]
    # a group that does not divide K: a scale per row alone
    odd = dynamic_int8(fp32, tmp_path / "odd", ("down_proj",))
    assert per_row_matmuls(odd, ("down_proj",), group=7) == 2
    nodes = onnx.load(str(odd), load_external_data=False).graph.node
    assert sum("/down_proj/row_int8/MatMulInteger" in n.name for n in nodes) == 2
    assert not [n.name for n in nodes if "/row_int8/Reshape" in n.name]
