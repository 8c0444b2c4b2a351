"""Engine choice at load: ONNX Runtime on CPU instances; TensorRT on GPU instances, with a fallback for auto."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model_factory.backend.loading import load_engine
from model_factory.backend.settings import parse_settings


def _identity_onnx(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.fixture
def version_dir(tmp_path: Path) -> Path:
    v = tmp_path / "m" / "1"
    v.mkdir(parents=True)
    _identity_onnx(v / "model.onnx")
    (v / "model.fp16.plan").write_bytes(b"not a real plan")
    return v


def settings(engine: str = "auto"):
    return parse_settings({"name": "m", "parameters": {"engine": {"string_value": engine}}})


def test_cpu_instance_uses_onnxruntime(version_dir: Path) -> None:
    engine, info = load_engine(version_dir, settings(), "CPU", 0)
    assert info["flavour"] == "onnxruntime" and "fallback_from_tensorrt" not in info
    out = engine.run({"x": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(out["y"], np.ones((2, 3)))


def test_gpu_instance_falls_back_when_the_plan_cannot_run(version_dir: Path) -> None:
    # No GPU here (and the plan is garbage): auto must still serve, and say why it fell back.
    engine, info = load_engine(version_dir, settings(), "GPU", 0)
    assert info["flavour"] == "onnxruntime" and info["fallback_from_tensorrt"]


def test_forced_tensorrt_fails_loudly(version_dir: Path) -> None:
    with pytest.raises(Exception):
        load_engine(version_dir, settings("tensorrt"), "GPU", 0)
