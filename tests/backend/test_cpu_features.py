"""Which INT8 kernels the ONNX Runtime CPU engine runs: integer where the CPU has integer dot products."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model_factory.backend.cpu_features import INT8_KERNELS_ENV, choose_int8_kernels, cpu_flags, integer_dot_product

XEON = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni avx_vnni amx_int8\n"
EPYC = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\n"


@pytest.mark.parametrize("text,expected", [(XEON, ("avx512_vnni", "avx_vnni", "amx_int8")), (EPYC, ()),
                                           (GRAVITON, ("asimddp", "i8mm"))])
def test_integer_dot_product_flags(tmp_path: Path, text: str, expected: tuple) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert integer_dot_product(cpu_flags(info)) == expected


def test_auto_chooses_by_the_cpu_and_explicit_choices_win(monkeypatch) -> None:
    monkeypatch.delenv(INT8_KERNELS_ENV, raising=False)
    assert choose_int8_kernels("auto", frozenset({"avx2", "avx512_vnni"}))[0] == "integer"
    kernels, why = choose_int8_kernels("auto", frozenset({"avx2"}))
    assert kernels == "simulated" and "saturate" in why
    assert choose_int8_kernels("integer", frozenset({"avx2"}))[0] == "integer"  # the recipe forces it
    monkeypatch.setenv(INT8_KERNELS_ENV, "simulated")  # serve --int8-kernels wins over the recipe
    kernels, why = choose_int8_kernels("integer", frozenset({"avx512_vnni"}))
    assert kernels == "simulated" and INT8_KERNELS_ENV in why
    monkeypatch.setenv(INT8_KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="fast"):
        choose_int8_kernels("auto")


def _int8_matmul_onnx(path: Path) -> np.ndarray:
    """x @ W with W stored as an int8 Q/DQ initializer and x quantized (the quantize stage's MatMul pattern)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 8)).astype(np.float32)
    scale = np.abs(w).max(axis=0) / 127
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    inits = [numpy_helper.from_array(q, "w_q"), numpy_helper.from_array(scale.astype(np.float32), "w_s"),
             numpy_helper.from_array(np.zeros(8, np.int8), "w_z"), numpy_helper.from_array(np.float32(0.05), "x_s"),
             numpy_helper.from_array(np.int8(0), "x_z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_s", "x_z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return q.astype(np.float32) * scale


@pytest.mark.parametrize("kernels", ["integer", "simulated"])
def test_loading_runs_int8_with_the_chosen_kernels(tmp_path: Path, monkeypatch, kernels: str) -> None:
    from model_factory.backend.loading import load_engine
    from model_factory.backend.settings import parse_settings

    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    w = _int8_matmul_onnx(version / "model.int8.onnx")
    monkeypatch.setenv(INT8_KERNELS_ENV, kernels)
    s = parse_settings({"name": "m", "parameters": {"precision": {"string_value": "int8"},
                                                    "onnx_file": {"string_value": "model.int8.onnx"}}})
    engine, info = load_engine(version, s, "CPU", 0, digests=None)
    assert info["int8_kernels"] == kernels and info["threads"] >= 1
    x = np.random.default_rng(1).uniform(-3, 3, size=(5, 16)).astype(np.float32)
    xq = np.clip(np.round(x / 0.05), -128, 127) * np.float32(0.05)  # what the Q/DQ pair computes
    np.testing.assert_allclose(engine.run({"x": x})["y"], xq @ w, rtol=1e-4, atol=1e-4)
    engine.close()


def test_fp32_says_nothing_about_int8_kernels(tmp_path: Path) -> None:
    from model_factory.backend.loading import load_engine
    from model_factory.backend.settings import parse_settings

    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    _int8_matmul_onnx(version / "model.onnx")
    engine, info = load_engine(version, parse_settings({"name": "m"}), "CPU", 0, digests=None)
    assert "int8_kernels" not in info
    engine.close()
