"""generate_model's load: the prefill cost model kept in the cost cache between loads of the same graph."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from model_factory.backend.generation.prefill_cost import cached_cost as _cached_cost
from model_factory.backend.generation.prefill_cost import cost_cache_file as _cost_cache_file
from model_factory.backend.generation.prefill_cost import save_cost as _save_cost
from model_factory.backend.batching.grouping import CostModel
from model_factory.backend.memory.pool import cuda_device_count

SHA = "ab" * 32


def _settings(name: str = "llm") -> SimpleNamespace:
    return SimpleNamespace(model_name=name, onnx_file="model.onnx")


def test_a_candidate_saves_what_the_served_version_of_the_same_graph_reads(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MODEL_FACTORY_COST_CACHE", str(tmp_path / "cache"))
    v2 = tmp_path / "repo" / "llm" / "2"
    candidate = _cost_cache_file(v2, _settings("llm__candidate"), {"2/model.onnx": SHA})
    served = _cost_cache_file(v2, _settings("llm"), {"2/model.onnx": SHA})
    assert candidate == served and served.parent == tmp_path / "cache"
    assert _cached_cost(served) is None  # nothing learned yet: the load measures
    _save_cost(candidate, CostModel(0.02, 1.5e-3, 2e-6), "llm__candidate")
    assert _cached_cost(served) == CostModel(0.02, 1.5e-3, 2e-6)
    # Other bytes (another version's graph) are another file: never constants learned for something else.
    other = _cost_cache_file(v2, _settings("llm"), {"2/model.onnx": "cd" * 32})
    assert other != served and _cached_cost(other) is None
    # The same graph with its INT8 cache's attention on the factory's kernel prefills at another speed: its own file.
    kernel = _cost_cache_file(v2, _settings("llm"), {"2/model.onnx": SHA}, "cpu",
                              "model-factory Int8KVAttention (30 nodes, libmf_int8_kv_attention.so)")
    assert kernel != served and _cached_cost(kernel) is None
    assert _cost_cache_file(v2, _settings("llm"), {"2/model.onnx": SHA}, "cpu",
                            "onnxruntime GroupQueryAttention (the INT8-cache kernel is not used: ...)") == served


def test_no_cache_folder_or_no_verified_digest_means_no_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MODEL_FACTORY_COST_CACHE", raising=False)
    assert _cost_cache_file(tmp_path / "llm" / "1", _settings(), {"1/model.onnx": SHA}) is None
    monkeypatch.setenv("MODEL_FACTORY_COST_CACHE", str(tmp_path / "cache"))
    assert _cost_cache_file(tmp_path / "llm" / "1", _settings(), None) is None
    assert _cost_cache_file(tmp_path / "llm" / "1", _settings(), {"1/other.onnx": SHA}) is None


@pytest.mark.parametrize("content", [
    "not json", "[]", '{"prefill": 3}', '{"prefill": {"a": 1e-3, "b": 1e-5}}',
    '{"prefill": {"a": 0, "b": 1e-5, "c": 0}}', '{"prefill": {"a": 1e-3, "b": -1, "c": 0}}',
    '{"prefill": {"a": "x", "b": 1e-5, "c": 0}}', '{"estimator": {"a": 1e-3, "b": 1e-5, "c": 0}}',
])
def test_a_file_that_does_not_hold_a_usable_prefill_cost_is_ignored(tmp_path: Path, content: str) -> None:
    path = tmp_path / "llm-key.json"
    path.write_text(content)
    assert _cached_cost(path) is None  # the load then measures, as with no file


def test_a_cache_folder_that_cannot_be_written_is_no_error(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    _save_cost(blocked / "sub" / "llm-key.json", CostModel(1e-3, 1e-5, 0.0), "llm")  # no exception
    assert _cached_cost(blocked / "sub" / "llm-key.json") is None


def test_an_int8_kv_graph_on_an_onnxruntime_too_old_is_refused_with_the_fix(monkeypatch) -> None:
    import onnxruntime

    from model_factory.backend.generate_model import _require_int8_kv_runtime
    from model_factory.backend.settings import SettingsError
    from model_factory.build_engines.kv_int8 import MIN_ONNXRUNTIME
    from model_factory.backend.generate_model import INT8_KV_ONNXRUNTIME

    assert INT8_KV_ONNXRUNTIME == MIN_ONNXRUNTIME  # the build and the backend ask for the same runtime
    _require_int8_kv_runtime("int4")  # the installed one runs it (tests/build/test_kv_int8.py)
    monkeypatch.setattr(onnxruntime, "__version__", "1.31.0")
    with pytest.raises(SettingsError, match=r"int4's graph keeps its KV cache in INT8.*onnxruntime>=1\.32"):
        _require_int8_kv_runtime("int4")


def test_a_gpu_runs_only_a_graph_whose_attention_has_a_cuda_kernel() -> None:
    from model_factory.backend.generation.causal_lm import device_kv_problem

    assert device_kv_problem({"past_key_values.0.key": "tensor(float16)"}, "fp16") is None
    for kind in ("tensor(float)", "tensor(int8)"):
        why = device_kv_problem({"past_key_values.0.key": kind, "past_key_values.0.value": kind}, "int8")
        assert why and kind in why and 'repository.serve = "fp16"' in why and "instance_kind" in why


def _gpu_instance(tmp_path: Path, cpu_fallback: bool):
    from model_factory.backend.generate_model import GenerativeModel

    gen = GenerativeModel.__new__(GenerativeModel)  # the load step alone: no Triton, no threads
    gen.settings = SimpleNamespace(model_name="llm", onnx_file="model.fp16.onnx", precision="fp16",
                                   cpu_fallback=cpu_fallback, pool_release_threshold_mib=256, pool_initial_mib=0,
                                   memory_budget_mib=0, device_reserve_mib=1024, max_active_sequences=4)
    gen._gpu, gen._device, gen.placement_note = 0, None, ""
    return gen


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks what a GPU instance does on a machine without a GPU")
def test_a_gpu_instance_without_a_gpu_is_refused_with_the_fix_or_serves_on_the_cpu_where_allowed(tmp_path) -> None:
    from model_factory.backend.settings import SettingsError

    with pytest.raises(SettingsError, match=r"GPU instance of llm: .*cuda:0.*allow_cpu_fallback = true"):
        _gpu_instance(tmp_path, cpu_fallback=False)._load_on_gpu(tmp_path, None, None)
    allowed = _gpu_instance(tmp_path, cpu_fallback=True)
    assert allowed._load_on_gpu(tmp_path, None, None) is None  # the caller loads on the CPU
    assert allowed.placement_note.startswith("; on the CPU instead of cuda:0, allowed by the recipe (")
    assert allowed._device is None


def test_the_prefill_cost_is_cached_per_device(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MODEL_FACTORY_COST_CACHE", str(tmp_path / "cache"))
    v1, digests = tmp_path / "repo" / "llm" / "1", {"1/model.onnx": SHA}
    cpu = _cost_cache_file(v1, _settings(), digests)
    assert cpu == _cost_cache_file(v1, _settings(), digests, "cpu")
    assert len({cpu, _cost_cache_file(v1, _settings(), digests, "cuda:0"),
                _cost_cache_file(v1, _settings(), digests, "cuda:1")}) == 3
