"""The backend's span pieces alone: the traceparent Triton hands over, the span tree of a window, and an
exporter whose collector is away (it drops and counts, never raises)."""

from __future__ import annotations

import json

from model_factory.backend.batching.executor import GroupedExecutor
from model_factory.backend.batching.grouping import CostModel
from model_factory.backend.operations.tracing import (Sampler, SpanExporter, TraceParent, encode_window, export_body,
                                          parse_context, window_spans)

import numpy as np

TRACE, SPAN = "15af0f3181d746d428259278cb59a131", "1f2b434d23b8c29c"


def test_the_traceparent_is_read_and_an_unsampled_or_broken_one_is_not() -> None:
    assert parse_context(json.dumps({"traceparent": f"00-{TRACE}-{SPAN}-01"})) == TraceParent(TRACE, SPAN)
    assert parse_context(json.dumps({"traceparent": f"00-{TRACE}-{SPAN}-00"})) is None  # not sampled
    assert parse_context('{"traceparent": "garbage"}') is None
    assert parse_context(None) is None and parse_context("") is None


class Engine:
    input_names, output_names = ("input_ids", "attention_mask"), ("embedding",)

    def run(self, feeds, profile):
        return {"embedding": np.ones((feeds["input_ids"].shape[0], 4), np.float32)}


def test_a_window_s_spans_go_under_each_sampled_request_that_they_served() -> None:
    ex = GroupedExecutor(Engine(), CostModel(1.0, 1e-9, 0.0), max_batch=8, buckets=(16,),
                         seq_inputs=frozenset({"input_ids", "attention_mask"}), seq_outputs=frozenset())
    ex.record_spans = True
    item = {"input_ids": np.ones(5, np.int64), "attention_mask": np.ones(5, np.int64)}
    _, stats = ex.run([[item], [item, item]])
    assert [s[0] for s in stats.spans] == ["group", "engine_run"]  # a launch this costly: one group
    parents = [TraceParent(TRACE, SPAN), None]  # the second request was not sampled
    own = {0: [("validate", 10, 20, {"sequences": 1})]}
    spans = window_spans(parents, ["r0", "r1"], own, stats.spans)
    assert [s["name"] for s in spans] == ["validate", "group", "engine_run"]
    assert all(s["traceId"] == TRACE and s["parentSpanId"] == SPAN and len(s["spanId"]) == 16 for s in spans)
    run = spans[-1]
    attrs = {a["key"]: a["value"] for a in run["attributes"]}
    assert attrs["model_factory.request_id"] == {"stringValue": "r0"} and attrs["sequences"] == {"intValue": "3"}
    body = json.loads(export_body(spans, {"service.name": "x"}))
    assert body["resourceSpans"][0]["scopeSpans"][0]["spans"] == spans


def test_an_exporter_without_a_collector_drops_and_counts() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = SpanExporter(f"127.0.0.1:{port}/v1/traces", {}, interval_s=60, timeout_s=0.5)
    exporter.add([{"name": "x"}] * 3)
    exporter.close()
    assert exporter.dropped == 3 and exporter.sent == 0


def _without_span_ids(body: bytes) -> list[dict]:
    spans = json.loads(body)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert all(len(s["spanId"]) == 16 for s in spans)
    return [{k: v for k, v in s.items() if k != "spanId"} for s in spans]


def test_the_export_thread_s_json_text_is_the_same_spans() -> None:
    """encode_window (what the export thread writes) and window_spans (dicts) are one OTLP document, request ids
    needing JSON escapes included."""
    parents = [TraceParent(TRACE, SPAN), None, TraceParent(TRACE, "2" * 16)]
    ids = ["r0", "r1", 'we"ird\\id é\n']
    own = {0: [("validate", 10, 20, {"sequences": 1, "refused": False})], 2: [("respond", 5, 6, {"error": True})]}
    shared = [("engine_run", 30, 40, [0, 2], {"sequences": 2, "padded_length": 7, "share": 0.5})]
    dicts = export_body(window_spans(parents, ids, own, shared), {"service.name": "x"})
    text = export_body(encode_window(parents, ids, own, shared), {"service.name": "x"})
    assert json.loads(dicts)["resourceSpans"][0]["resource"] == json.loads(text)["resourceSpans"][0]["resource"]
    assert _without_span_ids(dicts) == _without_span_ids(text) and len(_without_span_ids(text)) == 4


