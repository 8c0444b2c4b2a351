"""Texts longer than the model's ``max_sequence_length``: refused, truncated (and said so), or chunked.

Nothing is cut silently (docs/inputs.md). A text is tokenized whole first; only when it is over the limit does
the mode apply:

- ``refuse``: the request gets INVALID_ARG (HTTP 400) naming the text's length and the limit.
- ``truncate``: the model sees the first ``max_sequence_length`` tokens (the tokenizer's own truncation, so the
  closing special tokens stay); the ``truncated_tokens`` output says per row how many it did not see, and
  ``model_factory_truncated_tokens_total`` counts them.
- ``chunk`` (embedding models): overlapping windows of ``max_sequence_length`` tokens (``chunk_overlap`` shared
  between neighbours), each run as its own item, pooled back into one vector: the mean of the windows' vectors
  weighted by the tokens each adds (so the overlap is not counted twice), scaled to unit length when the
  model's embeddings are.

The model's mode is its ``long_inputs`` parameter; a request may ask for another with the request parameter
``long_inputs`` (``refuse``/``truncate``/``chunk``) or, as text-embeddings-inference spells it, ``truncate``
(true: truncate, false: refuse). No Triton objects here: unit-tested with the real tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..contract import LONG_INPUTS
from .items import Item, RequestError, item_from_encoding, request_parameters


class LongInputRefused(RequestError):
    """A text over the limit under ``refuse`` (``length`` tokens, ``limit`` the maximum)."""

    def __init__(self, length: int, limit: int, message: str) -> None:
        super().__init__(message)
        self.length, self.limit = length, limit


@dataclass(frozen=True)
class EncodedTexts:
    """One request's texts as items: ``spans[r]`` items for text row ``r`` (more than 1: chunked)."""

    items: list[Item]
    spans: tuple[int, ...]
    lengths: tuple[int, ...]  # each row's whole length in tokens (special tokens included)
    dropped: tuple[int, ...]  # tokens of each row the model does not see (truncate)
    weights: tuple[tuple[float, ...], ...]  # per row, the tokens each of its windows adds (chunk)

    @property
    def truncated_rows(self) -> int:
        return sum(1 for d in self.dropped if d)

    @property
    def chunked_rows(self) -> int:
        return sum(1 for n in self.spans if n > 1)


def _copy(tokenizer: Any) -> Any:
    from tokenizers import Tokenizer  # the backend's tokenizer is a tokenizers.Tokenizer (tokenizer.py)

    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.no_padding()
    return tok


