"""The chart's autoscaling signal on the real server: under the HPA target at low load, over it when saturated.

Closed-loop clients drive the session's MiniLM server (one instance, max batch 64); Triton's
/metrics is scraped around each step and the prometheus-adapter rule rendered from the Helm
chart is evaluated on the two scrapes (benchmarks/bench_autoscaling.py measures the whole curve).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "model-factory"
TEXTS = Path(__file__).resolve().parents[2] / "benchmarks" / "texts.txt"


def chart_rule_and_target() -> tuple[str, float]:
    chart = pytest.importorskip("helm_python.chart", reason="pip install 'model-factory[test]' (helm-python-sdk)")
    docs = [d for text in chart.Chart.load(CHART).render({}, name="mf", namespace="models").values()
            for d in yaml.safe_load_all(text) if d]
    rules = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("adapter-rules"))
    target = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["target"]
    value = target["averageValue"]
    return (yaml.safe_load(rules["data"]["config.yaml"])["rules"][0]["metricsQuery"],
            float(value[:-1]) / 1000 if value.endswith("m") else float(value))


def test_queue_to_compute_ratio_crosses_the_target_only_when_the_replica_saturates(triton, minilm_export) -> None:
    from model_factory.bench import draw_texts, load_texts, load_tokenizer, make_payloads, run_load, settled_scrape
    from model_factory.scaling import evaluate, parse_ratio_rule

    query, target = chart_rule_and_target()
    rule = parse_ratio_rule(query)
    payloads = make_payloads(draw_texts(load_texts(TEXTS), 600, seed=1), load_tokenizer(minilm_export.tokenizer_dir, 128))
    run_load(triton.http_url, "minilm", payloads[:32], concurrency=8, warmup=0)  # load-time warm-up done

    def ratio(concurrency: int, count: int, gap_s: float = 0.0) -> float:
        before = settled_scrape(triton.metrics_url, "minilm")
        t0 = time.monotonic()
        if gap_s:  # low load: one client pausing after each answer, so each request finds the instance idle
            for i in range(count):
                assert run_load(triton.http_url, "minilm", payloads[i:i + 1], concurrency=1, warmup=0).errors == 0
                time.sleep(gap_s)
        else:
            assert run_load(triton.http_url, "minilm", payloads[:count], concurrency=concurrency, warmup=0).errors == 0
        after = settled_scrape(triton.metrics_url, "minilm")
        return evaluate(rule, before, after, time.monotonic() - t0)

    low = ratio(1, 20, gap_s=0.05)
    # Closed loop: 3x the max batch of clients keeps two batches' worth of requests waiting.
    saturated = ratio(192, 384)
    assert low < target < saturated, (low, target, saturated)
