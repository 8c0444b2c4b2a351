"""Rerank, embed and classify as RAG stacks call them: TEI's ``/rerank``, ``/embed`` and ``/predict``, Cohere / Jina's
``/v1/rerank``.

Pure functions (no server). Requests are checked into frozen calls, answers built from the model's raw outputs:

- TEI (text-embeddings-inference) ``POST /rerank``: ``{"query", "texts", "raw_scores", "return_text",
  "truncate"}`` -> ``[{"index", "score", "text"?}]``, best first; a score is the sigmoid of the reranker's logit
  unless ``raw_scores``.
- Cohere / Jina ``POST /v1/rerank``: ``{"model", "query", "documents", "top_n", "return_documents"}`` (a
  document a string or ``{"text": ...}``) -> ``{"id", "model", "results": [{"index", "relevance_score",
  "document"?}], "usage", "meta"}``, best first; ``relevance_score`` the sigmoid of the logit.
- TEI ``POST /embed``: ``{"inputs": text | [texts], "normalize", "truncate", "dimensions"}`` -> one list of floats
  a text (LlamaIndex's ``TextEmbeddingsInference`` and LangChain's ``HuggingFaceEndpointEmbeddings`` call it).
- TEI ``POST /predict``: ``{"inputs": text | [texts], "raw_scores", "truncate"}`` -> ``[{"label", "score"}]`` for
  one text, one such list per text for a list, each best first, labels from the model's label file; scores the
  softmax of the logits unless ``raw_scores``.

TEI serves one model and names none: a body may name one with ``model``, and must when several of that kind are
served. ``truncate`` is TEI's: true truncates a text over the model's limit, false (the default) refuses it with
a 400 (docs/inputs.md); a (query, passage) pair is one sequence, never chunked.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from model_factory.serving.openai_encoders import check_dimensions, check_model, long_input_parameters
from model_factory.serving.openai_protocol import OpenAIError

MAX_DOCUMENTS = 1000


@dataclass(frozen=True)
class RerankCall:
    """A rerank request: ``query`` against each of ``documents``."""

    model: str
    query: str
    documents: tuple[str, ...]
    top_n: int | None = None
    return_documents: bool = False
    raw_scores: bool = False
    parameters: Mapping[str, Any] | None = None  # the KServe request parameters (truncate)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return [(self.query, d) for d in self.documents]


@dataclass(frozen=True)
class EmbedCall:
    """TEI's ``/embed``: ``texts``, whether to scale the vectors to unit length, the size asked for."""

    model: str
    texts: tuple[str, ...]
    normalize: bool = True
    dimensions: int | None = None
    parameters: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PredictCall:
    """A classification request: ``texts``; ``single`` when the body sent one text (answered as one list)."""

    model: str
    texts: tuple[str, ...]
    single: bool
    raw_scores: bool = False
    parameters: Mapping[str, Any] | None = None


def pick_model(req: Any, models: Mapping[str, Any], kind: str) -> str:
    """The model a TEI body means: the one it names, else the only ``kind`` model served (400 when several)."""
    if isinstance(req, Mapping) and req.get("model") is None and len(models) == 1:
        return next(iter(models))
    if isinstance(req, Mapping) and req.get("model") is None and len(models) > 1:
        raise OpenAIError(400, f"several {kind} models are served ({', '.join(sorted(models))}): name one with "
                          "model", "model")
    return check_model(req, models, kind)


def _flag(req: Mapping[str, Any], name: str, default: bool) -> bool:
    value = req.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(400, f"{name}={value!r} must be true or false", name)
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise OpenAIError(400, f"{name} must be a non-empty string", name.split("[")[0])
    return value


