"""The 7-bit weight form of an INT8 Q/DQ model: every pair of u8 x s8 products fits a signed 16-bit sum."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model_factory.build_engines.int8_7bit import WEIGHT_MAX, seven_bit, write_7bit


def test_each_channel_maps_its_peak_to_63_and_small_channels_stay():
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(16, 8)).astype(np.int8)
    q[:, 3] = np.clip(q[:, 3], -40, 40)  # a channel already within 7 bits
    scale = rng.uniform(0.001, 0.01, size=8).astype(np.float32)
    q7, s7 = seven_bit(q, scale, axis=1)
    assert q7.dtype == np.int8 and np.abs(q7).max() <= WEIGHT_MAX
    assert 2 * 255 * int(np.abs(q7).max()) <= 32767  # the AVX2 pair sum cannot saturate
    np.testing.assert_array_equal(q7[:, 3], q[:, 3])
    assert s7[3] == scale[3]
    # The nearest 7-bit value: off by at most half a (new) step per weight.
    err = np.abs(q7.astype(np.float32) * s7 - q.astype(np.float32) * scale)
    assert np.all(err <= s7 / 2 + 1e-9)
    q7t, s7t = seven_bit(q, np.float32(0.01), axis=None)  # per-tensor scale
    assert np.abs(q7t).max() == WEIGHT_MAX and s7t.shape == ()


def test_write_7bit_rewrites_the_weights_and_leaves_the_graph(tmp_path: Path):
    onnx = pytest.importorskip("onnx")
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "backend"))
    from test_cpu_features import _int8_matmul_onnx

    src = tmp_path / "model.int8.onnx"
    _int8_matmul_onnx(src)
    dest, changed = write_7bit(src, tmp_path / "model.int8.w7.onnx")
    assert changed == 1
    a, b = onnx.load(str(src)), onnx.load(str(dest))
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in b.graph.initializer}
    assert np.abs(inits["w_q"]).max() <= WEIGHT_MAX
    assert inits["x_s"] == np.float32(0.05)  # activations untouched