class TextEncoder:
    """Tokenizes a request's texts whole, then applies the long-input mode to the rows over ``max_length``."""

    def __init__(self, tokenizer: Any, max_length: int, overlap: int, pooling: str) -> None:
        self.max_length = int(max_length)
        self.pooling = pooling
        self._whole = _copy(tokenizer)
        self._whole.no_truncation()
        self._specials = self._whole.num_special_tokens_to_add(False)
        self._cut = _copy(tokenizer)
        self._cut.enable_truncation(max_length=self.max_length)
        # The tokenizer refuses a stride that leaves a window nothing new: keep at least one new token each.
        self.overlap = max(0, min(int(overlap), self.max_length - self._specials - 1))
        self._windows = None
        if pooling != "none":
            self._windows = _copy(tokenizer)
            self._windows.enable_truncation(max_length=self.max_length, stride=self.overlap)

    def mode_for(self, parameters: str | Mapping[str, Any] | None, default: str) -> str:
        """The mode a request asks for (its ``long_inputs`` or ``truncate`` parameter), else ``default``."""
        params = request_parameters(parameters)
        mode = default
        if "long_inputs" in params:
            mode = str(params["long_inputs"]).strip().lower()
            if mode not in LONG_INPUTS:
                raise RequestError(f"parameter long_inputs={params['long_inputs']!r}: use refuse, truncate or chunk")
        if "truncate" in params:
            flag = params["truncate"]
            if isinstance(flag, str) and flag.strip().lower() in ("true", "false"):
                flag = flag.strip().lower() == "true"
            if not isinstance(flag, bool):
                raise RequestError(f"parameter truncate={flag!r}: use true or false")
            wanted = "truncate" if flag else "refuse"
            if "long_inputs" in params and wanted != mode:
                raise RequestError(f"parameters truncate={str(flag).lower()} and long_inputs={mode} disagree; send one")
            mode = wanted
        if mode == "chunk" and self._windows is None:
            raise RequestError("long_inputs=chunk is for embedding models (one vector per text); this model does "
                               "not pool chunks: use refuse or truncate")
        return mode

    def encode(self, texts: Sequence[str | tuple[str, str]], mode: str, input_names: Sequence[str]) -> EncodedTexts:
        """Items for ``texts`` under ``mode``; raises :class:`RequestError` for a long text under ``refuse``."""
        items: list[Item] = []
        spans, lengths, dropped, weights = [], [], [], []
        for row, (text, enc) in enumerate(zip(texts, self._whole.encode_batch(list(texts)))):
            n = len(enc.ids)
            lengths.append(n)
            if n <= self.max_length:
                items.append(item_from_encoding(enc, input_names))
                spans.append(1), dropped.append(0), weights.append((1.0,))
                continue
            pair = isinstance(text, tuple)
            what = f"query+passage[{row}]" if pair else f"text[{row}]"
            if mode == "refuse":
                raise LongInputRefused(n, self.max_length,
                    f"{what} is {n} tokens, over this model's limit of {self.max_length} (max_sequence_length). "
                    "Fix: send a shorter text, or ask for long_inputs=truncate (the response's 'truncated_tokens' "
                    "says how many tokens were cut)" + ("" if self._windows is None or pair
                                                        else " or long_inputs=chunk (one vector from overlapping "
                                                             "windows)"))
            if mode == "chunk" and not pair:
                assert self._windows is not None
                first = self._windows.encode(text)
                windows = [first] + list(first.overflowing)
                items.extend(item_from_encoding(w, input_names) for w in windows)
                body = [len(w.ids) - self._specials for w in windows]
                weights.append(tuple(float(b - (self.overlap if i else 0)) for i, b in enumerate(body)))
                spans.append(len(windows)), dropped.append(0)
                continue
            if mode == "chunk":  # a pair scores as one sequence: it cannot be pooled from windows
                raise RequestError(f"{what} is {n} tokens, over the limit of {self.max_length}, and a "
                                   "query+passage pair cannot be chunked. Fix: ask for long_inputs=truncate")
            try:
                cut = self._cut.encode(*text) if pair else self._cut.encode(text)
            except Exception as exc:  # noqa: BLE001 - tokenizers raises its own type (a pair it cannot cut)
                raise RequestError(f"{what} is {n} tokens, over the limit of {self.max_length}, and could not be "
                                   f"truncated ({exc}). Fix: send a shorter text") from None
            items.append(item_from_encoding(cut, input_names))
            spans.append(1), dropped.append(n - len(cut.ids)), weights.append((1.0,))
        return EncodedTexts(items, tuple(spans), tuple(lengths), tuple(dropped), tuple(weights))


def pool_chunks(outputs: Mapping[str, np.ndarray], encoded: EncodedTexts, pooling: str) -> dict[str, np.ndarray]:
    """One row per text: each chunked text's window rows pooled (``outputs``: one row per item, pooled outputs
    only), the other rows as they are."""
    if encoded.chunked_rows == 0:
        return dict(outputs)
    starts = np.cumsum((0,) + encoded.spans[:-1])
    pooled = {}
    for name, rows in outputs.items():
        out = np.empty((len(encoded.spans),) + rows.shape[1:], dtype=rows.dtype)
        for r, (start, span) in enumerate(zip(starts, encoded.spans)):
            if span == 1:
                out[r] = rows[start]
                continue
            w = np.asarray(encoded.weights[r], dtype=np.float64)
            vec = (rows[start: start + span].astype(np.float64) * w.reshape((-1,) + (1,) * (rows.ndim - 1))).sum(0)
            vec /= w.sum()
            if pooling == "mean_normalized":
                vec /= max(float(np.linalg.norm(vec)), 1e-12)
            out[r] = vec.astype(rows.dtype)
        pooled[name] = out
    return pooled
