"""OpenAI's ``/v1/embeddings`` request and response shapes, as pure functions (no server).

:func:`embeddings_request` checks an OpenAI body against the served embedding models and returns an
:class:`EmbeddingsCall`: the texts (or token ids) to send to the model's KServe ``infer``, the long-input mode
asked for, the size and the encoding of the answer. :func:`shape_vectors` applies ``dimensions`` (the first
``dimensions`` values, scaled back to unit length: only for a model whose recipe says it was trained for it,
Matryoshka-style); :func:`embeddings_response` builds what the ``openai`` client reads, ``base64`` being the
little-endian float32 bytes its client decodes with ``np.frombuffer(..., dtype="float32")``.

A bad value raises :class:`~model_factory.serving.openai_protocol.OpenAIError` naming the parameter (400), an
unknown model 404, as the OpenAI API answers. Beyond OpenAI's fields, ``truncate`` (TEI's: true truncates a
text over the model's limit, false refuses it) and ``long_inputs`` (``refuse`` | ``truncate`` | ``chunk``,
docs/inputs.md) are passed to the backend as the KServe request parameters it already reads.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from model_factory.serving.openai_protocol import OpenAIError

ENCODING_FORMATS = ("float", "base64")
LONG_INPUTS = ("refuse", "truncate", "chunk")
# OpenAI's own bound on the inputs of one request.
MAX_INPUTS = 2048
_IGNORED = ("user",)  # taken and not used: OpenAI's end-user id


@dataclass(frozen=True)
class EmbeddingsCall:
    """One ``/v1/embeddings`` request, checked: either ``texts`` or ``token_ids`` is set."""

    model: str
    texts: tuple[str, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()
    encoding_format: str = "float"
    dimensions: int | None = None
    parameters: Mapping[str, Any] | None = None  # the KServe request parameters (long_inputs)

    @property
    def count(self) -> int:
        return len(self.texts) or len(self.token_ids)


def check_model(req: Any, models: Mapping[str, Any], kind: str) -> str:
    """The body's ``model`` when it names one of ``models`` (400 when missing, 404 when not served)."""
    if not isinstance(req, Mapping):
        raise OpenAIError(400, "the body must be a JSON object")
    model = req.get("model")
    served = ", ".join(sorted(models)) or f"none: this server serves no {kind} model"
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, f"model is required: one of {served}", "model")
    if model not in models:
        raise OpenAIError(404, f"model {model!r} is not a {kind} model served here: use one of {served}", "model")
    return model


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def long_input_parameters(req: Mapping[str, Any]) -> dict[str, Any]:
    """The KServe parameters of the long-input mode a body asks for (``truncate`` or ``long_inputs``)."""
    params: dict[str, Any] = {}
    truncate = req.get("truncate")
    if truncate is not None:
        if not isinstance(truncate, bool):
            raise OpenAIError(400, f"truncate={truncate!r} must be true or false", "truncate")
        params["truncate"] = truncate
    mode = req.get("long_inputs")
    if mode is not None:
        if mode not in LONG_INPUTS:
            raise OpenAIError(400, f"long_inputs={mode!r} must be one of {', '.join(LONG_INPUTS)}", "long_inputs")
        params["long_inputs"] = mode
    return params


def embeddings_request(req: Any, models: Mapping[str, Any]) -> EmbeddingsCall:
    """``/v1/embeddings``: ``input`` a string, a list of strings, a list of token ids or a list of such lists."""
    name = check_model(req, models, "embedding")
    model = models[name]
    raw = req.get("input")
    texts: tuple[str, ...] = ()
    ids: tuple[tuple[int, ...], ...] = ()
    if isinstance(raw, str):
        texts = (raw,)
    elif _is_ids(raw):
        ids = (tuple(raw),)
    elif isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        texts = tuple(raw)
    elif isinstance(raw, list) and raw and all(_is_ids(t) for t in raw):
        ids = tuple(tuple(t) for t in raw)
    else:
        raise OpenAIError(400, "input must be a non-empty string, a list of strings, a list of token ids or a list of "
                          "lists of token ids", "input")
    for i, text in enumerate(texts):
        if not text.strip():
            raise OpenAIError(400, f"input[{i}] is empty", "input")
    if ids and any(t < 0 for row in ids for t in row):
        raise OpenAIError(400, "input: token ids must not be negative", "input")
    if texts and not getattr(model, "text_input", True):
        raise OpenAIError(400, f"model {name!r} takes token ids, not text: send input as lists of token ids", "input")
    count = len(texts) or len(ids)
    if count > MAX_INPUTS:
        raise OpenAIError(400, f"input has {count} items; at most {MAX_INPUTS} per request", "input")
    fmt = req.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if fmt not in ENCODING_FORMATS:
        raise OpenAIError(400, f"encoding_format={fmt!r} must be 'float' or 'base64'", "encoding_format")
    dims = req.get("dimensions")
    if dims is not None:
        dims = check_dimensions(dims, model)
    params = long_input_parameters(req)
    if ids and params:
        raise OpenAIError(400, "truncate / long_inputs apply to text: token ids over the model's limit are the "
                          "client's to cut", "truncate" if "truncate" in params else "long_inputs")
    return EmbeddingsCall(name, texts, ids, fmt, dims, params or None)


def check_dimensions(dims: Any, model: Any) -> int | None:
    """``dimensions`` where the model allows it: its own size (a no-op), or one of the sizes its recipe says it was
    trained to be truncated to (``[embedding] matryoshka_dimensions``); a 400 naming the parameter otherwise."""
    if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
        raise OpenAIError(400, f"dimensions={dims!r} must be a positive integer", "dimensions")
    full = getattr(model, "dimensions", None)
    if full is not None and dims == full:
        return None
    allowed = tuple(getattr(model, "matryoshka_dimensions", ()) or ())
    name = getattr(model, "name", "this model")
    if not allowed:
        raise OpenAIError(400, f"dimensions={dims}: model {name!r} returns {full} dimensions and cannot be shortened "
                          "(its recipe does not declare Matryoshka-style training: [embedding] "
                          "matryoshka_dimensions)", "dimensions")
    if dims not in allowed:
        raise OpenAIError(400, f"dimensions={dims}: model {name!r} may be shortened to "
                          f"{', '.join(map(str, sorted(allowed)))}" + (f" or left at {full}" if full else ""),
                          "dimensions")
    return dims


def shape_vectors(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The vectors as answered: the first ``dimensions`` values scaled back to unit length, or as they are."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if dimensions is None or dimensions >= vectors.shape[-1]:
        return vectors
    cut = vectors[..., :dimensions]
    norms = np.linalg.norm(cut, axis=-1, keepdims=True)
    return (cut / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI answers it: a list of floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vector, dtype=np.float32).tolist()


def embeddings_response(model: str, vectors: np.ndarray, encoding_format: str, prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's answer: ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], ...}``."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": int(prompt_tokens), "total_tokens": int(prompt_tokens)}}
