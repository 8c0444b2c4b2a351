"""Engine choice at load: ONNX Runtime on CPU instances; TensorRT on GPU instances, with a fallback for auto."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model_factory.backend.engines.loading import GPU_PRODUCT_ENV, _gpu_plan, load_engine, product_label
from model_factory.backend.settings import SettingsError, parse_settings


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
    (v / "model.fp32.plan").write_bytes(b"not a real plan")  # the served precision's (fp32 by default)
    return v


def settings(engine: str = "auto", cpu_fallback: bool = False):
    return parse_settings({"name": "m", "parameters": {"engine": {"string_value": engine},
                                                       "cpu_fallback": {"string_value": str(cpu_fallback).lower()}}})


def test_cpu_instance_uses_onnxruntime(version_dir: Path) -> None:
    engine, info = load_engine(version_dir, settings(), "CPU", 0)
    assert info["flavour"] == "onnxruntime" and "fallback_from_tensorrt" not in info
    out = engine.run({"x": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(out["y"], np.ones((2, 3)))


def test_gpu_instance_falls_back_to_the_cpu_only_when_the_recipe_allows_it(version_dir: Path) -> None:
    # No GPU here (and the plan is garbage): with allow_cpu_fallback, auto serves on the CPU and says why.
    engine, info = load_engine(version_dir, settings(cpu_fallback=True), "GPU", 0)
    assert info["flavour"] == "onnxruntime" and info["device"] == "cpu" and info["fallback_from_tensorrt"]
    assert "CUDAExecutionProvider" in info["fallback_from_onnxruntime_cuda"] and "cpu_fallback" in info


def test_gpu_instance_never_serves_on_the_cpu_by_surprise(version_dir: Path) -> None:
    from model_factory.backend.settings import SettingsError

    with pytest.raises(SettingsError) as exc:
        load_engine(version_dir, settings(), "GPU", 0)
    msg = str(exc.value)
    # Every engine tried is named with its reason, then the fix.
    assert "no GPU engine loads here" in msg and "tensorrt:" in msg and "onnxruntime_cuda:" in msg
    assert "torch:" in msg and "allow_cpu_fallback = true" in msg
    with pytest.raises(SettingsError, match="onnxruntime_cuda: .*no CUDAExecutionProvider"):
        load_engine(version_dir, settings("onnxruntime"), "GPU", 0)  # explicit ORT on a GPU instance: CUDA or nothing


def test_forced_tensorrt_fails_loudly(version_dir: Path) -> None:
    with pytest.raises(Exception):
        load_engine(version_dir, settings("tensorrt"), "GPU", 0)


# --------------------------------------------------------------------------- the torch engine


def _torchscript(path: Path) -> None:
    """y = x, traced, with the export's name file (the ONNX model above computes the same)."""
    import io
    import json

    import torch

    from model_factory.backend.engines.torch import IO_EXTRA_FILE

    class Same(torch.nn.Module):
        def forward(self, x):  # noqa: ANN001
            return x * 1.0

    import warnings

    with warnings.catch_warnings():  # a repository from before torch.export: TorchScript is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(Same(), (torch.ones(2, 3),))
        buf = io.BytesIO()
        torch.jit.save(traced, buf, _extra_files={IO_EXTRA_FILE: json.dumps({"inputs": ["x"], "outputs": ["y"]})})
    path.write_bytes(buf.getvalue())


