"""Decision events: one JSON line per decision the backend makes, never one per normal request.

Seed 000 §6.2: log decision points and faults, not the normal path. An event says what was decided (a window
grouped, a group split for memory or retried, an input refused and why, a long text truncated or chunked, an
engine fallen back, a stub healed), with the ids of the requests involved and a hash of their inputs, never
the inputs themselves (003 §7.2): a text reaches no event, only ``sha256(...)[:16]`` of its bytes.

Events are rate-limited by a token bucket (``rate`` a second, ``burst`` at once), so a flood of bad requests
writes a bounded number of lines; what the bucket refused is counted and said in the next event written
(``"dropped": n``) and in ``model_factory_events_dropped_total``. When no other event follows a flood, an
``events_dropped`` event says the count once the bucket has refilled (about ``1/rate`` seconds later). Where they go: the file named by
``$MODEL_FACTORY_EVENTS_FILE`` (``serve --events FILE``), one ``write()`` of one line each, appended, so
several instances (processes) share the file without tearing lines; else Triton's log
(``model-factory event: {...}``).

Request ids (:func:`request_id`): the KServe ``id`` of the request, else an ``X-Request-ID`` header (``serve``
makes Triton forward it as a request parameter), else one generated here. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Mapping

EVENTS_FILE_ENV = "MODEL_FACTORY_EVENTS_FILE"
EVENTS_RATE_ENV = "MODEL_FACTORY_EVENTS_RATE"  # events a second per instance (the bucket's refill)
DEFAULT_RATE = 20.0
REQUEST_ID_HEADER = "x-request-id"


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; :meth:`take` spends one if there is one."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = float(rate), float(burst), clock
        self._tokens, self._last = float(burst), clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


def input_hash(parts: Iterable[Any]) -> str:
    """The first 16 hex digits of a sha256 over the inputs' bytes (text, or array bytes with dtype and shape)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, str):
            part = part.encode("utf-8")
        elif isinstance(part, (bytes, bytearray, memoryview)):
            part = bytes(part)
        elif hasattr(part, "tobytes"):  # a numpy array: its dtype and shape too
            if getattr(part, "dtype", None) is not None and part.dtype.kind == "O":
                for value in part.reshape(-1):
                    h.update(value if isinstance(value, bytes) else str(value).encode("utf-8"))
                    h.update(b"\0")
                continue
            h.update(f"{part.dtype.str}{part.shape}".encode())
            part = part.tobytes()
        else:
            part = repr(part).encode("utf-8")
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def request_id(kserve_id: str | None, parameters: str | Mapping[str, Any] | None) -> tuple[str, str]:
    """``(id, source)``: the request's KServe id, else its X-Request-ID header, else a generated one."""
    if kserve_id:
        return str(kserve_id), "client"
    from ..requests.items import request_parameters

    for key, value in request_parameters(parameters).items():  # HTTP keeps the header's case, gRPC lower case
        if str(key).lower() == REQUEST_ID_HEADER and value:
            return str(value)[:128], "header"
    return uuid.uuid4().hex[:16], "generated"


class EventLog:
    """Writes rate-limited decision events for one model instance.

    ``fields`` of :meth:`emit` may be a callable, called only when the bucket lets the event through (an input
    hash is then computed only for events written). ``sink``: a function taking one line (tests); default the
    events file, else ``log``.
    """

    def __init__(self, model: str, instance: str = "", *, path: str | None = None, rate: float = DEFAULT_RATE,
                 burst: float | None = None, log: Callable[[str], None] | None = None,
                 sink: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.base = {"model": model, **({"instance": instance} if instance else {}), "pid": os.getpid()}
        self.bucket = TokenBucket(rate, burst if burst is not None else max(1.0, 5 * rate), clock)
        self.dropped = 0  # refused by the bucket since the last event written
        self.dropped_total = 0
        self._lock = threading.Lock()
        self._flush_timer: threading.Timer | None = None  # an events_dropped event pending (see _drop)
        self._closed = False
        self._fd: int | None = None
        if sink is not None:
            self._sink = sink
        elif path:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            self._sink = self._write
        else:
            self._sink = (lambda line: log(f"model-factory event: {line}")) if log else (lambda line: None)

    @classmethod
    def from_env(cls, model: str, instance: str = "", log: Callable[[str], None] | None = None,
                 environ: Mapping[str, str] | None = None) -> "EventLog":
        env = os.environ if environ is None else environ
        try:
            rate = float(env.get(EVENTS_RATE_ENV, "") or DEFAULT_RATE)
        except ValueError:
            rate = DEFAULT_RATE
        return cls(model, instance, path=env.get(EVENTS_FILE_ENV) or None, rate=max(0.1, rate), log=log)

    def _write(self, line: str) -> None:
        assert self._fd is not None
        os.write(self._fd, (line + "\n").encode("utf-8"))

    def emit(self, event: str, fields: Mapping[str, Any] | Callable[[], Mapping[str, Any]] = None) -> bool:
        """Write one event if the bucket allows; True when written. Never raises (events never fail a request)."""
        if not self.bucket.take():
            self._drop()
            return False
        try:
            body = fields() if callable(fields) else (fields or {})
            return self._write_record(event, body)
        except Exception:  # noqa: BLE001 - a full disk or a closed file must not fail the request
            return False

    def _write_record(self, event: str, body: Mapping[str, Any], dropped: int | None = None) -> bool:
        """Write one line; it says the events dropped since the last line (taken here unless given)."""
        if dropped is None:
            with self._lock:
                dropped, self.dropped = self.dropped, 0
        record = {"ts": round(time.time(), 6), "event": event, **self.base, **body}
        if dropped:
            record["dropped"] = dropped
        self._sink(json.dumps(record, separators=(",", ":"), default=str))
        return True

    def _drop(self) -> None:
        """Count one refused event; make sure the count is said even if no other event follows."""
        with self._lock:
            self.dropped += 1
            self.dropped_total += 1
            if self._flush_timer is None and not self._closed:
                self._schedule_flush()

    def _schedule_flush(self) -> None:  # with self._lock held
        timer = threading.Timer(1.0 / self.bucket.rate, self._flush)
        timer.daemon = True
        self._flush_timer = timer
        timer.start()

    def _flush(self) -> None:
        """The timer: write ``events_dropped`` with the pending count once the bucket has a token again."""
        with self._lock:
            self._flush_timer = None
            if self._closed or not self.dropped:
                return  # closed, or an event written meanwhile said the count
        if not self.bucket.take():
            with self._lock:
                if self._flush_timer is None and not self._closed:
                    self._schedule_flush()
            return
        with self._lock:
            dropped, self.dropped = self.dropped, 0
        if not dropped:  # an event written meanwhile said the count
            return
        try:
            self._write_record("events_dropped", {}, dropped)
        except Exception:  # noqa: BLE001 - as in emit
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            timer, self._flush_timer = self._flush_timer, None
        if timer is not None:
            timer.cancel()
        if self._fd is not None:
            try:
                os.close(self._fd)
            finally:
                self._fd = None
