"""Generation metrics: histograms as cumulative counter series, counters by finish reason, gauges sent on change."""

from __future__ import annotations

from model_factory.backend.generation.metrics import GenerationMetrics
from model_factory.backend.generation.kv_slots import KVUsage
from tests.backend.test_metrics import FakeMetric, FakeMetricFamily, FakePbUtils


def _values(m: GenerationMetrics) -> dict:
    return {(name, more): metric.value for (name, more), metric in m._metrics.items()}


def test_observations_are_summed_and_sent_once_per_flush():
    FakeMetricFamily.created = []
    m = GenerationMetrics(FakePbUtils, "llm", interval_s=None)
    for s in (0.004, 0.02, 0.3):
        m.token_interval(s)
    m.first_token(0.2)
    m.jitter(0.001)
    m.tokens(12, 0)
    m.tokens(0, 3)
    m.finished("length")
    m.finished("cancelled")
    m.state(2, 5, KVUsage(2, 8, 96, 4096, 8192, written_tokens=72, block_tokens=16, block_bytes=512,
                          blocks_used=6))
    m.prefill_chunks(2)
    m.prefill_chunks(1)
    m.chunked_step(32, 0.07, 0.08)
    m.chunked_step(16, 0.0, 0.05)  # no ITL budget: nothing predicted
    m.speculated(4, 3)
    m.prefix_held_back()
    m.prefix_held_back()
    m.speculated(4, 0)
    before = FakeMetric.calls
    m.flush()
    v = _values(m)
    itl = "inter_token_latency_seconds"
    assert v[(itl + "_bucket", (("le", "0.005"),))] == 1
    assert v[(itl + "_bucket", (("le", "0.025"),))] == 2
    assert v[(itl + "_bucket", (("le", "+Inf"),))] == 3 and v[(itl + "_count", ())] == 3
    assert abs(v[(itl + "_sum", ())] - 0.324) < 1e-9
    assert v[("time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    assert v[("time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 0
    assert v[("prompt_tokens_total", ())] == 12 and v[("generation_tokens_total", ())] == 3
    assert v[("generate_requests_total", (("finish_reason", "cancelled"),))] == 1
    assert v[("running_sequences", ())] == 2 and v[("waiting_sequences", ())] == 5
    assert v[("kv_cache_usage_ratio", ())] == 0.5
    assert v[("kv_cache_blocks_used", ())] == 6 and v[("kv_cache_blocks_free", ())] == 8
    assert v[("kv_cache_fragmentation_ratio", ())] == 0.25
    assert v[("prefill_chunks_total", ())] == 3 and v[("chunked_prefill_steps_total", ())] == 2
    assert v[("prefill_chunk_tokens_total", ())] == 48
    assert abs(v[("chunked_step_seconds_total", ())] - 0.13) < 1e-9
    assert abs(v[("chunked_step_predicted_seconds_total", ())] - 0.07) < 1e-9
    assert v[("spec_decode_num_drafts_total", ())] == 2 and v[("spec_decode_num_draft_tokens_total", ())] == 8
    assert v[("spec_decode_num_accepted_tokens_total", ())] == 3
    assert v[("prefix_cache_held_back_total", ())] == 2
    sent = FakeMetric.calls - before
    m.flush()
    assert FakeMetric.calls - before == sent  # nothing new: nothing sent
    m.close()


def test_lora_adapters_start_at_none_and_an_adapter_no_longer_reported_goes_to_zero():
    """What the OpenAI port's vllm:lora_requests_info is written from (model_factory/serving/pool_metrics.py)."""
    m = GenerationMetrics(FakePbUtils, "llm", interval_s=None)
    m.flush()
    v = _values(m)
    assert v[("lora_max_adapters", ())] == 0  # no adapters: max 0, no adapter series
    assert not [k for k in v if k[0] == "lora_adapter_sequences"]
    m.adapters({"support": 2, "code": 1}, {"contracts": 3}, 4)
    m.flush()
    v = _values(m)
    assert v[("lora_max_adapters", ())] == 4
    assert v[("lora_adapter_sequences", (("adapter", "support"), ("state", "running")))] == 2
    assert v[("lora_adapter_sequences", (("adapter", "contracts"), ("state", "waiting")))] == 3
    m.adapters({"contracts": 3}, {}, 4)
    m.flush()
    v = _values(m)
    assert v[("lora_adapter_sequences", (("adapter", "support"), ("state", "running")))] == 0
    assert v[("lora_adapter_sequences", (("adapter", "contracts"), ("state", "waiting")))] == 0
    assert v[("lora_adapter_sequences", (("adapter", "contracts"), ("state", "running")))] == 3
    m.close()
