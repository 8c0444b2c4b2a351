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
