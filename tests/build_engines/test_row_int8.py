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
