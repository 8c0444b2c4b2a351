"""OpenTelemetry spans of the backend's work, children of the span Triton opened for the request.

``serve --trace-endpoint URL --trace-rate R`` starts Triton with OpenTelemetry tracing (one request in R
sampled) and gives the backend the same OTLP/HTTP endpoint in ``$MODEL_FACTORY_TRACE_ENDPOINT``. For a sampled
request Triton hands the backend a W3C ``traceparent`` (``request.trace().get_context()``) naming the model's
span; the backend adds its own spans under it: ``validate`` (decode and check), ``tokenize``, ``group`` (the
window's split), ``engine_run`` (each launch holding the request's sequences) and ``respond``.

Exported as OTLP/HTTP JSON (what Triton 2.51's own exporter sends: ids in hex, times as decimal strings) by a
background thread, about once a second, from a bounded queue: a slow or absent collector drops spans (counted),
never slows a request. The request thread only queues the window's raw timings (one tuple, :meth:`SpanExporter.
add_window`); building the spans and writing their JSON happen on the export thread, written straight to text
(:func:`encode_window`: about a third of the time of dicts through ``json.dumps``), since that thread shares the
stub's interpreter, and its cores, with the requests. With no endpoint, nothing here runs: the backend does not
even ask Triton for the trace. Standard library only (no OpenTelemetry SDK inside the stub).
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
SERVICE_NAME = "model-factory-backend"
MAX_QUEUED = 4096  # spans (or windows of spans) waiting for export; more are dropped
BATCH = 1024  # spans per export request at most


@dataclass(frozen=True)
class TraceParent:
    """The request's trace and the span (Triton's model span) the backend's spans hang under."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits


def parse_context(context: Any) -> TraceParent | None:
    """The ``traceparent`` in Triton's trace context (JSON ``{"traceparent": "00-<trace>-<span>-<flags>"}``)."""
    if not context:
        return None
    try:
        value = json.loads(context).get("traceparent") if isinstance(context, str) else context.get("traceparent")
        _version, trace_id, span_id, flags = str(value).split("-")
    except (ValueError, AttributeError, TypeError):
        return None
    if len(trace_id) != 32 or len(span_id) != 16 or not int(flags, 16) & 1 or set(trace_id) == {"0"}:
        return None
    return TraceParent(trace_id.lower(), span_id.lower())


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


def _window(parents: Sequence[TraceParent | None], request_ids: Sequence[str], own: Mapping[int, Sequence[tuple]],
            shared: Sequence[tuple], make: Any) -> list:
    out = []
    for idx, parent in enumerate(parents):
        if parent is None:
            continue
        tag = {"model_factory.request_id": request_ids[idx]}
        for name, start, end, attrs in own.get(idx, ()):
            out.append(make(parent, name, start, end, {**tag, **attrs}))
        for name, start, end, members, attrs in shared:
            if idx in members:
                out.append(make(parent, name, start, end, {**tag, **attrs, "requests": len(members)}))
    return out


def encode_window(parents: Sequence[TraceParent | None], request_ids: Sequence[str],
                  own: Mapping[int, Sequence[tuple]], shared: Sequence[tuple]) -> list[str]:
    """:func:`window_spans` as JSON texts, for :func:`export_body` (what the export thread sends)."""
    return _window(parents, request_ids, own, shared, _span_text)


def window_spans(parents: Sequence[TraceParent | None], request_ids: Sequence[str],
                 own: Mapping[int, Sequence[tuple]], shared: Sequence[tuple]) -> list[dict]:
    """The spans of one window for its sampled requests.

    ``own[idx]``: ``(name, start_ns, end_ns, attributes)`` timed for request ``idx`` alone (validate, tokenize,
    respond); ``shared``: the executor's ``(name, start_ns, end_ns, request indices, attributes)`` (group,
    engine_run), each put under every sampled request it served.
    """
    return _window(parents, request_ids, own, shared, span)
