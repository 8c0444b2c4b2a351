"""OpenTelemetry spans of the backend's work, under the request's span.

``serve --trace-endpoint URL --trace-rate R`` gives the backend an OTLP/HTTP endpoint in
``$MODEL_FACTORY_TRACE_ENDPOINT`` and a trace source in ``$MODEL_FACTORY_TRACE_SOURCE``:

- ``backend`` (the default): Triton's tracer stays off (Triton 2.51's crashes the server with SIGSEGV after some
  thousands of traced requests at a hundred or more a second: a trace freed while its own mutex is held,
  triton-inference-server/server#7795, fixed by #8144 in a later release; measured here by
  benchmarks/bench_observability.py). The backend opens the request's span itself (``request``, a server span)
  under the client's W3C ``traceparent`` header (forwarded by Triton as a request parameter) when the client sent
  a sampled one; a request with an unsampled one is not traced; one without is sampled one in
  ``$MODEL_FACTORY_TRACE_RATE`` and starts its own trace (:class:`Sampler`).
- ``triton``: Triton's OpenTelemetry tracer samples one request in R and hands the backend a W3C ``traceparent``
  (``request.trace().get_context()``) naming the model's span; the backend's spans go under it.

Either way the backend's spans are ``validate`` (decode and check), ``tokenize``, ``group`` (the window's split),
``engine_run`` (each launch holding the request's sequences) and ``respond``.

Exported as OTLP/HTTP JSON (what Triton 2.51's own exporter sends: ids in hex, times as decimal strings) by a
background thread, about once a second, from a bounded queue: a slow or absent collector drops spans (counted),
never slows a request. The request thread only queues the window's raw timings (one tuple, :meth:`SpanExporter.
add_window`); building the spans and writing their JSON happen on the export thread, written straight to text
(:func:`encode_window`: about a third of the time of dicts through ``json.dumps``), since that thread shares the
stub's interpreter, and its cores, with the requests. With no endpoint, nothing here runs: the backend does not
even look for a trace. Standard library only (no OpenTelemetry SDK inside the stub).
"""

from __future__ import annotations

import json
import os
import queue
import random
import threading
import urllib.request
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

TRACE_ENDPOINT_ENV = "MODEL_FACTORY_TRACE_ENDPOINT"
TRACE_SOURCE_ENV = "MODEL_FACTORY_TRACE_SOURCE"  # "backend" (the default) or "triton"
TRACE_RATE_ENV = "MODEL_FACTORY_TRACE_RATE"  # with the backend as the source: one request in this many
TRACE_SOURCES = ("backend", "triton")
TRACEPARENT = "traceparent"  # the W3C header, forwarded by Triton into the request's parameters
SERVICE_NAME = "model-factory-backend"
MAX_QUEUED = 4096  # spans (or windows of spans) waiting for export; more are dropped
BATCH = 1024  # spans per export request at most


@dataclass(frozen=True)
class TraceParent:
    """The request's trace and the span (Triton's model span) the backend's spans hang under."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    # Set when the backend opened the request's span itself (trace source "backend"): span_id is that span, and
    # this its parent, the client's span from its traceparent header ("": a trace the backend started).
    remote_parent: str | None = None


def _split_traceparent(value: Any) -> tuple[str, str, bool] | None:
    """``(trace id, span id, sampled)`` of a W3C ``traceparent`` value, or None when it is not one."""
    try:
        _version, trace_id, span_id, flags = str(value).strip().split("-")
        sampled = bool(int(flags, 16) & 1)
        int(trace_id, 16), int(span_id, 16)
    except (ValueError, AttributeError, TypeError):
        return None
    if len(trace_id) != 32 or len(span_id) != 16 or set(trace_id) == {"0"} or set(span_id) == {"0"}:
        return None
    return trace_id.lower(), span_id.lower(), sampled


def parse_context(context: Any) -> TraceParent | None:
    """The ``traceparent`` in Triton's trace context (JSON ``{"traceparent": "00-<trace>-<span>-<flags>"}``)."""
    if not context:
        return None
    try:
        value = json.loads(context).get(TRACEPARENT) if isinstance(context, str) else context.get(TRACEPARENT)
    except (ValueError, AttributeError, TypeError):
        return None
    parsed = _split_traceparent(value)
    if parsed is None or not parsed[2]:
        return None
    return TraceParent(parsed[0], parsed[1])


def _new_id(bits: int) -> str:
    return f"{random.getrandbits(bits) | 1:0{bits // 4}x}"


