"""Backend metrics against a fake ``pb_utils`` that enforces Triton's rules."""

from __future__ import annotations

import gc
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest

from model_factory.backend.grouping import CostModel
from model_factory.backend.memory_pool import PoolStats
from model_factory.backend.metrics import FAMILIES, PREFIX, BackendMetrics

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


class FakeMetric:
    def __init__(self, family, labels, buckets):
        self.family, self.labels, self.buckets = family, labels, buckets
        self.value = 0.0
        self.observations: list[float] = []

    def increment(self, value):
        assert self.family.kind == FakeMetricFamily.COUNTER, "increment on a non-counter"
        assert value >= 0
        self.value += value

    def set(self, value):
        assert self.family.kind == FakeMetricFamily.GAUGE, "set on a non-gauge"
        self.value = value

    def observe(self, value):
        assert self.family.kind == FakeMetricFamily.HISTOGRAM, "observe on a non-histogram"
        self.observations.append(value)


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: list = []

    def __init__(self, name, description, kind):
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name), name
        assert description
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[FakeMetric] = []
        FakeMetricFamily.created.append(weakref.ref(self))

    def Metric(self, labels, buckets=None):  # noqa: N802 - Triton's name
        if self.kind == "histogram":
            assert isinstance(buckets, list) and buckets == sorted(buckets), "histograms need sorted buckets"
        else:
            assert buckets is None, "buckets only for histograms"
        metric = FakeMetric(self, labels, buckets)
        self.metrics.append(metric)
        return metric


class FakePbUtils:
    MetricFamily = FakeMetricFamily


class OldMetricFamily:
    """A Triton without histograms: no HISTOGRAM kind at all."""

    COUNTER, GAUGE = FakeMetricFamily.COUNTER, FakeMetricFamily.GAUGE
    __init__ = FakeMetricFamily.__init__
    Metric = FakeMetricFamily.Metric


@dataclass
class Window:
    groups: list
    padding_ratio: float
    retries: int = 0


@pytest.fixture
def metrics():
    FakeMetricFamily.created = []
    m = BackendMetrics(FakePbUtils, "minilm", CostModel(2e-3, 1e-7, 0.0), {"flavour": "onnxruntime"})
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
    metrics.observe_window(Window([3, 1], 1.2), seconds=0.01)
    for family in metrics._families.values():
        for metric in family.metrics:
            assert metric.labels["model"] == "minilm"
            assert metric.labels["engine"] == "onnxruntime"


def test_cost_model_constants_per_profile(metrics):
    assert _only(metrics, "cost_model_a_seconds", profile="all").value == 2e-3
    assert _only(metrics, "cost_model_b_seconds", profile="all").value == 1e-7
    metrics.set_cost_model(CostModel(1.0, 2.0, 3.0), profile=1)
    assert _only(metrics, "cost_model_c_seconds", profile="1").value == 3.0
    assert _only(metrics, "cost_model_c_seconds", profile="all").value == 0.0


def test_window_records_groups_sizes_padding_and_time(metrics):
    metrics.observe_window(Window([4, 2, 1], 1.25, retries=2), seconds=0.03)
    metrics.observe_window(Window([8], 2.0), seconds=0.01)
    assert _only(metrics, "groups_per_execute").observations == [3, 1]
    assert _only(metrics, "group_size").observations == [4, 2, 1, 8]
    assert _only(metrics, "padding_ratio").observations == [1.25, 2.0]
    assert _only(metrics, "execute_seconds").observations == [0.03, 0.01]
    assert _only(metrics, "group_retries_total").value == 2


def test_empty_window_records_nothing(metrics):
    metrics.observe_window(Window([], 1.0))
    assert _family(metrics, "groups_per_execute").metrics == []


def test_queue_time_and_pool_stats(metrics):
    metrics.observe_queue_time(0.004)
    metrics.observe_queue_time(-1e-6)  # clock skew never goes negative
    assert _only(metrics, "queue_seconds").observations == [0.004, 0.0]
    metrics.set_pool_stats(PoolStats(reserved=300, used=100, high_water=500, used_high_water=200))
    assert _only(metrics, "pool_reserved_bytes").value == 300
    assert _only(metrics, "pool_used_bytes").value == 100
    assert _only(metrics, "pool_high_water_bytes").value == 500


def test_histograms_fall_back_to_gauges_on_old_triton():
    class OldPbUtils:
        MetricFamily = OldMetricFamily

    m = BackendMetrics(OldPbUtils, "m")
    m.observe_window(Window([2, 2], 1.5))
    assert m._families["padding_ratio"].kind == OldMetricFamily.GAUGE
    assert [x.value for x in m._families["padding_ratio"].metrics] == [1.5]


def test_every_metric_is_documented():
    text = DOCS.read_text()
    for short in FAMILIES:
        assert f"`{PREFIX}{short}`" in text, f"{PREFIX}{short} is not in docs/metrics.md"
