"""The Grafana dashboard in deploy/grafana names only metrics that a real scrape of our served model contains.

The server is the bundled Triton serving MiniLM with the model-factory backend (the
session's ``triton`` fixture, CPU instances). The GPU memory pool gauges are exported
by GPU instances only, and the text-generation series by text-generation models only:
they must be exactly the metrics such a scrape lacks, and be the backend's own declared
families. The text-generation series are checked against a real scrape of the tests' tiny
Llama served by the decoupled model, after one request: every series the backend declares
(``generation_metrics``) is on the dashboard, and every one the dashboard reads is scraped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "model-factory.json"
# PromQL words a query may use besides metric names.
PROMQL = {"sum", "max", "min", "avg", "count", "by", "without", "rate", "irate", "increase", "on", "ignoring",
          "group_left", "group_right", "label_values", "histogram_quantile", "clamp_min", "and", "or", "unless"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads; fails on any word that is neither a metric nor PromQL."""
    bare = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # range selectors ($__rate_interval)
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)  # grouping labels
    bare = re.sub(r",\s*[a-z_]+\s*\)", ")", bare)  # label_values(metric, label): the label
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare))
    unknown = {w for w in words - PROMQL if not w.startswith(("nv_", "model_factory_"))}
    assert not unknown, f"{expr!r} uses {unknown}: neither a metric of ours nor a PromQL word this test knows"
    return words - PROMQL


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queries += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return queries


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["schemaVersion"] >= 36
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("queue-to-compute", "latency", "padding", "groups", "pool bytes", "rejected",
                  "time to first token", "inter-token latency", "jitter", "kv cache", "running and waiting",
                  "preemptions"):
        assert topic in titles, topic
    for p in dash["panels"]:
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
    assert metric_names('sum by (model) (rate(nv_inference_count{model=~"$model"}[$__rate_interval]))') == \
        {"nv_inference_count"}


# Metrics the backend defines that have no panel, each with its reason. Every other one must be on the dashboard.
NOT_ON_THE_DASHBOARD = {
    **{f"model_factory_cost_model_{c}_stderr_seconds": "+Inf until the timings can tell the constants apart: "
       "read from /metrics when tuning (docs/metrics.md); the constants' panel names them" for c in "abc"},
}


def backend_metric_names() -> set[str]:
    """Every metric family the backend defines: the batching backend's and the text-generation instance's."""
    from model_factory.backend.generation import metrics as gen
    from model_factory.backend.operations.metrics import FAMILIES, PREFIX

    names = {PREFIX + short for short in FAMILIES}
    names |= {PREFIX + n + suffix for n in gen.HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
    return names | {PREFIX + n for n in (*gen.COUNTERS, *gen.GAUGES)}


def test_every_metric_the_backend_defines_is_on_the_dashboard_or_allowed_off_it():
    defined = backend_metric_names()
    used = set().union(*(metric_names(q) for q in dashboard_queries()))
    allowed = set(NOT_ON_THE_DASHBOARD)  # the text-generation instance's metrics included: each has its panel
    assert set(NOT_ON_THE_DASHBOARD) <= defined, sorted(set(NOT_ON_THE_DASHBOARD) - defined)  # no stale entry
    missing = defined - used - allowed
    assert not missing, f"metrics with neither a panel nor a reason in NOT_ON_THE_DASHBOARD: {sorted(missing)}"
    # Issue 30's series in particular: texts over the limit, tokens cut, events dropped, backend trace spans.
    for name in ("model_factory_long_inputs_total", "model_factory_truncated_tokens_total",
                 "model_factory_events_dropped_total", "model_factory_trace_spans_total"):
        assert name in used, name


def test_every_query_names_a_metric_of_a_real_scrape(triton):
    import urllib.request

    from model_factory.backend.operations.metrics import FAMILIES, PREFIX
    from model_factory.measure.bench import parse_prometheus

    url = triton.metrics_url if "://" in triton.metrics_url else f"http://{triton.metrics_url}"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    scraped = {s.name for s in parse_prometheus(text)}
    assert "model_factory_executions_total" in scraped  # our backend's metrics are there, not only Triton's
    used = set().union(*(metric_names(q) for q in dashboard_queries()))
    gpu_only = {PREFIX + name for name in FAMILIES if name.startswith("pool_")}
    # Counted only by a model packaged with degrade_to, from its first degraded window (tests/integration/
    # test_degrade_serving.py scrapes it there).
    degrade_only = {PREFIX + "degraded_requests_total"}
    assert used - scraped == gpu_only | degrade_only | generation_series(), sorted(used - scraped)
    assert gpu_only <= used  # the pool bytes are on the dashboard, for GPU instances


def generation_series() -> set[str]:
    """Every series a text-generation instance exports (a histogram's _bucket, _sum and _count)."""
    from model_factory.backend.generation.metrics import COUNTERS, GAUGES, HISTOGRAMS
    from model_factory.backend.operations.metrics import PREFIX

    return ({PREFIX + h + suffix for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
            | {PREFIX + name for name in (*COUNTERS, *GAUGES)})


@pytest.fixture(scope="module")
def generative_server(tiny_llm, tmp_path_factory):
    from model_factory.serving.server import ServerOptions, TritonServer
    from tests.generative_repository import layout_generative_model

    hf, onnx_dir = tiny_llm
    repo = tmp_path_factory.mktemp("dashboard-gen-repo")
    layout_generative_model(hf, onnx_dir, repo, "tiny_llm", memory_budget_mib=128, max_active_sequences=2)
    server = TritonServer(repo, options=ServerOptions(0, 0, 0)).start()
    assert not server.load_errors, server.load_errors
    yield server
    assert server.stop() == 0, server.log_tail(30)


def test_every_generation_series_is_on_the_dashboard_and_in_a_real_scrape(generative_server):
    import time
    import urllib.request

    from model_factory.measure.bench import scrape_metrics

    server = generative_server
    used = set().union(*(metric_names(q) for q in dashboard_queries()))
    missing = generation_series() - used
    assert not missing, f"generation series without a panel: {sorted(missing)}"
    body = json.dumps({"text_input": "hello", "max_tokens": 4, "min_tokens": 4}).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/tiny_llm/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert json.loads(r.read())["finish_reason"] in ("length", ["length"])
    deadline = time.monotonic() + 15  # the instance sends its sums about once a second
    while True:
        scraped = {s.name for s in scrape_metrics(server.metrics_url)}
        if "model_factory_generate_requests_total" in scraped or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    generation_used = {m for m in used if m in generation_series()}
    assert generation_used <= scraped, sorted(generation_used - scraped)