def _exported_program(path: Path) -> None:
    """y = 2x as the export writes it now (torch.export, model.pt2), dynamic batch."""
    import json

    import torch

    from model_factory.backend.engines.torch import IO_EXTRA_FILE

    class Twice(torch.nn.Module):
        def forward(self, x):  # noqa: ANN001
            return x * 2.0

    program = torch.export.export(Twice(), (torch.ones(2, 3),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, str(path), extra_files={IO_EXTRA_FILE: json.dumps({"inputs": ["x"], "outputs": ["y"]})})


@pytest.fixture
def torch_version_dir(version_dir: Path) -> Path:
    _torchscript(version_dir / "model.torchscript.pt")
    return version_dir


def _cuda_available() -> bool:
    from model_factory.backend.engines.torch import cuda_unavailable_reason

    return cuda_unavailable_reason(0) is None


def test_engine_torch_on_a_cpu_instance(torch_version_dir: Path) -> None:
    engine, info = load_engine(torch_version_dir, settings("torch"), "CPU", 0)
    assert info == {"flavour": "torch", "file": "model.torchscript.pt", "device": "cpu", "verified": False,
                    "format": "TorchScript"}
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ort, _ = load_engine(torch_version_dir, settings("onnxruntime"), "CPU", 0)
    np.testing.assert_array_equal(engine.run({"x": x})["y"], ort.run({"x": x})["y"])


def test_engine_torch_without_the_file_names_the_fix(version_dir: Path) -> None:
    from model_factory.backend.settings import SettingsError

    with pytest.raises(SettingsError, match="model.pt2 is missing.*export.torchscript = true"):
        load_engine(version_dir, settings("torch"), "CPU", 0)


def test_the_exported_program_is_preferred_over_a_trace(torch_version_dir: Path) -> None:
    _exported_program(torch_version_dir / "model.pt2")
    engine, info = load_engine(torch_version_dir, settings("torch"), "CPU", 0)
    assert (info["file"], info["format"]) == ("model.pt2", "ExportedProgram")
    for n in (1, 5):  # the batch axis is dynamic
        x = np.arange(3 * n, dtype=np.float32).reshape(n, 3)
        np.testing.assert_array_equal(engine.run({"x": x})["y"], 2 * x)
    engine.close()


def test_auto_on_a_cpu_instance_stays_on_onnxruntime(torch_version_dir: Path) -> None:
    _, info = load_engine(torch_version_dir, settings(), "CPU", 0)
    assert info["flavour"] == "onnxruntime" and not any(k.startswith("fallback") for k in info)


def test_auto_on_a_gpu_instance_without_cuda_falls_back_with_both_reasons(torch_version_dir: Path) -> None:
    if _cuda_available():
        pytest.skip("torch has CUDA here: auto serves with torch")
    _, info = load_engine(torch_version_dir, settings(cpu_fallback=True), "GPU", 0)
    assert info["flavour"] == "onnxruntime"
    assert info["fallback_from_tensorrt"] and "no usable CUDA" in info["fallback_from_torch"]


def test_auto_on_a_gpu_instance_without_torchscript_says_so(version_dir: Path) -> None:
    _, info = load_engine(version_dir, settings(cpu_fallback=True), "GPU", 0)
    assert info["flavour"] == "onnxruntime" and "export.torchscript = true" in info["fallback_from_torch"]


@pytest.fixture
def pretend_cuda(monkeypatch):
    """No GPU here: make "torch with CUDA is available" true and map the GPU instance to the CPU device.

    Unavoidable to reach auto's torch branch on a CPU machine; the real CUDA path is the gpu test in
    test_torch_engine.py and the Triton check of benchmarks/gpu_checks.py.
    """
    from model_factory.backend.engines import loading
    from model_factory.backend.engines import torch as torch_engine

    monkeypatch.setattr(torch_engine, "cuda_unavailable_reason", lambda device_id=0: None)
    monkeypatch.setattr(loading, "instance_device", lambda kind, device_id: "cpu")


def test_auto_on_a_gpu_instance_prefers_torch_over_onnxruntime(torch_version_dir: Path, pretend_cuda) -> None:
    engine, info = load_engine(torch_version_dir, settings(), "GPU", 0)
    # The plan here is garbage: TensorRT is tried first and its failure recorded.
    assert info["flavour"] == "torch" and info["fallback_from_tensorrt"] and "fallback_from_torch" not in info
    assert "CUDAExecutionProvider" in info["fallback_from_onnxruntime_cuda"]  # tried before torch
    np.testing.assert_array_equal(engine.run({"x": np.ones((1, 3), np.float32)})["y"], np.ones((1, 3)))


def test_auto_does_not_fall_back_over_a_changed_file(torch_version_dir: Path, pretend_cuda, tmp_path: Path,
                                                     monkeypatch) -> None:
    import hashlib
    import json

    from model_factory.backend.integrity import ENV, IntegrityError

    v = torch_version_dir
    digests = {f"1/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in v.iterdir()}
    digests["1/model.torchscript.pt"] = "0" * 64  # swapped after verification
    table = tmp_path / "verified.json"
    table.write_text(json.dumps({"m": {"1": digests}}))
    monkeypatch.setenv(ENV, str(table))
    with pytest.raises(IntegrityError, match="model.torchscript.pt changed after verification"):
        load_engine(v, settings(), "GPU", 0)


def test_torch_engine_must_fit_the_model_config(torch_version_dir: Path) -> None:
    from model_factory.backend.settings import SettingsError

    cfg = {"name": "m", "parameters": {"engine": {"string_value": "torch"}},
           "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]}],
           "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [3]}]}
    with pytest.raises(SettingsError, match=r"inputs not declared: \['x'\]"):
        load_engine(torch_version_dir, parse_settings(cfg), "CPU", 0)


# --------------------------------------------------------------------------- served precision, external data


def _precision_settings(precision: str, engine: str = "auto", plan: bool = True, cpu_fallback: bool = False):
    params = {"engine": engine, "precision": precision, "cpu_fallback": str(cpu_fallback).lower(),
              "onnx_file": "model.onnx" if precision == "fp32" else f"model.{precision}.onnx"}
    if precision == "int8":
        # Pinned: with `auto`, a CPU without integer dot products would serve the FP32 model.onnx that this folder
        # also holds (test_cpu_features: the INT8 package's fallback there); these tests are about the files.
        params["int8_kernels"] = "simulated"
    if plan:
        params["plan_file"] = f"model.{precision}.plan"
    return parse_settings({"name": "m", "parameters": {k: {"string_value": v} for k, v in params.items()}})


def _scale_onnx(path: Path, scale: float, external: bool) -> None:
    """y = x @ W with W = scale * I (64 x 64), its weight in ``path.data`` when ``external``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array((np.eye(64) * scale).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data",
                        size_threshold=0)
    else:
        onnx.save(model, str(path))


@pytest.fixture
def precisions_dir(tmp_path: Path) -> Path:
    """A version folder with every precision: ONNX files that tell themselves apart, and garbage plans."""
    v = tmp_path / "m" / "1"
    v.mkdir(parents=True)
    for precision, scale in (("fp32", 1.0), ("fp16", 2.0), ("int8", 3.0)):
        name = "model.onnx" if precision == "fp32" else f"model.{precision}.onnx"
        _scale_onnx(v / name, scale, external=precision != "fp16")
        (v / f"model.{precision}.plan").write_bytes(f"not a real {precision} plan".encode())
    return v


@pytest.mark.parametrize("precision,scale", [("fp32", 1.0), ("fp16", 2.0), ("int8", 3.0)])
def test_the_served_precision_and_only_it_is_loaded(precisions_dir: Path, precision: str, scale: float) -> None:
    engine, info = load_engine(precisions_dir, _precision_settings(precision), "CPU", 0)
    assert info["precision"] == precision and info["file"] == _precision_settings(precision).onnx_file
    np.testing.assert_allclose(engine.run({"x": np.ones((1, 64), np.float32)})["y"], np.full((1, 64), scale))


def test_a_gpu_instance_tries_the_served_precisions_plan(precisions_dir: Path) -> None:
    # No GPU here: the int8 plan is tried (and its failure recorded), then the int8 ONNX serves (the CPU allowed).
    engine, info = load_engine(precisions_dir, _precision_settings("int8", cpu_fallback=True), "GPU", 0)
    assert info["flavour"] == "onnxruntime" and info["file"] == "model.int8.onnx"
    assert info["fallback_from_tensorrt"] and "FP32" in info["fallback_from_torch"]
    np.testing.assert_allclose(engine.run({"x": np.ones((1, 64), np.float32)})["y"], np.full((1, 64), 3.0))


def test_tensorrt_refuses_when_the_served_precision_has_no_plan(precisions_dir: Path) -> None:
    from model_factory.backend.settings import SettingsError

    (precisions_dir / "model.fp16.plan").unlink()
    with pytest.raises(SettingsError, match="no fp16 plan"):
        load_engine(precisions_dir, _precision_settings("fp16", engine="tensorrt", plan=False), "GPU", 0)


def test_external_data_is_loaded_from_the_verified_bytes(precisions_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import hashlib
    import json
    import tempfile

    private = tmp_path / "private"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))  # where the checked copies go while loading

    from model_factory.backend.integrity import ENV, IntegrityError

    v = precisions_dir
    digests = {f"1/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in v.iterdir()}
    table = tmp_path / "verified.json"
    table.write_text(json.dumps({"m": {"1": digests}}))
    monkeypatch.setenv(ENV, str(table))
    engine, info = load_engine(v, _precision_settings("int8"), "CPU", 0)
    assert info["verified"] and info["external_data"] == "model.int8.onnx.data"
    np.testing.assert_allclose(engine.run({"x": np.ones((1, 64), np.float32)})["y"], np.full((1, 64), 3.0))
    assert list(private.iterdir()) == []  # the private copies are gone once the session holds the weights
    # The weights swapped after verification: refused, not loaded.
    data = v / "model.int8.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="model.int8.onnx.data changed after verification"):
        load_engine(v, _precision_settings("int8"), "CPU", 0)
    assert list(private.iterdir()) == []


# --------------------------------------------------------------------------- engines per GPU product


def _plan_meta(version_dir: Path, plan: str, device_name: str | None) -> None:
    device = {"name": device_name, "compute_capability": "9.0"} if device_name else "none (ahead-of-time build)"
    (version_dir / f"{plan}.json").write_text(json.dumps({"plan": plan, "device": device}))


def test_product_label_matches_gpu_feature_discovery() -> None:
    assert product_label("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert product_label(" Tesla T4 ") == "Tesla-T4"


def test_without_a_gpu_product_the_served_plan_counts(version_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv(GPU_PRODUCT_ENV, raising=False)
    _plan_meta(version_dir, "model.fp32.plan", "NVIDIA L4")
    assert _gpu_plan(version_dir, settings()) == (version_dir / "model.fp32.plan", [])


def test_a_pod_pinned_to_a_product_loads_only_plans_built_on_it(version_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv(GPU_PRODUCT_ENV, "NVIDIA-H100-80GB-HBM3")
    (version_dir / "model.fp16.plan").write_bytes(b"built on this GPU")
    _plan_meta(version_dir, "model.fp16.plan", "NVIDIA H100 80GB HBM3")
    (version_dir / "model.int8.plan").write_bytes(b"built on another GPU")
    _plan_meta(version_dir, "model.int8.plan", "NVIDIA L4")
    assert _gpu_plan(version_dir, _precision_settings("fp16")) == (version_dir / "model.fp16.plan", [])
    # The deployment serves INT8, built on an L4: the H100 pod has no plan (never another precision's).
    assert _gpu_plan(version_dir, _precision_settings("int8")) == (None, ["model.int8.plan (built for NVIDIA-L4)"])


def test_no_plan_for_the_product_falls_back_under_auto_and_fails_when_forced(version_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv(GPU_PRODUCT_ENV, "NVIDIA-H100-80GB-HBM3")
    _plan_meta(version_dir, "model.fp32.plan", None)  # built ahead of time without a GPU
    engine, info = load_engine(version_dir, settings(cpu_fallback=True), "GPU", 0)  # the recipe allows the CPU
    assert info["flavour"] == "onnxruntime"
    assert info["fallback_from_tensorrt"] == ("no plan built for GPU product 'NVIDIA-H100-80GB-HBM3': skipped "
                                              "model.fp32.plan (built for no GPU product)")
    with pytest.raises(SettingsError, match="no fp32 plan.*NVIDIA-H100-80GB-HBM3"):
        load_engine(version_dir, settings("tensorrt"), "GPU", 0)
    (version_dir / "model.fp32.plan.json").unlink()  # no metadata at all: not known to be for this product
    assert _gpu_plan(version_dir, settings()) == (None, ["model.fp32.plan (built for no GPU product)"])


def test_the_plan_metadata_is_read_through_the_verified_digests(version_dir: Path, monkeypatch) -> None:
    from model_factory.backend.integrity import IntegrityError

    monkeypatch.setenv(GPU_PRODUCT_ENV, "NVIDIA-L4")
    _plan_meta(version_dir, "model.fp32.plan", "NVIDIA L4")
    with pytest.raises(IntegrityError, match="1/model.fp32.plan.json changed after verification"):
        _gpu_plan(version_dir, settings(), {"1/model.fp32.plan.json": "0" * 64})
