"""Backend settings from Triton's model configuration: engine choice, TorchScript file, vocab_size, token budget."""

from __future__ import annotations

import pytest

from model_factory.backend.settings import SettingsError, parse_settings


def _settings(**params: str):
    return parse_settings({"name": "m", "max_batch_size": 4,
                           "parameters": {k: {"string_value": v} for k, v in params.items()}})


def test_defaults() -> None:
    s = _settings()
    assert s.engine == "auto" and s.torchscript_file == "model.torchscript.pt" and s.vocab_size is None


@pytest.mark.parametrize("engine", ["auto", "onnxruntime", "tensorrt", "torch"])
def test_every_engine_is_accepted(engine: str) -> None:
    assert _settings(engine=engine).engine == engine


def test_unknown_engine_names_the_choices() -> None:
    with pytest.raises(SettingsError, match="engine='cuda'.*auto, onnxruntime, tensorrt or torch"):
        _settings(engine="cuda")


def test_torchscript_file_parameter() -> None:
    assert _settings(torchscript_file="other.pt").torchscript_file == "other.pt"
    assert _settings(torchscript_file="").torchscript_file == "model.torchscript.pt"


def test_vocab_size() -> None:
    assert _settings(vocab_size="30522").vocab_size == 30522
    assert _settings(vocab_size="").vocab_size is None
    for bad in ("many", "3.5", "1e4"):
        with pytest.raises(SettingsError, match=f"vocab_size={bad!r} is not a whole number"):
            _settings(vocab_size=bad)
    for bad in ("0", "-5"):
        with pytest.raises(SettingsError, match="vocab_size.*greater than 0"):
            _settings(vocab_size=bad)


def test_max_group_tokens_is_a_budget_every_allowed_request_fits() -> None:
    assert _settings().max_group_tokens is None
    assert _settings(max_group_tokens="0").max_group_tokens is None
    assert _settings(max_sequence_length="128", max_group_tokens="4096").max_group_tokens == 4096
    with pytest.raises(SettingsError, match="max_group_tokens=64 is below max_sequence_length=128"):
        _settings(max_sequence_length="128", max_group_tokens="64")
    with pytest.raises(SettingsError, match="max_group_tokens=-1 must be 0"):
        _settings(max_group_tokens="-1")


def test_cpu_instances_split_the_cores_and_spin_only_when_they_fit() -> None:
    from model_factory.backend.settings import cpu_spinning, cpu_threads_per_instance

    cfg = {"name": "m", "max_batch_size": 4, "instance_group": [{"kind": "KIND_CPU", "count": 2}]}
    s = parse_settings(cfg)
    assert (s.cpu_instances, s.cpu_threads) == (2, None)
    # Two instances split the cores (measured better under load); pinned to every core, they sleep instead of spin.
    assert cpu_threads_per_instance(s, 2) == 1 and cpu_threads_per_instance(s, 16) == 8
    assert cpu_spinning(s, 2, 1) and not cpu_spinning(s, 2, 2)
    one = parse_settings({**cfg, "instance_group": [{"kind": "KIND_CPU", "count": 1}]})
    assert cpu_threads_per_instance(one, 4) == 4 and cpu_spinning(one, 4, 4)
    assert cpu_threads_per_instance(parse_settings({**cfg, "instance_group": []}), 6) == 6  # GPU-only: all cores
    pinned = parse_settings({**cfg, "parameters": {"cpu_threads": {"string_value": "2"}}})
    assert cpu_threads_per_instance(pinned, 2) == 2 and not cpu_spinning(pinned, 2, 2)  # every core: 2 x 2
    with pytest.raises(SettingsError, match="cpu_threads=-1"):
        _settings(cpu_threads="-1")


