"""TensorRT engine builds: real MiniLM plans compiled ahead of time (TensorRT-RTX on a CPU machine)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from precision_helpers import minilm_precision_recipe, write_recipe

from model_factory.build_engines import tensorrt as trt_stage
from model_factory.build_engines.tensorrt import (
    NO_GPU,
    build_engine,
    build_engines,
    deserialize_plan,
    plan_header_problems,
    profile_shapes,
    tensorrt_available,
    visible_device,
)
from model_factory.build_engines.export import digest_path
from model_factory.errors import FactoryError

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- without a builder


def test_only_this_module_imports_tensorrt():
    """The build side imports tensorrt / tensorrt_rtx in build_engines/tensorrt.py only."""
    pattern = re.compile(r"^\s*(import|from)\s+tensorrt(_rtx)?\b|import_module\(\s*[\"']tensorrt", re.M)
    offenders = []
    for folder in ("model_factory", "build_engines", "cli"):
        for path in (REPO / folder).rglob("*.py"):
            if path != REPO / "build_engines" / "tensorrt.py" and pattern.search(path.read_text()):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_importing_the_stage_does_not_import_tensorrt():
    code = ("import sys, model_factory.build_engines.tensorrt, model_factory.cli.precision; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'tensorrt_rtx')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_builder_names_the_extra_and_the_container(monkeypatch, tmp_path):
    monkeypatch.setattr(trt_stage, "_load", lambda: None)
    assert tensorrt_available() is None
    recipe = minilm_precision_recipe(tmp_path)
    with pytest.raises(FactoryError) as exc:
        build_engines(recipe, {"fp32": tmp_path / "model.onnx"})
    msg = str(exc.value)
    assert "model-factory[tensorrt-rtx]" in msg and "NVIDIA TensorRT container" in msg
    assert not (recipe.work_dir / "engines").exists()


def test_profiles_one_per_bucket(tmp_path):
    recipe = minilm_precision_recipe(tmp_path)  # max_batch 64, buckets [32, 128], preferred up to 64
    profiles = profile_shapes(recipe, {"input_ids": (-1, -1), "static": (2, 3)})
    assert [p["sequence"] for p in profiles] == [[1, 32], [33, 128]]
    assert profiles[0]["inputs"]["input_ids"] == {"min": [1, 1], "opt": [64, 32], "max": [64, 32]}
    assert profiles[1]["inputs"]["input_ids"] == {"min": [1, 33], "opt": [64, 128], "max": [64, 128]}
    assert profiles[1]["inputs"]["static"] == {"min": [2, 3], "opt": [2, 3], "max": [2, 3]}


def test_fixed_shape_model_gets_one_profile(tmp_path):
    recipe = minilm_precision_recipe(tmp_path)
    profiles = profile_shapes(recipe, {"pixels": (-1, 3, 64, 64)})
    assert len(profiles) == 1 and profiles[0]["inputs"]["pixels"] == {"min": [1, 3, 64, 64], "opt": [64, 3, 64, 64],
                                                                      "max": [64, 3, 64, 64]}


# --------------------------------------------------------------------------- real builds


def test_engines_for_fp32_fp16_int8(engines, precision_recipe, quantized, tensorrt_flavour):
    out = precision_recipe.work_dir / "engines"
    assert [e.precision for e in engines] == ["fp32", "fp16", "int8"]
    for e in engines:
        assert e.plan_path == out / f"model.{e.precision}.plan"
        assert e.metadata_path == out / f"model.{e.precision}.plan.json"
        assert e.size_bytes == e.plan_path.stat().st_size > 1_000_000 and e.build_seconds > 0
        meta = json.loads(e.metadata_path.read_text())
        assert meta["precision"] == e.precision and meta["flavour"] == tensorrt_flavour
        assert meta["version"] and meta["strongly_typed"] is True
        device = visible_device()
        if device is None:
            assert meta["device"] == NO_GPU
        else:
            assert meta["device"] == {"name": device.name, "compute_capability": device.compute_capability}
        assert [p["sequence"] for p in meta["profiles"]] == [[1, 32], [33, 128]]
        assert {i["name"] for i in meta["inputs"]} == {"input_ids", "attention_mask", "token_type_ids"}
        assert {o["name"] for o in meta["outputs"]} == {"last_hidden_state", "embedding"}
        assert meta["input_onnx_sha256"] == digest_path(quantized.models[e.precision])
        # MiniLM's weights (90 MB) live in the ONNX's external-data file, which TensorRT parsed through the path.
        data = quantized.models[e.precision].with_name(quantized.models[e.precision].name + ".data")
        assert meta["input_onnx_data_sha256"] == digest_path(data)
        assert meta["plan_bytes"] == e.size_bytes and meta["built_at"]
        if tensorrt_flavour == "tensorrt_rtx":
            assert plan_header_problems(e.plan_path) == []  # TensorRT-RTX reads the header without a GPU
    sizes = {e.precision: e.size_bytes for e in engines}
    assert sizes["fp16"] < sizes["fp32"] and sizes["int8"] < sizes["fp32"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_timing_cache_written_and_reused(engines, precision_recipe, quantized, tmp_path):
    cache = precision_recipe.work_dir / "timing.cache"
    assert cache.is_file() and cache.stat().st_size > 0
    first = json.loads(engines[0].metadata_path.read_text())["timing_cache"]
    assert first["path"] == str(cache) and first["saved_bytes"] == cache.stat().st_size
    later = [json.loads(e.metadata_path.read_text())["timing_cache"] for e in engines[1:]]
    assert all(t["loaded_bytes"] > 0 for t in later)  # each build after the first starts from the cache
    # A rebuild in another folder reuses it too.
    again = build_engine("fp16", quantized.models["fp16"], tmp_path / "model.fp16.plan", precision_recipe,
                         timing_cache=cache)
    meta = json.loads(again.metadata_path.read_text())
    assert meta["timing_cache"]["loaded_bytes"] == cache.stat().st_size > 0
    assert again.size_bytes > 1_000_000


def test_broken_onnx_is_a_clear_error(tensorrt_flavour, tmp_path):
    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"definitely not protobuf" * 20)
    recipe = minilm_precision_recipe(tmp_path)
    with pytest.raises(FactoryError, match="is not a valid ONNX model"):
        build_engines(recipe, {"fp32": broken})
    with pytest.raises(FactoryError, match="does not exist"):
        build_engines(recipe, {"fp32": tmp_path / "absent.onnx"})
    assert not (recipe.work_dir / "engines").exists()


def test_unsupported_node_is_named(tensorrt_flavour, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu"),
         helper.make_node("FancyOp", ["y"], ["z"], name="my_fancy_node", domain="example.custom")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)])
    path = tmp_path / "custom.onnx"
    onnx.save(model, str(path))
    with pytest.raises(FactoryError, match=r"cannot parse .*node 'my_fancy_node' \(FancyOp\)"):
        build_engine("fp32", path, tmp_path / "x.plan", minilm_precision_recipe(tmp_path))


def test_same_compute_capability_needs_a_gpu_with_rtx(tensorrt_flavour, quantized, tmp_path):
    if tensorrt_flavour != "tensorrt_rtx" or visible_device() is not None:
        pytest.skip("checks TensorRT-RTX on a machine without a GPU")
    recipe = minilm_precision_recipe(tmp_path, **{"tensorrt.hardware_compatibility": "same_compute_capability"})
    with pytest.raises(FactoryError, match="needs a GPU at build time"):
        build_engine("fp32", quantized.models["fp32"], tmp_path / "x.plan", recipe)


def test_header_check_spots_a_foreign_file(tensorrt_flavour, tmp_path):
    if tensorrt_flavour != "tensorrt_rtx":
        pytest.skip("the header check is a TensorRT-RTX API")
    bogus = tmp_path / "bogus.plan"
    bogus.write_bytes(b"\x01" * 4096)
    assert "MALFORMED_ENGINE" in plan_header_problems(bogus)


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="deserializing a plan needs an NVIDIA GPU")
def test_plan_deserializes_on_a_gpu(engines, tensorrt_flavour):
    device = visible_device()
    if tensorrt_flavour == "tensorrt_rtx" and device is not None and device.compute_capability == "9.0":
        pytest.skip("TensorRT-RTX does not support compute capability 9.0 (H100/H200); needs full TensorRT")
    info = deserialize_plan(engines[0].plan_path)
    assert info["profiles"] == 2
    assert {"input_ids", "attention_mask", "embedding"} <= set(info["tensors"])


def test_build_engine_command(tensorrt_flavour, minilm_export, tmp_path):
    from click.testing import CliRunner

    from model_factory.cli.precision import build_engine

    recipe = write_recipe(tmp_path, ["fp32"], minilm_export.onnx_path.parent)
    res = CliRunner().invoke(build_engine, [str(recipe)])
    assert res.exit_code == 0, res.output
    plan = tmp_path / "build" / "minilm" / "engines" / "model.fp32.plan"
    assert f"fp32: {plan}" in res.output and plan.stat().st_size > 1_000_000


def test_build_engine_command_refuses_missing_models(tmp_path):
    from click.testing import CliRunner

    from model_factory.cli.precision import build_engine

    recipe = write_recipe(tmp_path, ["fp32", "int8"])
    res = CliRunner().invoke(build_engine, [str(recipe)])
    assert res.exit_code == 1 and "run model-factory export on the recipe first" in res.output
    assert "Traceback" not in res.output
