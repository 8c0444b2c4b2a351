"""``serve``'s banner line for each loaded model: what it computes on, never "unknown"."""

from __future__ import annotations

from model_factory.serving.metrics_scrape import engine_description


def test_an_encoder_is_described_by_its_engine_label():
    labels = {"model": "minilm", "engine": "onnxruntime", "device": "cpu", "precision": "int8"}
    assert engine_description(labels, {"precision": "int8"}, "KIND_CPU") == "onnxruntime on cpu"


def test_a_text_generation_model_runs_on_onnxruntime_on_its_instance_kind():
    params = {"task": "text-generation", "precision": "int4", "onnx_file": "model.int4.onnx"}
    # Its metrics carry no engine label: the generation metrics' labels are model and instance only.
    on_cpu = engine_description({"model": "tiny-llama", "instance": "tiny-llama_0"}, params, "KIND_CPU")
    assert on_cpu == "onnxruntime on cpu (text generation, int4)"
    assert engine_description(None, params, "KIND_CPU") == on_cpu
    on_gpu = engine_description(None, {**params, "cpu_fallback": "true"}, "KIND_GPU")
    assert on_gpu.startswith("onnxruntime on a GPU (ONNX Runtime's CUDA provider, the CPU where it cannot load")
    assert on_gpu.endswith("(text generation, int4)")


def test_a_model_without_labels_is_described_from_its_config_never_unknown():
    for params, kind in (({}, "KIND_CPU"), ({"engine": "tensorrt", "precision": "fp16"}, "KIND_GPU"),
                         ({"task": "text-generation"}, "KIND_CPU")):
        line = engine_description({}, params, kind)
        assert "unknown" not in line and line.split()[0] in ("onnxruntime", "tensorrt")
    assert engine_description({}, {"engine": "tensorrt", "precision": "fp16"}, "KIND_GPU").startswith(
        "tensorrt on a GPU (fp16")


def test_the_banner_reads_the_served_contract_from_config_pbtxt(tmp_path):
    from model_factory.serving.verified_start import _served_contract

    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.pbtxt").write_text(
        'name: "tiny-llama"\nbackend: "python"\ninstance_group { count: 1 kind: KIND_GPU }\n'
        'parameters { key: "task" value { string_value: "text-generation" } }\n'
        'parameters { key: "precision" value { string_value: "int8" } }\n')
    params, kind = _served_contract(model)
    assert (params["task"], params["precision"], kind) == ("text-generation", "int8", "KIND_GPU")
    assert engine_description({}, params, kind).startswith("onnxruntime on a GPU")
    assert _served_contract(tmp_path / "missing") == ({}, "KIND_CPU")