def test_a_queued_window_reaches_a_collector_as_its_spans() -> None:
    """add_window only queues the timings; the export thread makes and sends the spans."""
    import http.server
    import threading

    got = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        exporter = SpanExporter(f"127.0.0.1:{httpd.server_address[1]}/v1/traces", {"model": "m"}, interval_s=60)
        exporter.add_window([TraceParent(TRACE, SPAN)], ["r0"], {0: [("validate", 1, 2, {})]},
                            [("group", 2, 3, [0], {"groups": 1})])
        exporter.close()  # the last flush sends what is queued
    finally:
        httpd.shutdown()
    assert (exporter.sent, exporter.dropped) == (2, 0)
    spans = got[0]["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert [s["name"] for s in spans] == ["validate", "group"] and all(s["parentSpanId"] == SPAN for s in spans)
    resource = {a["key"]: a["value"] for a in got[0]["resourceSpans"][0]["resource"]["attributes"]}
    assert resource["model"] == {"stringValue": "m"}


def test_a_window_that_finds_the_queue_full_is_counted_as_the_spans_it_would_have_made(monkeypatch) -> None:
    import socket

    from model_factory.backend.operations import tracing

    monkeypatch.setattr(tracing, "MAX_QUEUED", 1)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = SpanExporter(f"127.0.0.1:{port}/v1/traces", {}, interval_s=60, timeout_s=0.5)
    window = ([TraceParent(TRACE, SPAN), None, TraceParent(TRACE, SPAN)], ["a", "b", "c"],
              {0: [("validate", 1, 2, {})], 1: [("validate", 1, 2, {})]}, [("group", 2, 3, [0, 1, 2], {})])
    exporter.add_window(*window)  # queued
    exporter.add_window(*window)  # full: 3 spans (validate and group of request 0, group of request 2) dropped
    assert exporter.dropped == len(encode_window(*window)) == 3
    exporter.close()  # the queued one fails to send: counted too
    assert (exporter.sent, exporter.dropped) == (0, 6)


def test_the_backend_s_sampler_joins_a_sampled_traceparent_respects_an_unsampled_one_and_samples_the_rest() -> None:
    sampler = Sampler(rate=3)
    # A sampled header (as Triton forwards it: a request parameter, any case): the client's trace, a new span of
    # ours under the client's span.
    joined = sampler.parent({"TraceParent": f"00-{TRACE}-{SPAN}-01", "x-request-id": "a"})
    assert joined.trace_id == TRACE and joined.remote_parent == SPAN and joined.span_id not in (SPAN, "0" * 16)
    assert len(joined.span_id) == 16
    assert sampler.parent({"traceparent": f"00-{TRACE}-{SPAN}-00"}) is None  # the client decided: not sampled
    # Without one (or with one that is not a traceparent): one request in three, each a trace of its own.
    picked = [sampler.parent(p) for p in ([{}, {"x-request-id": "b"}, {}, {"traceparent": "garbage"}] * 3)]
    roots = [p for p in picked if p is not None]
    assert [p is not None for p in picked[:6]] == [True, False, False, True, False, False]
    assert len(roots) == 4 and len({p.trace_id for p in roots}) == 4
    assert all(p.remote_parent == "" and len(p.trace_id) == 32 for p in roots)
    assert Sampler.from_env({"MODEL_FACTORY_TRACE_SOURCE": "triton"}) is None
    assert Sampler.from_env({"MODEL_FACTORY_TRACE_RATE": "100"}).rate == 100


def test_a_request_span_the_backend_opened_holds_its_work_under_the_client_s_span() -> None:
    joined = TraceParent(TRACE, "3" * 16, SPAN)  # under the client's span
    started = TraceParent("4" * 32, "5" * 16, "")  # a trace the backend started
    own = {0: [("validate", 100, 120, {}), ("respond", 400, 420, {})], 1: [("validate", 90, 110, {})]}
    shared = [("engine_run", 150, 380, (0, 1), {"sequences": 2})]
    spans = window_spans([joined, started], ["r0", "r1"], own, shared)
    requests = {s["traceId"]: s for s in spans if s["name"] == "request"}
    assert requests[TRACE]["spanId"] == "3" * 16 and requests[TRACE]["parentSpanId"] == SPAN
    assert (requests[TRACE]["startTimeUnixNano"], requests[TRACE]["endTimeUnixNano"]) == ("100", "420")
    assert requests[TRACE]["kind"] == 2  # a server span
    assert "parentSpanId" not in requests["4" * 32]  # the root of its trace
    assert (requests["4" * 32]["startTimeUnixNano"], requests["4" * 32]["endTimeUnixNano"]) == ("90", "380")
    work = [s for s in spans if s["name"] != "request"]
    assert all(s["parentSpanId"] == ("3" * 16 if s["traceId"] == TRACE else "5" * 16) for s in work)
    # The export thread's text form is the same document.
    text = [json.loads(t) for t in encode_window([joined, started], ["r0", "r1"], own, shared)]
    strip = lambda ss: sorted((s["name"], s["traceId"], s.get("parentSpanId"), s["startTimeUnixNano"])  # noqa: E731
                              for s in ss)
    assert strip(text) == strip(spans)
    assert [s["spanId"] for s in text if s["name"] == "request"] == ["3" * 16, "5" * 16]
