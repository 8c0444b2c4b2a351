"""Which INT8 kernels the ONNX Runtime CPU engine runs: integer where the CPU has integer dot products."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model_factory.backend.engines.cpu_features import (INT8_KERNELS_ENV, Int8Refused, choose_int8_kernels, cpu_flags,
                                                integer_dot_product)

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
    vnni, avx2 = frozenset({"avx2", "avx512_vnni"}), frozenset({"avx2"})
    assert choose_int8_kernels("auto", vnni)[:2] == ("integer", "8-bit")
    assert choose_int8_kernels("auto", vnni, seven_bit=True)[:2] == ("integer", "8-bit")  # 8 bits where they fit
    kernels, weights, why = choose_int8_kernels("auto", avx2)
    assert (kernels, weights) == ("simulated", "8-bit") and "saturate" in why
    kernels, weights, why = choose_int8_kernels("auto", avx2, seven_bit=True)  # the safe form, where it was built
    assert (kernels, weights) == ("integer", "7-bit") and "cannot saturate" in why
    assert choose_int8_kernels("integer", avx2, seven_bit=True)[:2] == ("integer", "7-bit")  # the recipe forces it
    assert choose_int8_kernels("integer-7bit", vnni, seven_bit=True)[:2] == ("integer", "7-bit")
    assert choose_int8_kernels("simulated", vnni)[:2] == ("simulated", "8-bit")
    monkeypatch.setenv(INT8_KERNELS_ENV, "simulated")  # serve --int8-kernels wins over the recipe
    kernels, _weights, why = choose_int8_kernels("integer", frozenset({"avx512_vnni"}))
    assert kernels == "simulated" and INT8_KERNELS_ENV in why
    monkeypatch.setenv(INT8_KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="fast"):
        choose_int8_kernels("auto")


def test_auto_serves_the_packaged_fp32_model_where_int8_has_no_fast_form(monkeypatch) -> None:
    """No dot products and no 7-bit form: Q/DQ in float is FP32's arithmetic plus the Q/DQ's, so `auto` takes the
    FP32 model when the package carries it. Where a fast INT8 form exists, or a choice is explicit, it never does."""
    monkeypatch.delenv(INT8_KERNELS_ENV, raising=False)
    vnni, avx2 = frozenset({"avx2", "avx512_vnni"}), frozenset({"avx2"})
    kernels, weights, why = choose_int8_kernels("auto", avx2, fp32=True)
    assert (kernels, weights) == ("fp32", "fp32") and "model.onnx" in why and "7-bit" in why
    assert choose_int8_kernels("auto", avx2, seven_bit=True, fp32=True)[:2] == ("integer", "7-bit")
    assert choose_int8_kernels("auto", vnni, fp32=True)[:2] == ("integer", "8-bit")
    assert choose_int8_kernels("simulated", avx2, fp32=True)[:2] == ("simulated", "8-bit")
    with pytest.raises(Int8Refused):  # integer forced where only saturating weights exist: still refused
        choose_int8_kernels("integer", avx2, fp32=True)
    monkeypatch.setenv(INT8_KERNELS_ENV, "simulated")  # serve --int8-kernels simulated: as asked
    assert choose_int8_kernels("auto", avx2, fp32=True)[:2] == ("simulated", "8-bit")


def test_integer_kernels_on_8_bit_weights_are_refused_without_dot_products(monkeypatch) -> None:
    """What the issue saw: forcing integer kernels on an AVX2-only CPU. Never 8-bit weights there."""
    monkeypatch.delenv(INT8_KERNELS_ENV, raising=False)
    with pytest.raises(Int8Refused, match="saturate.*Fix: serve --int8-kernels simulated"):
        choose_int8_kernels("integer", frozenset({"avx2"}))
    monkeypatch.setenv(INT8_KERNELS_ENV, "integer")  # serve --int8-kernels integer: the same
    with pytest.raises(Int8Refused, match=INT8_KERNELS_ENV):
        choose_int8_kernels("auto", frozenset({"avx2", "fma"}))
    monkeypatch.setenv(INT8_KERNELS_ENV, "integer-7bit")
    with pytest.raises(Int8Refused, match="model.int8.w7.onnx"):
        choose_int8_kernels("auto", frozenset({"avx512_vnni"}))


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


HAS_DOT = bool(integer_dot_product())
IS_X86_AVX2 = "avx2" in cpu_flags()


def _int8_version(tmp_path: Path, seven_bit: bool) -> tuple[Path, np.ndarray, np.ndarray | None]:
    """A version folder with the INT8 MatMul (and its 7-bit form, made by the build's own code)."""
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    w = _int8_matmul_onnx(version / "model.int8.onnx")
    w7 = None
    if seven_bit:
        from model_factory.build_engines.int8_7bit import WEIGHT_MAX, seven_bit as requantize, write_7bit

        write_7bit(version / "model.int8.onnx", version / "model.int8.w7.onnx")
        q = np.rint(w / (np.abs(w).max(axis=0) / 127)).astype(np.int8)
        q7, s7 = requantize(q, (np.abs(w).max(axis=0) / 127).astype(np.float32), 1)
        assert np.abs(q7).max() <= WEIGHT_MAX
        w7 = q7.astype(np.float32) * s7
    return version, w, w7


def _settings():
    from model_factory.backend.settings import parse_settings

    return parse_settings({"name": "m", "parameters": {"precision": {"string_value": "int8"},
                                                       "onnx_file": {"string_value": "model.int8.onnx"}}})


def _check(engine, w: np.ndarray) -> None:
    # Inputs over the whole calibrated range: every quantized activation near +-127, the sums that saturate.
    x = np.random.default_rng(1).uniform(-6.4, 6.4, size=(64, 16)).astype(np.float32)
    xq = np.clip(np.round(x / 0.05), -128, 127) * np.float32(0.05)  # what the Q/DQ pair computes
    np.testing.assert_allclose(engine.run({"x": x})["y"], xq @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels", [
    pytest.param("integer", marks=pytest.mark.skipif(not HAS_DOT, reason=(
        "needs an integer dot-product instruction (VNNI/AMX/asimddp/i8mm): ONNX Runtime's integer kernels on 8-bit "
        "weights saturate without one, and the product never runs them there (the 7-bit form is tested below)"))),
    "simulated"])