def _documents(raw: Any, name: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not raw:
        raise OpenAIError(400, f"{name} must be a non-empty list", name)
    if len(raw) > MAX_DOCUMENTS:
        raise OpenAIError(400, f"{name} has {len(raw)} items; at most {MAX_DOCUMENTS} per request", name)
    out = []
    for i, doc in enumerate(raw):
        if isinstance(doc, Mapping) and "text" in doc:  # Cohere's {"text": ...}
            doc = doc["text"]
        out.append(_text(doc, f"{name}[{i}]"))
    return tuple(out)


def _check_rerank_model(model: Any, name: str) -> None:
    if not getattr(model, "text_input", True):
        raise OpenAIError(400, f"model {name!r} takes token ids, not text: it cannot rerank texts", "model")


def tei_rerank_request(req: Any, models: Mapping[str, Any]) -> RerankCall:
    """TEI's ``/rerank``: ``{"query", "texts", "raw_scores", "return_text", "truncate"}``."""
    name = pick_model(req, models, "reranker")
    _check_rerank_model(models[name], name)
    direction = req.get("truncation_direction")
    if direction not in (None, "right", "Right"):
        raise OpenAIError(400, f"truncation_direction={direction!r}: only right is supported", "truncation_direction")
    return RerankCall(name, _text(req.get("query"), "query"), _documents(req.get("texts"), "texts"),
                      return_documents=_flag(req, "return_text", False), raw_scores=_flag(req, "raw_scores", False),
                      parameters=long_input_parameters(req) or None)


def cohere_rerank_request(req: Any, models: Mapping[str, Any]) -> RerankCall:
    """Cohere / Jina's ``/v1/rerank``: ``{"model", "query", "documents", "top_n", "return_documents"}``."""
    name = pick_model(req, models, "reranker")
    _check_rerank_model(models[name], name)
    docs = _documents(req.get("documents"), "documents")
    top_n = req.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise OpenAIError(400, f"top_n={top_n!r} must be a positive integer", "top_n")
    return RerankCall(name, _text(req.get("query"), "query"), docs, top_n=top_n,
                      return_documents=_flag(req, "return_documents", True),
                      parameters=long_input_parameters(req) or None)


def sigmoid(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # = 1 / (1 + e^-x), without overflow


def _ranked(call: RerankCall, logits: np.ndarray, raw: bool) -> list[tuple[int, float]]:
    scores = np.asarray(logits, dtype=np.float64).reshape(len(call.documents), -1)[:, 0]
    scores = scores if raw else sigmoid(scores)
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if call.top_n is not None:
        order = order[:call.top_n]
    return [(i, float(scores[i])) for i in order]


def tei_rerank_response(call: RerankCall, logits: np.ndarray) -> list[dict[str, Any]]:
    """TEI's answer: ``[{"index", "score", "text"?}]``, best first."""
    return [{"index": i, "score": s, **({"text": call.documents[i]} if call.return_documents else {})}
            for i, s in _ranked(call, logits, call.raw_scores)]


def cohere_rerank_response(call: RerankCall, logits: np.ndarray, tokens: int) -> dict[str, Any]:
    """Cohere / Jina's answer: ``{"id", "model", "results": [{"index", "relevance_score", "document"?}], ...}``."""
    results = [{"index": i, "relevance_score": s,
                **({"document": {"text": call.documents[i]}} if call.return_documents else {})}
               for i, s in _ranked(call, logits, False)]
    return {"id": str(uuid.uuid4()), "model": call.model, "results": results,
            "usage": {"total_tokens": int(tokens)},
            "meta": {"api_version": {"version": "1"}, "billed_units": {"search_units": 1}}}


def _texts(raw: Any, name: str) -> tuple[tuple[str, ...], bool]:
    """A TEI ``inputs``: one text, or a list of them; (texts, whether one text was sent)."""
    if isinstance(raw, str):
        return (_text(raw, name),), True
    if isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        if len(raw) > MAX_DOCUMENTS:
            raise OpenAIError(400, f"{name} has {len(raw)} items; at most {MAX_DOCUMENTS} per request", name)
        return tuple(_text(t, f"{name}[{i}]") for i, t in enumerate(raw)), False
    if isinstance(raw, list) and raw and all(isinstance(t, list) for t in raw):
        raise OpenAIError(400, f"{name}: text pairs are not supported: this server's models take one text here",
                          name)
    raise OpenAIError(400, f"{name} must be a non-empty string or list of strings", name)


def tei_embed_request(req: Any, models: Mapping[str, Any]) -> EmbedCall:
    """TEI's ``/embed``: ``{"inputs": text | [texts], "normalize", "truncate", "dimensions"}`` -> one vector a text."""
    name = pick_model(req, models, "embedding")
    model = models[name]
    if not getattr(model, "text_input", True):
        raise OpenAIError(400, f"model {name!r} takes token ids, not text: use /v1/embeddings", "model")
    texts, _ = _texts(req.get("inputs"), "inputs")
    normalize = _flag(req, "normalize", True)
    if not normalize and getattr(model, "normalized", False):
        raise OpenAIError(400, f"normalize=false: model {name!r} returns unit-length embeddings (its recipe's "
                          "[embedding] normalize); the raw vectors are not kept", "normalize")
    dims = req.get("dimensions")
    return EmbedCall(name, texts, normalize, None if dims is None else check_dimensions(dims, model),
                     long_input_parameters(req) or None)


def tei_embed_response(call: EmbedCall, vectors: np.ndarray) -> list[list[float]]:
    """TEI's answer: one list of floats per text (scaled to unit length when ``normalize``)."""
    vectors = np.asarray(vectors, dtype=np.float32).reshape(len(call.texts), -1)
    if call.normalize:
        norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
        vectors = vectors / np.where(norms > 0, norms, 1.0)
    return vectors.astype(np.float32).tolist()


def predict_request(req: Any, models: Mapping[str, Any]) -> PredictCall:
    """TEI's ``/predict``: ``{"inputs": text | [texts], "raw_scores", "truncate"}``."""
    name = pick_model(req, models, "classification")
    if not getattr(models[name], "text_input", True):
        raise OpenAIError(400, f"model {name!r} takes token ids, not text", "model")
    texts, single = _texts(req.get("inputs"), "inputs")
    return PredictCall(name, texts, single, _flag(req, "raw_scores", False), long_input_parameters(req) or None)


def class_scores(logits: np.ndarray, raw: bool) -> np.ndarray:
    """Per row: the logits (``raw``), their sigmoid for a one-label model, else their softmax."""
    logits = np.asarray(logits, dtype=np.float64)
    if raw:
        return logits
    if logits.shape[-1] == 1:
        return sigmoid(logits)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def predict_response(call: PredictCall, logits: np.ndarray, labels: tuple[str, ...]) -> list[Any]:
    """TEI's answer: ``[{"label", "score"}]`` best first (one text), or one such list per text."""
    scores = class_scores(np.asarray(logits).reshape(len(call.texts), -1), call.raw_scores)
    rows = []
    for row in scores:
        names = labels if len(labels) == len(row) else tuple(f"LABEL_{i}" for i in range(len(row)))
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))
        rows.append([{"label": names[i], "score": float(row[i])} for i in order])
    return rows[0] if call.single else rows


def tei_error(err: OpenAIError) -> dict[str, Any]:
    """An error as TEI answers it: ``{"error": message, "error_type": ...}``."""
    kind = {400: "Validation", 404: "Validation", 413: "Validation", 503: "Overloaded"}.get(err.status, "Backend")
    return {"error": err.message, "error_type": kind}
