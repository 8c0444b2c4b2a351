"""The frontend's encoder routes: ``/v1/embeddings`` (OpenAI), ``/embed``, ``/rerank`` and ``/predict`` (TEI),
``/v1/rerank`` (Cohere / Jina), registered on the OpenAI frontend's aiohttp application (``openai_api``).

Each request is checked (``openai_encoders``, ``tei_protocol``), sent to the model through Triton's KServe
``infer`` like any client's (``kserve_infer``: one call, or one per ``max_batch_size`` rows, sent together, and
token-id rows grouped by length, over the routes' own kept-alive loopback connections), and answered in the shape
its API reads. The request id (the client's ``X-Request-ID``, else one generated) goes to Triton in the same
header, so the backend's events name it, and comes back on the answer. Tokens for ``usage`` are counted with the
model's own tokenizer (``encoder_models``), beside the infer call (a large request's off the event loop).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Awaitable, Callable, Mapping, Sequence

import numpy as np

from model_factory.serving.encoder_models import CLASSIFICATION, EMBEDDING, RERANKER, EncoderModel
from model_factory.serving.kserve_infer import LoopbackClient, infer
from model_factory.serving.openai_encoders import embeddings_request, embeddings_response, shape_vectors
from model_factory.serving.openai_protocol import OpenAIError
from model_factory.serving.tei_protocol import (cohere_rerank_request, cohere_rerank_response, predict_request,
                                                predict_response, tei_embed_request, tei_embed_response, tei_error,
                                                tei_rerank_request, tei_rerank_response)

TRUNCATED = "truncated_tokens"
# A row the backend names in its message: text[3], query[3], passage[3].
_ROW = re.compile(r"\b(text|query|passage)\[(\d+)\]")
INLINE_COUNT = 16  # texts counted on the event loop; more go to a worker thread


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    size = size if size > 0 else n
    return [(i, min(n, i + size)) for i in range(0, n, size)]


class EncoderRoutes:
    """The handlers; ``request_id`` is the frontend's id rule. The calls to Triton (``triton``: its HTTP URL) go
    over one :class:`~model_factory.serving.kserve_infer.LoopbackClient`, closed by :meth:`close`."""

    def __init__(self, triton: str, models: Mapping[str, EncoderModel], request_id: Callable[[Any], str]) -> None:
        self.triton = triton
        self.models = dict(models)
        self._client = LoopbackClient(triton)
        self._request_id = request_id

    def close(self) -> None:
        self._client.close()

    def of(self, task: str) -> dict[str, EncoderModel]:
        return {n: m for n, m in self.models.items() if m.task == task}

    def add_to(self, app: Any) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/embed", self.tei_embed)
        app.router.add_post("/rerank", self.tei_rerank)
        app.router.add_post("/v1/rerank", self.cohere_rerank)
        app.router.add_post("/predict", self.predict)

    # ------------------------------------------------------------------ the calls to Triton

    async def _run(self, model: EncoderModel, rows: int, inputs: Callable[[int, int], dict[str, Any]],
                   outputs: Sequence[str], parameters: Mapping[str, Any] | None, rid: str) -> dict[str, np.ndarray]:
        """``rows`` rows through the model's infer, ``max_batch`` rows a call (sent together), joined in order."""
        async def part(a: int, b: int) -> dict[str, np.ndarray]:
            try:
                return await infer(self._client, model.name, inputs(a, b), outputs, parameters, rid)
            except OpenAIError as err:
                if a:  # the backend numbers the rows of the call it was sent: name them as the client sent them
                    err.message = _ROW.sub(lambda m: f"{m.group(1)}[{int(m.group(2)) + a}]", err.message)
                    err.args = (err.message,)
                raise

        parts = await asyncio.gather(*(part(a, b) for a, b in _chunks(rows, model.max_batch)))
        return {o: np.concatenate([p[o] for p in parts]) if o in parts[0] else None for o in outputs}

    async def _text_outputs(self, model: EncoderModel, inputs: dict[str, Sequence[str]], rows: int,
                            parameters: Mapping[str, Any] | None, rid: str,
                            truncated: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The model's output for text rows, and (``truncated``) the tokens cut from each, else zeros."""
        outputs = (model.output, TRUNCATED) if truncated and model.text_input else (model.output,)
        got = await self._run(model, rows, lambda a, b: {k: v[a:b] for k, v in inputs.items()}, outputs,
                              parameters, rid)
        truncated = got.get(TRUNCATED)
        return got[model.output], (np.zeros(rows, np.int64) if truncated is None else truncated.reshape(-1))

    async def _id_outputs(self, model: EncoderModel, ids: Sequence[Sequence[int]], rid: str) -> np.ndarray:
        """Token-id rows: one group per length (a KServe tensor is rectangular), each as its own calls."""
        by_length: dict[int, list[int]] = {}
        for i, row in enumerate(ids):
            by_length.setdefault(len(row), []).append(i)

        async def one(rows: list[int]) -> np.ndarray:
            arr = np.asarray([ids[i] for i in rows], dtype=np.int64)
            return (await self._run(model, len(rows), lambda a, b: {"input_ids": arr[a:b],
                                                                    "attention_mask": np.ones_like(arr[a:b])},
                                    (model.output,), None, rid))[model.output]

        groups = list(by_length.values())
        results = await asyncio.gather(*(one(g) for g in groups))
        out = np.empty((len(ids),) + results[0].shape[1:], dtype=results[0].dtype)
        for rows, res in zip(groups, results):
            out[rows] = res
        return out

    async def _count(self, model: EncoderModel, texts: Sequence[Any]) -> int:
        """Tokens of ``texts`` for ``usage``."""
        return int(sum(await self._counts(model, texts)))

    async def _counts(self, model: EncoderModel, texts: Sequence[Any]) -> list[int]:
        """Each text's tokens, untruncated: a few inline (tens of microseconds, less than a thread's hand-over),
        many off the event loop."""
        if len(texts) <= INLINE_COUNT:
            return model.tokens.count(list(texts))
        return await asyncio.get_running_loop().run_in_executor(None, model.tokens.count, list(texts))

    # ------------------------------------------------------------------ handlers

    async def _answer(self, request: Any, handle: Callable[[Any, str], Awaitable[Any]], tei: bool = False) -> Any:
        from aiohttp import web

        rid = self._request_id(request)
        headers = {"X-Request-ID": rid}
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise OpenAIError(400, "the body is not JSON") from None
            return web.json_response(await handle(body, rid), headers=headers, dumps=_dumps)
        except OpenAIError as err:
            if err.retry_after_s:
                headers["Retry-After"] = str(int(max(1, err.retry_after_s)))
            return web.json_response(tei_error(err) if tei else err.body(), status=err.status, headers=headers)

    async def embeddings(self, request: Any) -> Any:
        async def handle(body: Any, rid: str) -> Any:
            call = embeddings_request(body, self.of(EMBEDDING))
            model = self.models[call.model]
            if call.texts:
                mode = long_input_mode(call.parameters, model)
                cut_here = mode in ("refuse", "truncate") and model.max_length is not None
                (vectors, truncated), counts = await asyncio.gather(
                    self._text_outputs(model, {"text": call.texts}, call.count, call.parameters, rid,
                                       truncated=not cut_here),
                    self._counts(model, call.texts))
                if cut_here:  # what the backend kept: the whole text, or its first max_length tokens (refuse: all)
                    tokens = sum(min(n, model.max_length) for n in counts)
                else:  # chunk (or limits unknown): the backend says what it dropped
                    tokens = int(sum(counts)) - int(truncated.sum())
            else:
                vectors = await self._id_outputs(model, call.token_ids, rid)
                tokens = sum(len(row) for row in call.token_ids)
            vectors = shape_vectors(vectors.reshape(call.count, -1), call.dimensions)
            return embeddings_response(call.model, vectors, call.encoding_format, tokens)

        return await self._answer(request, handle)

    async def tei_embed(self, request: Any) -> Any:
        async def handle(body: Any, rid: str) -> Any:
            call = tei_embed_request(body, self.of(EMBEDDING))
            vectors, _ = await self._text_outputs(self.models[call.model], {"text": call.texts}, len(call.texts),
                                                  call.parameters, rid)
            return tei_embed_response(call, shape_vectors(vectors.reshape(len(call.texts), -1), call.dimensions))

        return await self._answer(request, handle, tei=True)

    async def _rerank_scores(self, call: Any, rid: str) -> np.ndarray:
        model = self.models[call.model]
        scores, _ = await self._text_outputs(model, {"query": [call.query] * len(call.documents),
                                                     "passage": list(call.documents)},
                                             len(call.documents), call.parameters, rid)
        return scores

    async def tei_rerank(self, request: Any) -> Any:
        async def handle(body: Any, rid: str) -> Any:
            call = tei_rerank_request(body, self.of(RERANKER))
            return tei_rerank_response(call, await self._rerank_scores(call, rid))

        return await self._answer(request, handle, tei=True)

    async def cohere_rerank(self, request: Any) -> Any:
        async def handle(body: Any, rid: str) -> Any:
            call = cohere_rerank_request(body, self.of(RERANKER))
            scores, tokens = await asyncio.gather(self._rerank_scores(call, rid),
                                                  self._count(self.models[call.model], call.pairs))
            return cohere_rerank_response(call, scores, tokens)

        return await self._answer(request, handle)

    async def predict(self, request: Any) -> Any:
        async def handle(body: Any, rid: str) -> Any:
            call = predict_request(body, self.of(CLASSIFICATION))
            model = self.models[call.model]
            logits, _ = await self._text_outputs(model, {"text": call.texts}, len(call.texts), call.parameters, rid)
            return predict_response(call, logits, model.labels)

        return await self._answer(request, handle, tei=True)


def long_input_mode(parameters: Mapping[str, Any] | None, model: EncoderModel) -> str:
    """The long-input mode the backend applies to a request: its ``long_inputs``, its ``truncate`` (true: truncate,
    false: refuse), else the model's default (as the backend's ``TextEncoder.mode_for`` reads them; both already
    checked by ``openai_encoders.long_input_parameters``)."""
    params = parameters or {}
    if "long_inputs" in params:
        return str(params["long_inputs"])
    if "truncate" in params:
        return "truncate" if params["truncate"] else "refuse"
    return model.long_inputs


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
