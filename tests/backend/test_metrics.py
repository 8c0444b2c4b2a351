"""Backend metrics against a fake ``pb_utils`` that enforces Triton's rules and counts its round trips."""

from __future__ import annotations

import gc
import re
import threading
import time
import weakref
from pathlib import Path

import pytest

from model_factory.backend.batching.grouping import CostModel
from model_factory.backend.memory.pool import PoolStats
from model_factory.backend.batching.executor import WindowStats
from model_factory.backend.operations.metrics import FAMILIES, PREFIX, BackendMetrics

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


class FakeMetric:
    calls = 0  # every call is one stub-to-server round trip in Triton

    def __init__(self, family, labels):
        self.family, self.labels = family, labels
        self.value = 0.0
        self.thread_names: set[str] = set()

    def _call(self):
        FakeMetric.calls += 1
        self.thread_names.add(threading.current_thread().name)
        assert self.family.alive, "a metric used after its family was deleted"

    def increment(self, value):
        self._call()
        assert self.family.kind == FakeMetricFamily.COUNTER, "increment on a non-counter"
        assert value >= 0
        self.value += value

    def set(self, value):
        self._call()
        assert self.family.kind == FakeMetricFamily.GAUGE, "set on a non-gauge"
        self.value = value


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: list = []

    def __init__(self, name, description, kind):
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name), name
        assert description
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[FakeMetric] = []
        self.alive = True
        FakeMetricFamily.created.append(weakref.ref(self))

    def Metric(self, labels, buckets=None):  # noqa: N802 - Triton's name
        assert buckets is None, "no histograms here"
        metric = FakeMetric(self, labels)
        self.metrics.append(metric)
        return metric


class FakePbUtils:
    MetricFamily = FakeMetricFamily


def window(groups, lengths, retries=0):
    """A WindowStats as the executor makes it: groups of items with these lengths."""
    computed = sum(len(g) * max(g) for g in lengths)
    return WindowStats(groups=groups, real_tokens=sum(map(sum, lengths)), computed_tokens=computed, retries=retries)


@pytest.fixture
def metrics():
    FakeMetricFamily.created = []
    m = BackendMetrics(FakePbUtils, "minilm", CostModel(2e-3, 1e-7, 0.0), {"flavour": "onnxruntime"},
                       interval_s=None)
    yield m
    m.close()


def _family(m, short):
    return m._families[short]


