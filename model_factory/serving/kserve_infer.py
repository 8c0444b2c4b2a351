"""One KServe v2 ``infer`` call over Triton's HTTP port, as any client makes it (the frontend's encoder path).

The frontend has no inference path of its own: an embedding, rerank or classify request becomes one or more
``POST /v2/models/<model>/infer`` calls on Triton, so Triton's batching, queue bound, the backend's request
ids, events, limits and long-input policy all apply. Inputs go as JSON (texts, or token ids); outputs come back
in Triton's binary tensor extension (``binary_data``: a JSON header of ``Inference-Header-Content-Length``
bytes, then each output's raw little-endian bytes), which spares turning every float into text and back.

The call goes over :class:`LoopbackClient`: kept-alive HTTP/1.1 connections to Triton's port, one request at a
time each, written and read by an ``asyncio.Protocol`` of its own (a status line, ``Content-Length`` and the
body: all Triton's infer answers). It is the frontend's cost per request that matters at one text a request,
and aiohttp's client session spends about a third of the frontend's CPU per request on its own machinery
(measured: 0.43 against 0.32 ms of the frontend's CPU per one-text ``/v1/embeddings`` request, docs/serving.md).

:func:`infer_body` and :func:`parse_infer_response` are pure (tested without a server); :func:`infer` makes
the call and raises :class:`~model_factory.serving.openai_protocol.OpenAIError` for what Triton refused (its
400 with the backend's message stays a 400).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

import numpy as np

from model_factory.serving.openai_protocol import OpenAIError, triton_error

HEADER_LENGTH = "Inference-Header-Content-Length"
REQUEST_ID_HEADER = "X-Request-ID"
_DTYPES = {"FP32": "<f4", "FP16": "<f2", "FP64": "<f8", "INT64": "<i8", "INT32": "<i4", "INT16": "<i2",
           "INT8": "i1", "UINT8": "u1", "BOOL": "?"}
_NAMES = {np.dtype("int64"): "INT64", np.dtype("int32"): "INT32", np.dtype("float32"): "FP32"}


def infer_body(inputs: Mapping[str, Sequence[str] | np.ndarray], outputs: Sequence[str],
               parameters: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The KServe JSON body: a list of strings is a BYTES input of shape ``[n, 1]``, an array goes as it is."""
    tensors = []
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            tensors.append({"name": name, "shape": list(value.shape), "datatype": _NAMES[value.dtype],
                            "data": value.ravel().tolist()})
        else:
            tensors.append({"name": name, "shape": [len(value), 1], "datatype": "BYTES", "data": list(value)})
    body: dict[str, Any] = {"inputs": tensors,
                            "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in outputs]}
    if parameters:
        body["parameters"] = dict(parameters)
    return body


def parse_infer_response(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    """The outputs of a successful infer answer (binary or JSON data), by name."""
    head = body if header_length is None else body[:header_length]
    answer = json.loads(head)
    offset = len(head)
    out = {}
    for tensor in answer.get("outputs", ()):
        shape, dtype = [int(d) for d in tensor["shape"]], tensor["datatype"]
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if dtype not in _DTYPES:
                raise ValueError(f"output {tensor['name']!r}: binary {dtype} is not read here")
            arr = np.frombuffer(body[offset:offset + int(size)], dtype=_DTYPES[dtype]).reshape(shape)
            offset += int(size)
        else:
            arr = np.asarray(tensor.get("data", ()), dtype=_DTYPES.get(dtype, object)).reshape(shape)
        out[tensor["name"]] = arr
    return out


class UpstreamClosed(ConnectionError):
    """The connection closed before a whole answer came back."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection: a request written whole, its answer read by ``Content-Length``."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.closed = False
        self._buf = bytearray()
        self._head: tuple[int, dict[str, str]] | None = None
        self._need = 0
        self._waiter: asyncio.Future | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(UpstreamClosed(f"the connection closed before the answer ({exc or 'EOF'})"))

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._waiter is None or self._waiter.done():
            return
        if self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
            del self._buf[:end + 4]
            try:
                status = int(lines[0].split(" ", 2)[1])
            except (IndexError, ValueError):
                self._waiter.set_exception(ValueError(f"not an HTTP answer: {lines[0][:80]!r}"))
                return
            headers = {}
            for line in lines[1:]:
                key, _, value = line.partition(":")
                headers[key.strip().lower()] = value.strip()
            if "content-length" not in headers:  # Triton's infer answers carry it; nothing else is read here
                self._waiter.set_exception(ValueError("the answer has no Content-Length"))
                return
            self._head, self._need = (status, headers), int(headers["content-length"])
        if len(self._buf) >= self._need:
            body = bytes(self._buf[:self._need])
            del self._buf[:self._need]
            (status, headers), self._head = self._head, None
            self._waiter.set_result((status, headers, body))

    async def exchange(self, request: bytes) -> tuple[int, dict[str, str], bytes]:
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class LoopbackClient:
    """HTTP/1.1 POSTs to one server (Triton's HTTP port) over kept-alive connections, made on the running loop.

    Each connection carries one request at a time; an idle one is reused, else a new one is opened (no bound:
    Triton's queue bounds the work). A connection whose answer was not read whole (the caller cancelled, an
    error) is closed, never reused. A request on a reused connection that the server had closed meanwhile is
    sent once more on a new one (an infer call changes nothing on the server)."""

    def __init__(self, url: str, connect_timeout_s: float = 10.0) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(_Connection, self.host, self.port),
                                         self.connect_timeout_s)
        return conn

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes]:
        """``(status, headers with lower-case names, body)``; OSError / UpstreamClosed where the server is gone."""
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Length: {len(body)}\r\n"
                   + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode("latin-1") + body
        while True:
            conn, reused = None, False
            while self._idle and conn is None:
                conn = self._idle.pop()
                if conn.closed:
                    conn = None
                reused = conn is not None
            if conn is None:
                conn = await self._connect()
            done = False
            try:
                status, answer, data = await conn.exchange(request)
                done = True
            except UpstreamClosed:
                if reused:  # closed by the server while idle: once more on a new connection
                    continue
                raise
            finally:
                if not done:
                    conn.close()
            if answer.get("connection", "").lower() == "close":
                conn.close()
            else:
                self._idle.append(conn)
            return status, answer, data

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


async def infer(client: LoopbackClient, model: str, inputs: Mapping[str, Sequence[str] | np.ndarray],
                outputs: Sequence[str], parameters: Mapping[str, Any] | None, request_id: str) -> dict[str, np.ndarray]:
    """One ``infer`` call; the request id goes as the ``X-Request-ID`` header the backend reads (serving.md)."""
    data = json.dumps(infer_body(inputs, outputs, parameters)).encode()
    try:
        status, headers, raw = await client.post(f"/v2/models/{model}/infer", data,
                                                 {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id})
    except (OSError, asyncio.TimeoutError) as exc:  # UpstreamClosed is an OSError
        raise OpenAIError(503, f"the inference server cannot be reached ({exc})", retry_after_s=1.0) from None
    except ValueError as exc:
        raise OpenAIError(502, f"the inference server's answer could not be read: {exc}") from None
    if status != 200:
        try:
            message = str(json.loads(raw).get("error", raw[:200]))
        except (ValueError, AttributeError):
            message = raw[:200].decode("utf-8", errors="replace")
        if status == 400 and "exceeds maximum batch size" in message:
            raise OpenAIError(400, message, "input")
        if status == 503:  # Triton's queue bound shed it: the client retries, as after the generate path's 503
            raise OpenAIError(503, message, retry_after_s=1.0)
        raise triton_error(status, message)
    length = headers.get(HEADER_LENGTH.lower())
    try:
        return parse_infer_response(raw, int(length) if length else None)
    except (ValueError, KeyError, TypeError) as exc:
        raise OpenAIError(502, f"the inference server's answer could not be read: {exc}") from None