class Sampler:
    """Which requests the backend traces when it is the trace source, and under which span.

    A request whose ``traceparent`` header (a request parameter, forwarded by Triton) is sampled is traced in the
    client's trace, under the client's span; an unsampled one is not traced (the client decided); a request
    without one, or with one that is not a W3C traceparent, is traced one in ``rate`` and starts a trace. The
    backend's ``request`` span gets a new id; its work goes under that span.
    """

    def __init__(self, rate: int = 1) -> None:
        self.rate = max(1, int(rate))
        self._seen = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Sampler | None":
        """The sampler of a backend-sourced trace (None when Triton's tracer is the source)."""
        env = os.environ if environ is None else environ
        if env.get(TRACE_SOURCE_ENV, "backend").strip() == "triton":
            return None
        try:
            return cls(int(env.get(TRACE_RATE_ENV, "1") or 1))
        except ValueError:
            return cls(1)

    def parent(self, parameters: Mapping[str, Any]) -> TraceParent | None:
        """The span a request's spans go under, from its parameters (``requests.request_parameters``), or None."""
        header = next((v for k, v in parameters.items() if str(k).lower() == TRACEPARENT), None)
        parsed = _split_traceparent(header) if header is not None else None
        if parsed is not None:
            trace_id, client_span, sampled = parsed
            return TraceParent(trace_id, _new_id(64), client_span) if sampled else None
        self._seen += 1
        if (self._seen - 1) % self.rate:
            return None
        return TraceParent(_new_id(128), _new_id(64), "")


def _value(v: Any) -> dict:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


def span(parent: TraceParent, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None
         ) -> dict:
    """One OTLP JSON span, a child of ``parent``."""
    # Span ids need to be unique, not secret: a PRNG draw, not a system call per span.
    return {"traceId": parent.trace_id, "spanId": f"{random.getrandbits(64) | 1:016x}", "parentSpanId": parent.span_id,
            "name": name, "kind": 1, "startTimeUnixNano": str(int(start_ns)), "endTimeUnixNano": str(int(end_ns)),
            "attributes": [{"key": k, "value": _value(v)} for k, v in (attributes or {}).items()]}