def _only(m, short, **labels):
    found = [x for x in _family(m, short).metrics if all(x.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, found
    return found[0]


def test_families_are_created_and_kept_alive(metrics):
    gc.collect()
    alive = [ref() for ref in FakeMetricFamily.created]
    assert all(f is not None for f in alive), "a MetricFamily was garbage-collected while in use"
    assert sorted(f.name for f in alive) == sorted(PREFIX + k for k in FAMILIES)


def test_labels_on_every_metric(metrics):
    metrics.observe_window(window([2, 1], [[3, 5], [4]]), seconds=0.01)
    metrics.flush()
    for family in metrics._families.values():
        for metric in family.metrics:
            assert metric.labels["model"] == "minilm"
            assert metric.labels["engine"] == "onnxruntime"


def test_counters_exist_at_zero_before_any_traffic(metrics):
    for short in ("executions_total", "real_tokens_total", "computed_tokens_total", "groups_total"):
        assert _only(metrics, short).value == 0


def test_cost_model_constants_per_profile(metrics):
    assert _only(metrics, "cost_model_a_seconds", profile="all").value == 2e-3
    assert _only(metrics, "cost_model_b_seconds", profile="all").value == 1e-7
    metrics.set_cost_model(CostModel(1.0, 2.0, 3.0), profile=1)
    assert _only(metrics, "cost_model_c_seconds", profile="1").value == 3.0
    assert _only(metrics, "cost_model_c_seconds", profile="all").value == 0.0


def test_windows_are_summed_and_sent_on_flush(metrics):
    metrics.observe_window(window([2, 1], [[3, 5], [4]], retries=2), seconds=0.03)
    metrics.observe_window(window([1], [[8]]), seconds=0.01)
    assert _only(metrics, "executions_total").value == 0, "nothing is sent before a flush"
    metrics.flush()
    assert _only(metrics, "executions_total").value == 2
    assert _only(metrics, "sequences_total").value == 4
    assert _only(metrics, "groups_total").value == 3
    assert _only(metrics, "real_tokens_total").value == 3 + 5 + 4 + 8
    assert _only(metrics, "computed_tokens_total").value == 2 * 5 + 4 + 8
    assert _only(metrics, "group_retries_total").value == 2
    assert _only(metrics, "execute_seconds_total").value == pytest.approx(0.04)
    # The exact padding ratio of all traffic is the ratio of the two token counters.
    ratio = _only(metrics, "computed_tokens_total").value / _only(metrics, "real_tokens_total").value
    assert ratio == pytest.approx(22 / 20)


def test_one_round_trip_per_counter_per_flush_not_per_window(metrics):
    FakeMetric.calls = 0
    for _ in range(100):
        metrics.observe_window(window([2, 1], [[3, 5], [4]]), seconds=0.001)
    assert FakeMetric.calls == 0, "execute() must not pay a round trip per metric"
    metrics.flush()
    assert FakeMetric.calls == 6  # executions, sequences, groups, real and computed tokens, seconds
    metrics.flush()
    assert FakeMetric.calls == 6, "an idle flush sends nothing"


def test_background_thread_flushes_and_close_sends_the_rest():
    FakeMetricFamily.created = []
    m = BackendMetrics(FakePbUtils, "m", interval_s=0.05)
    try:
        m.observe_window(window([1], [[7]]), seconds=0.001)
        deadline = time.monotonic() + 5
        while _only(m, "real_tokens_total").value != 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _only(m, "real_tokens_total").value == 7
        assert _only(m, "real_tokens_total").thread_names == {"model-factory-metrics"}
        m.observe_window(window([1], [[5]]), seconds=0.001)
        metric = _only(m, "real_tokens_total")
    finally:
        m.close()
    assert metric.value == 12, "close() flushes what is pending before dropping the metrics"
    assert not any(t.name == "model-factory-metrics" for t in threading.enumerate())


def test_pool_stats_from_a_source_published_on_flush_only_when_changed():
    FakeMetricFamily.created = []
    stats = {"reserved": 300, "used": 100, "high_water": 500}
    m = BackendMetrics(FakePbUtils, "m", interval_s=None, pool_source=lambda: stats)
    try:
        m.flush()
        assert _only(m, "pool_reserved_bytes").value == 300
        assert _only(m, "pool_used_bytes").value == 100
        assert _only(m, "pool_high_water_bytes").value == 500
        FakeMetric.calls = 0
        m.flush()
        assert FakeMetric.calls == 0, "unchanged pool bytes are not re-sent"
        m.set_pool_stats(PoolStats(reserved=400, used=0, high_water=500, used_high_water=200))
        assert _only(m, "pool_reserved_bytes").value == 400
    finally:
        m.close()


def test_no_pool_no_pool_gauges():
    FakeMetricFamily.created = []
    m = BackendMetrics(FakePbUtils, "m", interval_s=None, pool_source=lambda: {})
    m.flush()
    assert _family(m, "pool_used_bytes").metrics == []
    m.close()


def test_a_failing_flush_does_not_stop_the_flusher():
    FakeMetricFamily.created = []
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("IPC hiccup")
        return {"reserved": 1, "used": 1, "high_water": 1}

    m = BackendMetrics(FakePbUtils, "m", interval_s=0.02, pool_source=flaky)
    try:
        deadline = time.monotonic() + 5
        while not _family(m, "pool_used_bytes").metrics and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _only(m, "pool_used_bytes").value == 1
    finally:
        m.close()


def test_every_metric_is_documented():
    text = DOCS.read_text()
    for short in FAMILIES:
        assert f"`{PREFIX}{short}`" in text, f"{PREFIX}{short} is not in docs/metrics.md"


def test_a_cost_model_per_profile_is_published_per_profile():
    from model_factory.backend.batching.grouping import ProfileCostModel

    FakeMetricFamily.created = []
    cost = ProfileCostModel((32, 128), (CostModel(1e-3, 1e-7, 0.0), CostModel(4e-3, 3e-7, 2e-9)))
    m = BackendMetrics(FakePbUtils, "m", cost, interval_s=None)
    try:
        assert _only(m, "cost_model_a_seconds", profile="0").value == 1e-3
        assert _only(m, "cost_model_c_seconds", profile="1").value == 2e-9
        assert not [x for x in _family(m, "cost_model_a_seconds").metrics if x.labels["profile"] == "all"]
    finally:
        m.close()


def test_a_learning_estimator_is_published_with_its_uncertainty_and_resent_when_it_moves():
    from model_factory.backend.batching.adaptive_planner import PlanReport
    from model_factory.backend.batching.cost_estimator import CostEstimator

    FakeMetricFamily.created = []
    est = CostEstimator((128,), CostModel(2e-3, 1e-4, 0.0))
    m = BackendMetrics(FakePbUtils, "m", est, interval_s=None)
    try:
        assert _only(m, "cost_model_a_seconds", profile="all").value == 2e-3
        assert _only(m, "cost_model_b_stderr_seconds", profile="all").value == float("inf")  # nothing seen yet
        for i in range(160):
            n, length = ((1, 8), (8, 100), (2, 40), (4, 16), (16, 64))[i % 5]
            est.observe(n, length, 1e-3 + 5e-5 * n * length * (1.05 if i % 4 < 2 else 0.95))
        stats = WindowStats(groups=[1, 8], real_tokens=108, computed_tokens=808, timings=2, refits=1, outliers=0,
                            plan_changes=1, plan=PlanReport(0.05, 0.04, 0.06, 0.07, True))
        m.observe_window(stats, 0.06)
        calls = FakeMetric.calls
        m.flush()
        assert _only(m, "cost_model_a_seconds", profile="all").value == pytest.approx(1e-3, rel=0.1)
        assert 0 < _only(m, "cost_model_b_stderr_seconds", profile="all").value < 1e-5
        assert _only(m, "cost_model_explorations_total").value == 1
        assert _only(m, "cost_model_plan_changes_total").value == 1
        assert _only(m, "cost_model_modelled_seconds_total", plan="singles").value == 0.07
        assert _only(m, "cost_model_modelled_seconds_total", plan="chosen").value == 0.05
        sent = FakeMetric.calls - calls
        m.flush()  # nothing new: no round trips
        assert FakeMetric.calls - calls == sent
    finally:
        m.close()


def test_trace_spans_sent_and_dropped_are_counted_from_the_exporter_totals():
    FakeMetricFamily.created = []
    m = BackendMetrics(FakePbUtils, "m", interval_s=None)
    try:
        assert _only(m, "trace_spans_total", outcome="sent").value == 0  # listed at 0 from load
        m.set_trace_spans(sent=40, dropped=0)
        m.set_trace_spans(sent=40, dropped=0)  # unchanged totals add nothing
        m.set_trace_spans(sent=95, dropped=7)
        m.flush()
        assert _only(m, "trace_spans_total", outcome="sent").value == 95
        assert _only(m, "trace_spans_total", outcome="dropped").value == 7
    finally:
        m.close()


def test_degraded_requests_are_counted_by_precision():
    FakeMetricFamily.created = []
    m = BackendMetrics(FakePbUtils, "m", interval_s=None)
    try:
        m.add_degraded("int8", 5)
        m.add_degraded("int8", 3)
        m.flush()
        assert _only(m, "degraded_requests_total", precision="int8").value == 8
    finally:
        m.close()
