"""benchmarks.harness.scaling: the chart's prometheus-adapter rule, parsed and evaluated on scrapes."""

from __future__ import annotations

import pytest
import yaml

from model_factory.measure.bench import Sample
from model_factory.errors import FactoryError
from benchmarks.harness.scaling import RatioRule, evaluate, parse_ratio_rule

SHIPPED = ("sum(rate(nv_inference_queue_duration_us{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>) / "
           "clamp_min(sum(rate(nv_inference_compute_infer_duration_us{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>), 1)")


def scrape(queue_us: float, compute_us: float, models=("a", "b")) -> list[Sample]:
    out = []
    for m in models:  # the pod's models are summed, as sum(...) by (pod) does
        out.append(Sample("nv_inference_queue_duration_us", {"model": m, "version": "1"}, queue_us / len(models)))
        out.append(Sample("nv_inference_compute_infer_duration_us", {"model": m, "version": "1"},
                          compute_us / len(models)))
    return out


def test_the_rule_the_chart_renders_is_the_one_evaluated() -> None:
    chart = pytest.importorskip("helm_python.chart", reason="pip install 'model-factory[test]' (helm-python-sdk)")
    from pathlib import Path

    rendered = chart.Chart.load(Path(__file__).resolve().parents[1] / "deploy" / "helm" / "model-factory").render(
        {}, name="mf", namespace="models")
    text = rendered["model-factory/templates/prometheus-adapter-rules.yaml"]
    query = yaml.safe_load(yaml.safe_load(text)["data"]["config.yaml"])["rules"][0]["metricsQuery"]
    assert query == SHIPPED
    assert parse_ratio_rule(query) == RatioRule("nv_inference_queue_duration_us",
                                                "nv_inference_compute_infer_duration_us", "1m", 1.0)


def test_the_mean_queue_time_rule_has_the_same_shape() -> None:
    rule = parse_ratio_rule(SHIPPED.replace("nv_inference_compute_infer_duration_us", "nv_inference_request_success"))
    assert rule.denominator == "nv_inference_request_success"
    before = [Sample("nv_inference_queue_duration_us", {}, 0.0), Sample("nv_inference_request_success", {}, 10.0)]
    after = [Sample("nv_inference_queue_duration_us", {}, 3e6), Sample("nv_inference_request_success", {}, 70.0)]
    assert evaluate(rule, before, after, 30.0) == pytest.approx(50_000.0)  # 60 requests waited 3 s: 50 ms each


def test_other_shapes_are_refused() -> None:
    with pytest.raises(FactoryError, match="is not 'sum"):
        parse_ratio_rule("avg(nv_inference_queue_duration_us)")
    with pytest.raises(FactoryError, match="two windows"):
        parse_ratio_rule(SHIPPED.replace("[1m])) by (<<.GroupBy>>), 1)", "[5m])) by (<<.GroupBy>>), 1)"))


def test_evaluate_is_the_ratio_of_the_increases() -> None:
    rule = parse_ratio_rule(SHIPPED)
    # 30 s apart: 1.5 s queued and 3 s computing -> 0.5, whatever the window length.
    assert evaluate(rule, scrape(1e6, 2e6), scrape(2.5e6, 5e6), 30.0) == pytest.approx(0.5)
    # Idle: nothing computed, the floor keeps it finite (0, not NaN).
    assert evaluate(rule, scrape(5, 7), scrape(5, 7), 30.0) == 0.0
    # A restarted server (counters reset) counts from zero, as Prometheus's rate does.
    assert evaluate(rule, scrape(9e6, 9e6), scrape(1e6, 4e6), 10.0) == pytest.approx(0.25)
    with pytest.raises(FactoryError, match="apart in time"):
        evaluate(rule, scrape(0, 0), scrape(1, 1), 0.0)
