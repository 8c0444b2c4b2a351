"""OpenTelemetry on the real server: the request's span and the backend's under it reach an OTLP/HTTP receiver
started here on 127.0.0.1, with the backend as the trace source (the default: it joins the client's traceparent
header) and with Triton's tracer as the source; the span tree of real requests is asserted, and no span holds
their text."""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.request

import pytest

pytestmark = pytest.mark.integration

TEXTS = ["the lighthouse keeper counted ships", "a kettle whistled in the empty kitchen of the old farmhouse"]


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, JSON bodies (what Triton 2.51 and the backend send)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.content_types: set[str] = set()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/traces":
                    outer.bodies.append(body)
                    outer.content_types.add(self.headers.get("Content-Type", ""))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"127.0.0.1:{self.httpd.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[dict]:
        out = []
        for body in list(self.bodies):
            for rs in json.loads(body)["resourceSpans"]:
                service = {a["key"]: a["value"].get("stringValue") for a in rs["resource"]["attributes"]}
                for ss in rs["scopeSpans"]:
                    for s in ss["spans"]:
                        s["service"] = service.get("service.name")
                        s["attrs"] = {a["key"]: next(iter(a["value"].values())) for a in s.get("attributes", [])}
                        out.append(s)
        return out

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _traced_server(repository, source: str):
    """A server tracing every request into a receiver of its own, with ``source`` opening the request's span."""
    from model_factory.serving.server import ServerOptions, TritonServer

    receiver = Receiver()
    srv = TritonServer(repository, options=ServerOptions(0, 0, 0, trace_endpoint=receiver.endpoint, trace_rate=1,
                                                         trace_source=source))
    srv.start()
    yield srv, receiver
    srv.stop()
    receiver.close()


@pytest.fixture(scope="module")
def traced(minilm_repository):
    yield from _traced_server(minilm_repository, "backend")


@pytest.fixture(scope="module")
def traced_by_triton(minilm_repository):
    yield from _traced_server(minilm_repository, "triton")