def test_a_text_generation_model_spins_as_every_model_unless_told_and_the_parameter_overrides_auto() -> None:
    from model_factory.backend.settings import cpu_spinning

    cfg = {"name": "m", "max_batch_size": 0, "instance_group": [{"kind": "KIND_CPU", "count": 1}]}

    def spins(**params: str) -> bool:
        return cpu_spinning(parse_settings({**cfg, "parameters": {k: {"string_value": v} for k, v in params.items()}}),
                            2, 2)

    assert spins() and spins(task="text-generation")  # a calm server's cores: spinning made more tokens/s
    assert not cpu_spinning(parse_settings({**cfg, "parameters": {"task": {"string_value": "text-generation"}}}), 2, 4)
    assert spins(task="text-generation", cpu_spinning="on") and not spins(cpu_spinning="off")
    with pytest.raises(SettingsError, match="cpu_spinning"):
        spins(cpu_spinning="sometimes")


def test_available_cpus_honours_a_cgroup_quota(tmp_path) -> None:
    import os

    from model_factory.backend.engines.loading import available_cpus

    cores = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    quota.write_text("100000 100000\n")
    assert available_cpus(quota) == 1
    quota.write_text("max 100000\n")
    assert available_cpus(quota) == cores
    assert available_cpus(tmp_path / "missing") == cores


def test_responses_are_deferred_exactly_when_the_config_sets_a_queue_policy() -> None:
    base = {"name": "m", "max_batch_size": 4}
    assert not parse_settings(base).respond_after_return  # no policy: Triton prefetches, nothing to avoid
    assert not parse_settings({**base, "dynamic_batching": {"default_queue_policy": {"max_queue_size": "0"}}}) \
        .respond_after_return
    for batching in ({"default_queue_policy": {"max_queue_size": "81"}},  # Triton's JSON: 64-bit as strings
                     {"default_queue_policy": {"max_queue_size": 81}},
                     {"default_queue_policy": {"default_timeout_microseconds": "5000"}},
                     {"priority_levels": "2"}):
        assert parse_settings({**base, "dynamic_batching": batching}).respond_after_return, batching
    bounded = {**base, "dynamic_batching": {"default_queue_policy": {"max_queue_size": "81"}}}
    off = {**bounded, "parameters": {"respond_after_return": {"string_value": "false"}}}
    assert not parse_settings(off).respond_after_return
    assert _settings(respond_after_return="true").respond_after_return
    with pytest.raises(SettingsError, match="respond_after_return='later'"):
        _settings(respond_after_return="later")


def test_int8_kernels_parameter() -> None:
    assert _settings().int8_kernels == "auto"
    assert _settings(int8_kernels="simulated").int8_kernels == "simulated"
    with pytest.raises(SettingsError, match="int8_kernels='fast'"):
        _settings(int8_kernels="fast")


def test_int8_matmul_parameter() -> None:
    assert _settings().int8_matmul == "auto"  # the factory's per-row INT8 MatMul kernel where it builds
    assert _settings(int8_matmul="onnxruntime").int8_matmul == "onnxruntime"
    with pytest.raises(SettingsError, match="int8_matmul"):
        _settings(int8_matmul="fast")


def test_int8_attention_parameter() -> None:
    assert _settings().int8_attention == "auto"  # the factory's kernel where it builds
    assert _settings(int8_attention="onnxruntime").int8_attention == "onnxruntime"
    with pytest.raises(SettingsError, match="int8_attention"):
        _settings(int8_attention="fast")


def test_max_tokens_grouping_parameter() -> None:
    assert _settings().max_tokens_grouping_ms == 0  # off: arrival order
    assert _settings(max_tokens_grouping_ms="250").max_tokens_grouping_ms == 250
    with pytest.raises(SettingsError, match="max_tokens_grouping_ms"):
        _settings(max_tokens_grouping_ms="-1")


def test_prefill_chunk_tokens_parameter() -> None:
    assert _settings().prefill_chunk_tokens == "auto"  # from the prefill cost model
    assert _settings(prefill_chunk_tokens="256").prefill_chunk_tokens == 256
    assert _settings(prefill_chunk_tokens="off").prefill_chunk_tokens == 0
    assert _settings(prefill_chunk_tokens="0").prefill_chunk_tokens == 0
    assert _settings(prefill_chunk_tokens="AUTO").prefill_chunk_tokens == "auto"
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(SettingsError, match="prefill_chunk_tokens"):
            _settings(prefill_chunk_tokens=bad)


