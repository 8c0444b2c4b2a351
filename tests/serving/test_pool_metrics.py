"""The model-server protocol's metrics written from the backend's gauges (model_factory/serving/pool_metrics.py).

The real server's scrape is in tests/integration/test_pool_metrics_serving.py; here the translation alone: summed
over instances, KV usage as reserved over budget, the LoRA info metric's labels, and text a Prometheus parser (and so
the endpoint picker's) reads.
"""

from __future__ import annotations

import pytest

from model_factory.measure.bench import Sample, parse_prometheus
from model_factory.serving.pool_metrics import (KV_USAGE, KV_USAGE_BEFORE_0_10, LORA_INFO, PROTOCOL_NAMES, RUNNING,
                                                WAITING, ModelLoad, exposition, model_loads)

MIB = float(1 << 20)


def _backend(model: str, instance: str, waiting: float, running: float, reserved: float, budget: float) -> list:
    labels = {"model": model, "version": "1", "instance": instance}
    return [Sample("model_factory_waiting_sequences", labels, waiting),
            Sample("model_factory_running_sequences", labels, running),
            Sample("model_factory_kv_cache_reserved_bytes", labels, reserved),
            Sample("model_factory_kv_cache_budget_bytes", labels, budget),
            Sample("model_factory_kv_cache_usage_ratio", labels, reserved / budget)]


def test_instances_of_a_model_are_summed_and_kv_usage_is_reserved_over_budget() -> None:
    samples = (_backend("llm", "0", 3, 8, 96 * MIB, 128 * MIB) + _backend("llm", "1", 1, 2, 0, 128 * MIB)
               + _backend("other", "0", 0, 1, 10 * MIB, 100 * MIB)
               + [Sample("model_factory_waiting_sequences", {"model": "encoder"}, 7.0)])
    loads = model_loads(samples, ["llm", "other", "idle"])
    assert loads["llm"] == ModelLoad(4, 10, 96 * MIB, 256 * MIB)
    assert loads["llm"].kv_usage == pytest.approx(0.375)  # not the mean of the instances' ratios
    assert loads["other"].kv_usage == pytest.approx(0.1)
    assert loads["idle"] == ModelLoad() and loads["idle"].kv_usage == 0.0  # not reported yet: an idle model
    assert "encoder" not in loads  # not a text-generation model the frontend serves


def test_the_exposition_is_one_gauge_per_name_with_vllm_labels() -> None:
    loads = {"llm": ModelLoad(4, 10, 96 * MIB, 256 * MIB)}
    text = exposition(loads, now=1_700_000_000.0)
    for name in PROTOCOL_NAMES:
        assert f"# TYPE {name} gauge" in text
    samples = {s.name: s for s in parse_prometheus(text)}
    assert samples[WAITING].value == 4 and samples[RUNNING].value == 10
    assert samples[KV_USAGE].value == samples[KV_USAGE_BEFORE_0_10].value == pytest.approx(0.375)
    assert samples[WAITING].labels == {"model_name": "llm"}
    lora = samples[LORA_INFO]
    assert lora.labels == {"model_name": "llm", "max_lora": "0", "running_lora_adapters": "",
                           "waiting_lora_adapters": ""}
    assert lora.value == 1_700_000_000.0  # the protocol's value: when it was written


def test_adapters_become_the_lora_info_labels() -> None:
    labels = {"model": "llm"}
    samples = _backend("llm", "0", 1, 2, 1, 2) + [
        Sample("model_factory_lora_max_adapters", labels, 4.0),
        Sample("model_factory_lora_adapter_sequences", {**labels, "adapter": "support", "state": "running"}, 2.0),
        Sample("model_factory_lora_adapter_sequences", {**labels, "adapter": "code", "state": "running"}, 1.0),
        Sample("model_factory_lora_adapter_sequences", {**labels, "adapter": "old", "state": "running"}, 0.0),
        Sample("model_factory_lora_adapter_sequences", {**labels, "adapter": "contracts", "state": "waiting"}, 3.0)]
    load = model_loads(samples, ["llm"])["llm"]
    assert (load.max_lora, load.running_adapters, load.waiting_adapters) == (4, ("code", "support"), ("contracts",))
    [info] = [s for s in parse_prometheus(exposition({"llm": load})) if s.name == LORA_INFO]
    assert info.labels["running_lora_adapters"] == "code,support" and info.labels["waiting_lora_adapters"] == "contracts"
    assert info.labels["max_lora"] == "4"