def _infer(server, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/minilm/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


WORK = {"validate", "tokenize", "group", "engine_run", "respond"}


def _spans_of(receiver, request_id: str, names: set[str], timeout_s: float = 20.0) -> tuple[list[dict], list[dict]]:
    """(all spans received, the backend's spans of ``request_id``) once ``names`` are among the latter."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.spans()
        mine = [s for s in spans if s["attrs"].get("model_factory.request_id") == request_id]
        if names <= {s["name"] for s in mine} or time.monotonic() > deadline:
            return spans, mine
        time.sleep(0.5)


def test_the_backend_joins_the_client_s_trace_over_http_and_grpc_and_starts_one_for_a_request_without(
        traced) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient

    server, receiver = traced
    client_trace, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    body = {"id": "joined-http", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": TEXTS}],
            "outputs": [{"name": "embedding"}]}
    assert _infer(server, body, {"traceparent": f"00-{client_trace}-{client_span}-01"})["id"] == "joined-http"
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        text = grpcclient.InferInput("text", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[TEXTS[0].encode()]], dtype=object))
        client.infer("minilm", [text], request_id="joined-grpc",
                     headers={"traceparent": f"00-{client_trace}-{'c' * 16}-01"})
        client.infer("minilm", [text], request_id="not-sampled",
                     headers={"traceparent": f"00-{client_trace}-{'d' * 16}-00"})
    _infer(server, {**body, "id": "started-here"})
    for rid, parent in (("joined-http", client_span), ("joined-grpc", "c" * 16), ("started-here", None)):
        spans, mine = _spans_of(receiver, rid, WORK | {"request"} if rid != "joined-grpc" else {"request", "respond"})
        (request,) = [s for s in mine if s["name"] == "request"]
        assert request["service"] == "model-factory-backend" and request["kind"] == 2
        if parent:  # under the client's span, in the client's trace
            assert request["traceId"] == client_trace and request["parentSpanId"] == parent, request
        else:  # the root of a trace of its own
            assert not request.get("parentSpanId") and request["traceId"] != client_trace
        for s in mine:
            if s is not request:
                assert s["traceId"] == request["traceId"] and s["parentSpanId"] == request["spanId"], s
                assert int(request["startTimeUnixNano"]) <= int(s["startTimeUnixNano"])
                assert int(s["endTimeUnixNano"]) <= int(request["endTimeUnixNano"])
    spans = receiver.spans()
    assert not [s for s in spans if s["attrs"].get("model_factory.request_id") == "not-sampled"]
    assert not [s for s in spans if s["service"] != "model-factory-backend"]  # Triton's tracer is off
    everything = b"".join(receiver.bodies).decode()
    for text in TEXTS:
        assert text not in everything and "lighthouse" not in everything


def test_a_request_has_triton_spans_and_the_backend_spans_under_its_model_span(traced_by_triton) -> None:
    server, receiver = traced_by_triton
    body = {"id": "trace-me-1", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": TEXTS}],
            "outputs": [{"name": "embedding"}]}
    assert _infer(server, body)["id"] == "trace-me-1"
    want = {"validate", "tokenize", "group", "engine_run", "respond"}
    deadline = time.monotonic() + 20  # both exporters batch (Triton's every 5 s)
    while True:
        spans = receiver.spans()
        model_spans = [s for s in spans if s["name"] == "minilm" and s["attrs"].get("triton.request_id") == "trace-me-1"]
        mine = [s for s in spans if s["attrs"].get("model_factory.request_id") == "trace-me-1"]
        if model_spans and want <= {s["name"] for s in mine} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert model_spans, [s["name"] for s in spans]
    model_span = model_spans[0]
    by_id = {s["spanId"]: s for s in spans}
    root = by_id[model_span["parentSpanId"]]
    assert root["name"] == "InferRequest" and not root.get("parentSpanId")
    assert want <= {s["name"] for s in mine}, sorted(s["name"] for s in mine)
    for s in mine:  # children of Triton's model span, in its trace, inside its time
        assert s["traceId"] == model_span["traceId"] and s["parentSpanId"] == model_span["spanId"], s
        assert s["service"] == "model-factory-backend"
        assert int(model_span["startTimeUnixNano"]) <= int(s["startTimeUnixNano"]) <= int(s["endTimeUnixNano"])
        assert int(s["endTimeUnixNano"]) <= int(model_span["endTimeUnixNano"]) + 50_000_000
    (run,) = [s for s in mine if s["name"] == "engine_run"]  # two short texts: one launch
    assert int(run["attrs"]["sequences"]) == 2
    compute = [s for s in spans if s["name"] == "compute" and s["parentSpanId"] == model_span["spanId"]]
    assert compute  # Triton's own compute span beside ours
    everything = b"".join(receiver.bodies).decode()
    for text in TEXTS:
        assert text not in everything and "lighthouse" not in everything


def test_the_backend_counts_the_spans_it_sent(traced) -> None:
    """model_factory_trace_spans_total{outcome="sent"} follows what the collector got from the backend: more than
    none, never more than it got (each instance reports its exporter's total at its next window)."""
    from model_factory.measure import bench

    server, receiver = traced
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": TEXTS[:1]}],
            "outputs": [{"name": "embedding"}]}
    deadline = time.monotonic() + 30
    while True:
        _infer(server, body)  # the counter is read from the exporter at each window
        received = sum(1 for s in receiver.spans() if s["service"] == "model-factory-backend")
        samples = bench.scrape_metrics(server.metrics_url)
        sent = bench.metric_total(samples, "model_factory_trace_spans_total", model="minilm", outcome="sent") or 0
        if sent > 0 or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    received = sum(1 for s in receiver.spans() if s["service"] == "model-factory-backend")
    assert 0 < sent <= received, (sent, received)
    assert bench.metric_total(samples, "model_factory_trace_spans_total", model="minilm", outcome="dropped") == 0