def test_loading_runs_int8_with_the_chosen_kernels(tmp_path: Path, monkeypatch, kernels: str) -> None:
    from model_factory.backend.engines.loading import load_engine

    version, w, _ = _int8_version(tmp_path, seven_bit=False)
    monkeypatch.setenv(INT8_KERNELS_ENV, kernels)
    engine, info = load_engine(version, _settings(), "CPU", 0, digests=None)
    assert info["int8_kernels"] == kernels and info["int8_weights"] == "8-bit" and info["threads"] >= 1
    assert info["file"] == "model.int8.onnx"
    _check(engine, w)
    engine.close()


@pytest.mark.skipif(not IS_X86_AVX2, reason="the 7-bit form is the remedy for x86 kernels (AVX2 and up)")
@pytest.mark.parametrize("kernels", ["integer-7bit", "auto"])
def test_the_7_bit_form_runs_right_on_integer_kernels_on_any_avx2_cpu(tmp_path: Path, monkeypatch,
                                                                      kernels: str) -> None:
    """On an AVX2-only CPU this is the path ``auto`` and ``integer`` take (and AVX2's kernels are exercised); on a
    VNNI/AMX CPU ``integer-7bit`` runs the same file on those kernels. The outputs are the 7-bit weights' exactly."""
    from model_factory.backend.engines.loading import load_engine

    version, w, w7 = _int8_version(tmp_path, seven_bit=True)
    monkeypatch.setenv(INT8_KERNELS_ENV, kernels)
    engine, info = load_engine(version, _settings(), "CPU", 0, digests=None)
    if kernels == "auto" and HAS_DOT:
        assert (info["file"], info["int8_weights"]) == ("model.int8.onnx", "8-bit")
        _check(engine, w)
    else:
        assert (info["file"], info["int8_kernels"], info["int8_weights"]) == ("model.int8.w7.onnx", "integer", "7-bit")
        _check(engine, w7)
    engine.close()


def test_integer_forced_without_the_safe_form_is_refused_on_an_avx2_only_cpu(tmp_path: Path, monkeypatch) -> None:
    """Forcing integer where it would saturate refuses the load with the reason (the CPU's flags read from an
    AVX2-only EPYC's cpuinfo: the refusal happens before any kernel runs, so this holds on every CPU)."""
    from model_factory.backend.engines import cpu_features
    from model_factory.backend.engines.loading import load_engine
    from model_factory.backend.settings import SettingsError

    info_file = tmp_path / "cpuinfo"
    info_file.write_text(EPYC)
    real = cpu_features.cpu_flags
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda cpuinfo=info_file: real(cpuinfo))
    version, _, _ = _int8_version(tmp_path, seven_bit=False)
    monkeypatch.setenv(INT8_KERNELS_ENV, "integer")
    with pytest.raises(SettingsError, match="refused on this CPU.*saturate"):
        load_engine(version, _settings(), "CPU", 0, digests=None)


def test_loading_auto_on_an_avx2_only_cpu_runs_the_fp32_model_when_int8_has_no_7_bit_form(
        tmp_path: Path, monkeypatch) -> None:
    """The CPU's flags read from an AVX2-only EPYC's cpuinfo; the version holds the INT8 MatMul and its FP32 model
    (what packaging adds when the 7-bit form missed the gate): `auto` loads model.onnx and says why."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from model_factory.backend.engines import cpu_features
    from model_factory.backend.engines.loading import load_engine

    info_file = tmp_path / "cpuinfo"
    info_file.write_text(EPYC)
    real = cpu_features.cpu_flags
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda cpuinfo=info_file: real(cpuinfo))
    monkeypatch.delenv(INT8_KERNELS_ENV, raising=False)
    version, _w, _ = _int8_version(tmp_path, seven_bit=False)
    w32 = np.random.default_rng(2).normal(size=(16, 8)).astype(np.float32)  # the FP32 model's own weights
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
                              [numpy_helper.from_array(w32, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(version / "model.onnx"))
    engine, info = load_engine(version, _settings(), "CPU", 0, digests=None)
    assert (info["file"], info["int8_kernels"], info["int8_weights"]) == ("model.onnx", "fp32", "fp32")
    assert "no 7-bit weight form" in info["int8_kernels_why"]
    x = np.random.default_rng(3).normal(size=(4, 16)).astype(np.float32)
    np.testing.assert_allclose(engine.run({"x": x})["y"], x @ w32, rtol=1e-5, atol=1e-5)
    engine.close()


def test_fp32_says_nothing_about_int8_kernels(tmp_path: Path) -> None:
    from model_factory.backend.engines.loading import load_engine
    from model_factory.backend.settings import parse_settings

    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    _int8_matmul_onnx(version / "model.onnx")
    engine, info = load_engine(version, parse_settings({"name": "m"}), "CPU", 0, digests=None)
    assert "int8_kernels" not in info
    engine.close()