def test_kv_usage_never_passes_one_and_names_are_escaped() -> None:
    assert ModelLoad(reserved_bytes=3.0, budget_bytes=2.0).kv_usage == 1.0
    text = exposition({'we"ird\\name': ModelLoad()})
    assert {s.labels["model_name"] for s in parse_prometheus(text)} == {'we"ird\\name'}


class _Answer:
    def __init__(self, status: int, text: str) -> None:
        self.status, self._text = status, text

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def text(self) -> str:
        return self._text


class _Session:
    """aiohttp's ClientSession.get as ProtocolMetrics uses it: one answer per read, counted."""

    def __init__(self, answers: list) -> None:
        self.answers, self.urls = answers, []

    def get(self, url, timeout=None):
        self.urls.append(url)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _text(samples) -> str:
    """Samples in the text format Triton's metrics port writes."""
    lines = []
    for s in samples:
        labels = ",".join('%s="%s"' % kv for kv in s.labels.items())
        lines.append(f"{s.name}{{{labels}}} {s.value}\n")
    return "".join(lines)


def test_one_read_of_tritons_port_serves_the_scrapes_within_max_age_and_a_failure_is_503_not_kept() -> None:
    import asyncio

    pytest.importorskip("aiohttp")
    from model_factory.serving.pool_metrics import ProtocolMetrics

    clock = [100.0]
    busy, idle = _text(_backend("llm", "0", 3, 2, 1, 4)), _text(_backend("llm", "0", 0, 0, 0, 4))
    session = _Session([_Answer(200, busy), ConnectionRefusedError("gone"), _Answer(200, idle)])
    pm = ProtocolMetrics(session, "http://127.0.0.1:8002/metrics", ["llm"], max_age_s=0.25, clock=lambda: clock[0])

    async def scrape() -> tuple[int, dict]:
        resp = await pm.response()
        if resp.status != 200:
            return resp.status, {}
        return 200, {s.name: s.value for s in parse_prometheus(resp.body.decode())}

    async def run() -> None:
        status, first = await scrape()
        assert status == 200 and first[WAITING] == 3 and first[RUNNING] == 2 and first[KV_USAGE] == 0.25
        clock[0] += 0.2  # within max_age: no new read
        assert (await scrape())[1][WAITING] == 3 and pm.reads == 1
        clock[0] += 0.1
        assert (await scrape())[0] == 503  # the port is gone: not answered as an idle pod
        status, values = await scrape()  # the failure was not kept: read again
        assert status == 200 and values[WAITING] == values[RUNNING] == 0 and pm.reads == 3

    asyncio.run(run())
    assert session.urls == ["http://127.0.0.1:8002/metrics"] * 3


def test_prefix_cache_and_speculation_counters_under_vllms_names_summed_over_instances() -> None:
    from model_factory.serving.pool_metrics import VLLM_COUNTERS

    samples = []
    for instance, (queried, hit, drafts, drafted, accepted) in (("0", (100, 60, 5, 20, 12)), ("1", (50, 10, 1, 4, 1))):
        labels = {"model": "llm", "version": "1", "instance": instance}
        samples += _backend("llm", instance, 0, 1, 1, 2) + [
            Sample("model_factory_prefix_cache_queried_tokens_total", labels, float(queried)),
            Sample("model_factory_prefix_cache_hit_tokens_total", labels, float(hit)),
            Sample("model_factory_spec_decode_num_drafts_total", labels, float(drafts)),
            Sample("model_factory_spec_decode_num_draft_tokens_total", labels, float(drafted)),
            Sample("model_factory_spec_decode_num_accepted_tokens_total", labels, float(accepted))]
    text = exposition(model_loads(samples, ["llm", "idle"]), now=0.0)
    for name in VLLM_COUNTERS:
        assert f"# TYPE {name} counter" in text
    got = {(s.name, s.labels["model_name"]): s.value for s in parse_prometheus(text)}
    assert got[("vllm:prefix_cache_queries_total", "llm")] == 150 and got[("vllm:prefix_cache_hits_total", "llm")] == 70
    assert got[("vllm:spec_decode_num_drafts_total", "llm")] == 6
    assert got[("vllm:spec_decode_num_draft_tokens_total", "llm")] == 24
    assert got[("vllm:spec_decode_num_accepted_tokens_total", "llm")] == 13
    assert all(got[(name, "idle")] == 0 for name in VLLM_COUNTERS)  # a model not reported yet: zero, not absent