def _json_str(text: str) -> str:
    """A JSON string literal; plain ASCII (names, keys, most request ids) without calling ``json.dumps``."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return json.dumps(text)


_KEYS: dict[str, str] = {}  # attribute key -> its '{"key":...,"value":' prefix (a handful of names, ever)


def _value_text(v: Any) -> str:
    """``_value(v)`` as JSON text."""
    if isinstance(v, bool):
        return '{"boolValue":true}' if v else '{"boolValue":false}'
    if isinstance(v, int):
        return f'{{"intValue":"{v}"}}'
    if isinstance(v, float):
        return f'{{"doubleValue":{json.dumps(v)}}}'
    return f'{{"stringValue":{_json_str(str(v))}}}'


def _attribute_text(k: str, v: Any) -> str:
    prefix = _KEYS.get(k)
    if prefix is None:
        prefix = f'{{"key":{_json_str(k)},"value":'
        if len(_KEYS) < 256:
            _KEYS[k] = prefix
    return f"{prefix}{_value_text(v)}}}"


def _span_text(parent: TraceParent, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any]) -> str:
    """:func:`span` written straight to JSON text (the export thread's form: no dict, no ``json.dumps`` of it)."""
    attrs = ",".join([_attribute_text(k, v) for k, v in attributes.items()])
    return (f'{{"traceId":"{parent.trace_id}","spanId":"{random.getrandbits(64) | 1:016x}",'
            f'"parentSpanId":"{parent.span_id}","name":{_json_str(name)},"kind":1,'
            f'"startTimeUnixNano":"{int(start_ns)}","endTimeUnixNano":"{int(end_ns)}","attributes":[{attrs}]}}')


def export_body(spans: Sequence[dict | str], resource: Mapping[str, Any]) -> bytes:
    """An OTLP ``ExportTraceServiceRequest`` in JSON; each span a dict or its JSON text (:func:`encode_window`)."""
    head = json.dumps({"resource": {"attributes": [{"key": k, "value": _value(v)} for k, v in resource.items()]}},
                      separators=(",", ":"))[:-1]
    body = ",".join(s if isinstance(s, str) else json.dumps(s, separators=(",", ":")) for s in spans)
    scope = f'"scopeSpans":[{{"scope":{{"name":"model-factory"}},"spans":[{body}]}}]'
    return f'{{"resourceSpans":[{head},{scope}}}]}}'.encode()


class SpanExporter:
    """Sends spans to an OTLP/HTTP endpoint from a background thread (``interval_s`` batches)."""

    def __init__(self, endpoint: str, resource: Mapping[str, Any], interval_s: float = 1.0,
                 timeout_s: float = 2.0) -> None:
        self.url = endpoint if "://" in endpoint else f"http://{endpoint}"
        self.resource = {"service.name": SERVICE_NAME, **resource}
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.dropped = 0
        self.sent = 0
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="model-factory-spans", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, resource: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> "SpanExporter | None":
        endpoint = (os.environ if environ is None else environ).get(TRACE_ENDPOINT_ENV, "").strip()
        return cls(endpoint, resource) if endpoint else None

    def add(self, spans: Sequence[dict]) -> None:
        """Queue spans already built (dicts)."""
        for s in spans:
            try:
                self._queue.put_nowait(s)
            except queue.Full:
                self.dropped += 1

    def add_window(self, parents: Sequence[TraceParent | None], request_ids: Sequence[str],
                   own: Mapping[int, Sequence[tuple]], shared: Sequence[tuple]) -> None:
        """Queue one window's timings (:func:`window_spans`' arguments) as they are: O(1) on the request thread;
        the export thread makes the spans."""
        try:
            self._queue.put_nowait((tuple(parents), tuple(request_ids), own, tuple(shared)))
        except queue.Full:  # count what it would have made, without making it
            self.dropped += sum(len(own.get(i, ())) + sum(i in members for _, _, _, members, _ in shared)
                                + (parent.remote_parent is not None)
                                for i, parent in enumerate(parents) if parent is not None)

    def _take(self) -> list[dict | str]:
        out: list[dict | str] = []
        while len(out) < BATCH:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            out.extend(encode_window(*item) if isinstance(item, tuple) else (item,))
        return out

    def flush(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return
            try:
                req = urllib.request.Request(self.url, data=export_body(batch, self.resource),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    resp.read()
                self.sent += len(batch)
            except Exception:  # noqa: BLE001 - a collector away drops its spans, never fails serving
                self.dropped += len(batch)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()


def request_span(parent: TraceParent, start_ns: int, end_ns: int, attributes: Mapping[str, Any]) -> dict:
    """The ``request`` span the backend opened itself (trace source "backend"): ``parent.span_id``, a server span
    under the client's span (``parent.remote_parent``), or the root of a trace the backend started."""
    out = {"traceId": parent.trace_id, "spanId": parent.span_id, "name": "request", "kind": 2,
           "startTimeUnixNano": str(int(start_ns)), "endTimeUnixNano": str(int(end_ns)),
           "attributes": [{"key": k, "value": _value(v)} for k, v in attributes.items()]}
    if parent.remote_parent:
        out["parentSpanId"] = parent.remote_parent
    return out


def _request_span_text(parent: TraceParent, start_ns: int, end_ns: int, attributes: Mapping[str, Any]) -> str:
    return json.dumps(request_span(parent, start_ns, end_ns, attributes), separators=(",", ":"))


def _window(parents: Sequence[TraceParent | None], request_ids: Sequence[str], own: Mapping[int, Sequence[tuple]],
            shared: Sequence[tuple], make: Any, make_request: Any) -> list:
    out = []
    for idx, parent in enumerate(parents):
        if parent is None:
            continue
        tag = {"model_factory.request_id": request_ids[idx]}
        first, last = None, None
        for name, start, end, attrs in own.get(idx, ()):
            out.append(make(parent, name, start, end, {**tag, **attrs}))
            first, last = min(start, first or start), max(end, last or end)
        for name, start, end, members, attrs in shared:
            if idx in members:
                out.append(make(parent, name, start, end, {**tag, **attrs, "requests": len(members)}))
                first, last = min(start, first or start), max(end, last or end)
        if parent.remote_parent is not None and first is not None:
            out.append(make_request(parent, first, last, tag))
    return out


def encode_window(parents: Sequence[TraceParent | None], request_ids: Sequence[str],
                  own: Mapping[int, Sequence[tuple]], shared: Sequence[tuple]) -> list[str]:
    """:func:`window_spans` as JSON texts, for :func:`export_body` (what the export thread sends)."""
    return _window(parents, request_ids, own, shared, _span_text, _request_span_text)


def window_spans(parents: Sequence[TraceParent | None], request_ids: Sequence[str],
                 own: Mapping[int, Sequence[tuple]], shared: Sequence[tuple]) -> list[dict]:
    """The spans of one window for its sampled requests.

    ``own[idx]``: ``(name, start_ns, end_ns, attributes)`` timed for request ``idx`` alone (validate, tokenize,
    respond); ``shared``: the executor's ``(name, start_ns, end_ns, request indices, attributes)`` (group,
    engine_run), each put under every sampled request it served. A request whose span the backend opened
    itself (``parent.remote_parent`` set) also gets that ``request`` span, from its first span's start to its
    last one's end.
    """
    return _window(parents, request_ids, own, shared, span, request_span)
