"""Which tracer ``serve --trace-source`` starts: the backend's (Triton's tracer off) or Triton's (its flags)."""

from __future__ import annotations

import pytest

from model_factory.errors import FactoryError
from model_factory.serving.triton_process import FORWARDED_HEADER_PATTERN, trace_arguments


def test_the_backend_as_source_starts_no_triton_tracer_and_triton_as_source_does() -> None:
    assert trace_arguments("127.0.0.1:4318/v1/traces", 1) == []  # the default source: the backend
    assert trace_arguments(None, 1, "triton") == []  # no endpoint: no tracing at all
    flags = trace_arguments("127.0.0.1:4318/v1/traces", 100, "triton")
    assert "--trace-config=mode=opentelemetry" in flags and "--trace-config=rate=100" in flags
    assert "--trace-config=opentelemetry,url=127.0.0.1:4318/v1/traces" in flags
    with pytest.raises(FactoryError, match="trace source 'jaeger' is not one of backend, triton"):
        trace_arguments("127.0.0.1:4318/v1/traces", 1, "jaeger")
    with pytest.raises(FactoryError, match="trace rate 0 is not a sampling rate"):
        trace_arguments("127.0.0.1:4318/v1/traces", 0, "triton")


def test_the_traceparent_and_request_id_headers_are_forwarded_whatever_their_case() -> None:
    import re

    # Triton's pattern is RE2; this one is also valid Python regex syntax, so it is checked here as Triton would.
    pattern = re.compile(FORWARDED_HEADER_PATTERN)
    assert all(pattern.match(h) for h in ("traceparent", "TraceParent", "x-request-id", "X-Request-ID"))
    assert not any(pattern.match(h) for h in ("authorization", "tracestate-x", "x-request-id-2", "cookie"))
