"""Small helpers over the standard Triton clients (``tritonclient.http`` / ``tritonclient.grpc``)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from model_factory.errors import require


def _module(protocol: str):
    if protocol not in ("http", "grpc"):
        raise ValueError(f"protocol must be http or grpc, not {protocol!r}")
    return require(f"tritonclient.{protocol}", "client")


def embed_texts(url: str, model: str, texts: Sequence[str], protocol: str = "http",
                output: str = "embedding") -> np.ndarray:
    """Send one request with ``texts`` as a BYTES [n, 1] input and return the ``output`` tensor."""
    tc = _module(protocol)
    client = tc.InferenceServerClient(url)
    try:
        inp = tc.InferInput("text", [len(texts), 1], "BYTES")
        inp.set_data_from_numpy(np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))
        result = client.infer(model, [inp], outputs=[tc.InferRequestedOutput(output)])
        return result.as_numpy(output)
    finally:
        client.close()


def infer_ids(url: str, model: str, input_ids: np.ndarray, attention_mask: np.ndarray, protocol: str = "http",
              outputs: Sequence[str] = ("embedding",)) -> dict[str, np.ndarray]:
    """Send token ids ([n, L] int64) and return the requested outputs."""
    return infer_tensors(url, model, {"input_ids": np.asarray(input_ids, dtype=np.int64),
                                      "attention_mask": np.asarray(attention_mask, dtype=np.int64)},
                         protocol, outputs)


def infer_tensors(url: str, model: str, inputs: Mapping[str, np.ndarray], protocol: str = "http",
                  outputs: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """Send named tensors (any dtype, batch axis first) and return the requested outputs (all when empty)."""
    tc = _module(protocol)
    np_to_triton = require("tritonclient.utils", "client").np_to_triton_dtype
    client = tc.InferenceServerClient(url)
    try:
        tensors = []
        for name, arr in inputs.items():
            arr = np.ascontiguousarray(arr)
            t = tc.InferInput(name, list(arr.shape), np_to_triton(arr.dtype))
            t.set_data_from_numpy(arr)
            tensors.append(t)
        wanted = list(outputs) or [o["name"] if isinstance(o, dict) else o.name for o in _output_specs(client, model)]
        result = client.infer(model, tensors, outputs=[tc.InferRequestedOutput(o) for o in wanted])
        return {o: result.as_numpy(o) for o in wanted}
    finally:
        client.close()


def _output_specs(client, model: str) -> list:
    meta = client.get_model_metadata(model)
    return meta["outputs"] if isinstance(meta, dict) else list(meta.outputs)
