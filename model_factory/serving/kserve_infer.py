"""One KServe v2 ``infer`` call over Triton's HTTP port, as any client makes it (the frontend's encoder path).

The frontend has no inference path of its own: an embedding, rerank or classify request becomes one or more
``POST /v2/models/<model>/infer`` calls on Triton, so Triton's batching, queue bound, the backend's request
ids, events, limits and long-input policy all apply. Inputs go as JSON (texts, or token ids); outputs come back
in Triton's binary tensor extension (``binary_data``: a JSON header of ``Inference-Header-Content-Length``
bytes, then each output's raw little-endian bytes), which spares turning every float into text and back.

:func:`infer_body` and :func:`parse_infer_response` are pure (tested without a server); :func:`infer` makes
the call with an ``aiohttp`` session and raises :class:`~model_factory.serving.openai_protocol.OpenAIError`
for what Triton refused (its 400 with the backend's message stays a 400).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

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


async def infer(session: Any, triton: str, model: str, inputs: Mapping[str, Sequence[str] | np.ndarray],
                outputs: Sequence[str], parameters: Mapping[str, Any] | None, request_id: str) -> dict[str, np.ndarray]:
    """One ``infer`` call; the request id goes as the ``X-Request-ID`` header the backend reads (serving.md)."""
    import aiohttp

    data = json.dumps(infer_body(inputs, outputs, parameters)).encode()
    try:
        async with session.post(f"{triton}/v2/models/{model}/infer", data=data,
                                headers={"Content-Type": "application/json", REQUEST_ID_HEADER: request_id,
                                         # aiohttp asks for gzip by default, and Triton then compresses each answer
                                         "Accept-Encoding": "identity"}) as resp:
            raw = await resp.read()
            length = resp.headers.get(HEADER_LENGTH)
    except aiohttp.ClientError as exc:
        raise OpenAIError(503, f"the inference server cannot be reached ({exc})", retry_after_s=1.0) from None
    if resp.status != 200:
        try:
            message = str(json.loads(raw).get("error", raw[:200]))
        except (ValueError, AttributeError):
            message = raw[:200].decode("utf-8", errors="replace")
        if resp.status == 400 and "exceeds maximum batch size" in message:
            raise OpenAIError(400, message, "input")
        if resp.status == 503:  # Triton's queue bound shed it: the client retries, as after the generate path's 503
            raise OpenAIError(503, message, retry_after_s=1.0)
        raise triton_error(resp.status, message)
    try:
        return parse_infer_response(raw, int(length) if length else None)
    except (ValueError, KeyError, TypeError) as exc:
        raise OpenAIError(502, f"the inference server's answer could not be read: {exc}") from None