def test_speculative_decoding_parameters() -> None:
    s = _settings()
    assert (s.speculative, s.num_speculative_tokens, s.prompt_lookup_max, s.prompt_lookup_min,
            s.speculative_max_sequences) == ("off", 8, 8, 1, 1)
    # num_speculative_tokens unset: the method's (prompt lookup's drafts follow their match, 8 at most; a draft
    # graph's cost every token: 4).
    assert _settings(speculative="prompt_lookup").num_speculative_tokens == 8
    assert _settings(speculative="draft", speculative_draft="int4").num_speculative_tokens == 4
    drafting = _settings(speculative="draft", speculative_draft="int4", num_speculative_tokens="3")
    assert drafting.num_speculative_tokens == 3
    s = _settings(speculative="prompt_lookup", num_speculative_tokens="6", prompt_lookup_max="3",
                  prompt_lookup_min="3", speculative_max_sequences="2")
    assert (s.speculative, s.num_speculative_tokens, s.prompt_lookup_max, s.prompt_lookup_min,
            s.speculative_max_sequences) == ("prompt_lookup", 6, 3, 3, 2)
    with pytest.raises(SettingsError, match="speculative"):
        _settings(speculative="draft_model")
    with pytest.raises(SettingsError, match="num_speculative_tokens"):
        _settings(num_speculative_tokens="0")
    with pytest.raises(SettingsError, match="prompt_lookup_min=3 is above prompt_lookup_max=2"):
        _settings(prompt_lookup_max="2", prompt_lookup_min="3")
    # A draft graph: a precision packaged beside the served one, named with speculative = draft and only with it.
    s = _settings(speculative="draft", speculative_draft="int4")
    assert (s.speculative, s.speculative_draft) == ("draft", "int4")
    for bad in (dict(speculative="draft"), dict(speculative_draft="int4"),
                dict(speculative="prompt_lookup", speculative_draft="int4")):
        with pytest.raises(SettingsError, match="do not go together"):
            _settings(**bad)
    with pytest.raises(SettingsError, match="speculative_draft=fp32 is the precision served"):
        _settings(speculative="draft", speculative_draft="fp32")
    with pytest.raises(SettingsError, match="speculative_draft"):
        _settings(speculative="draft", speculative_draft="int3")


def test_kv_admission_parameter() -> None:
    assert _settings().kv_admission == "paged"  # blocks as sequences grow (generation/kv_blocks.py)
    assert _settings(kv_admission="reserve").kv_admission == "reserve"
    with pytest.raises(SettingsError, match="kv_admission"):
        _settings(kv_admission="slots")


def test_kv_layout_parameter() -> None:
    assert _settings().kv_layout == "slots"  # a contiguous slot per sequence (generation/kv_slots.py)
    assert _settings(kv_layout="blocks").kv_layout == "blocks"  # a block pool and tables (generation/kv_pool.py)
    with pytest.raises(SettingsError, match="kv_layout"):
        _settings(kv_layout="paged")


def test_prefix_caching_parameter() -> None:
    assert _settings().prefix_caching == "auto"  # on where reuse is exact
    assert _settings(prefix_caching="off").prefix_caching == "off"
    with pytest.raises(SettingsError, match="prefix_caching"):
        _settings(prefix_caching="yes")


def test_max_itl_ratio_parameter() -> None:
    assert _settings().max_itl_ratio == 0.0  # off by default: the fixed auto chunk (the budget costs long prompts' TTFT)
    assert _settings(max_itl_ratio="2").max_itl_ratio == 2.0  # the running streams' step within 2x a decode-only one
    assert _settings(max_itl_ratio="1.5").max_itl_ratio == 1.5
    assert _settings(max_itl_ratio="0").max_itl_ratio == 0.0  # off: the cost model's fixed chunk
    for bad in ("1", "0.5", "-2", "fast", "inf"):
        with pytest.raises(SettingsError, match="max_itl_ratio"):
            _settings(max_itl_ratio=bad)
