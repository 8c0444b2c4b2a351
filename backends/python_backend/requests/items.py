"""Per-request decoding and validation: a bad request is answered alone.

A request becomes a list of *items*, one per sequence (row of its batch axis):
a dict of input name to an array without the batch axis. The executor groups
items across requests; these functions never see Triton objects, so they are
unit-tested without a server.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..contract import TEXT_INPUT_NAMES
from .input_bounds import check_bounds
from .samples import NUMPY_DTYPES
from ..settings import Settings

Item = dict[str, np.ndarray]

_NP = NUMPY_DTYPES


# The BYTES inputs the backend tokenizes: `text`, or a reranker's `query` + `passage`.
TEXT_INPUTS = TEXT_INPUT_NAMES


class RequestError(ValueError):
    """The request is malformed; the message says what and how to fix it (sent as INVALID_ARG)."""


def item_length(item: Item, settings: Settings) -> int:
    """The sequence length of an item (1 for models without a sequence axis)."""
    for spec in settings.inputs:
        if spec.dims and spec.dims[0] == -1 and spec.name in item:
            return int(item[spec.name].shape[0])
    return 1


def items_from_tensors(tensors: Mapping[str, np.ndarray | None], settings: Settings, vocab_size: int | None = None) -> list[Item]:
    """Validate the tensor inputs of one request and split them into items.

    Checks what Triton does not: a batch axis present and equal across inputs,
    equal sequence lengths across an item's inputs, 1 ≤ length ≤ the maximum,
    token ids inside the vocabulary, and required inputs present.
    """
    given = {k: v for k, v in tensors.items() if v is not None}
    if not given:
        if settings.input("text") is not None:
            raise RequestError("the request has no inputs. Send 'text' or the token-id tensors")
        names = ", ".join(f"'{i.name}'" for i in settings.inputs if not i.optional)
        raise RequestError(f"the request has no inputs. Send {names}")
    for spec in settings.inputs:
        if spec.data_type == "TYPE_STRING":
            continue
        if spec.name not in given and not spec.optional:
            raise RequestError(f"input '{spec.name}' is missing")
    rows = None
    for name, arr in given.items():
        spec = settings.input(name)
        if spec is None:
            raise RequestError(f"unknown input '{name}'")
        want = _NP.get(spec.data_type)
        if want is not None and want is not np.object_ and arr.dtype != want:
            raise RequestError(f"input '{name}' has dtype {arr.dtype}, expected {np.dtype(want).name}")
        if arr.ndim != len(spec.dims) + 1:
            raise RequestError(f"input '{name}' has shape {list(arr.shape)}; expected [batch] + {list(spec.dims)}")
        for axis, (got, dim) in enumerate(zip(arr.shape[1:], spec.dims), start=1):
            if dim != -1 and got != dim:
                raise RequestError(f"input '{name}' axis {axis} is {got}, expected {dim}")
            if got == 0 and axis > 1:  # axis 1 of a sequence input is reported as an empty sequence below
                raise RequestError(f"input '{name}' has an empty axis {axis}")
        if rows is None:
            rows = arr.shape[0]
        elif arr.shape[0] != rows:
            raise RequestError(f"input '{name}' has batch {arr.shape[0]}, other inputs have {rows}")
    assert rows is not None
    if rows == 0:
        raise RequestError("the request has an empty batch")
    seq_names = [n for n in given if (s := settings.input(n)) is not None and s.dims and s.dims[0] == -1]
    lengths = {given[n].shape[1] for n in seq_names}
    if len(lengths) > 1:
        raise RequestError(f"inputs {seq_names} have different sequence lengths {sorted(lengths)}")
    if lengths:
        length = lengths.pop()
        if length == 0:
            raise RequestError("the request has an empty sequence (length 0)")
        if length > settings.max_sequence_length:
            fix = ("truncate the input or send text, which is truncated for you" if settings.input("text") is not None
                   else "send at most that many positions")
            raise RequestError(f"sequence length {length} exceeds the maximum {settings.max_sequence_length}; {fix}")
    for name, arr in given.items():
        problem = check_bounds(name, arr, settings.input_bounds)
        if problem:
            raise RequestError(f"{problem}; send values in that range")
    ids = given.get("input_ids")
    if ids is not None and vocab_size is not None:  # the tokenizer's vocabulary, when config.pbtxt names none
        problem = check_bounds("input_ids", ids, {"input_ids": (0, vocab_size - 1)})
        if problem:
            raise RequestError(f"{problem} (the vocabulary); send ids in that range")
    mask = given.get("attention_mask")
    if ids is not None and mask is None and settings.input("attention_mask") is not None:
        raise RequestError("input_ids were sent without attention_mask")
    if ids is None and settings.input("input_ids") is not None:
        # Found by fuzzing: a mask alone reached the engine and failed the whole window.
        send = "Send 'text', or input_ids" if settings.input("text") is not None else "Send input_ids"
        raise RequestError(f"{', '.join(sorted(given))} sent without input_ids. {send} with its attention_mask")
    return [{name: np.ascontiguousarray(arr[r]) for name, arr in given.items()} for r in range(rows)]


def check_items(items: Sequence[Item], settings: Settings) -> None:
    """Refuse items (e.g. tokenized text) holding a value outside an input's bounds (never sent to an engine)."""
    for row, item in enumerate(items):
        for name, arr in item.items():
            problem = check_bounds(name, arr, settings.input_bounds)
            if problem:
                raise RequestError(f"row {row}: {problem}")


def decode_texts(raw: np.ndarray, name: str = "text") -> list[str]:
    """Decode a BYTES tensor of shape [batch, 1] into strings, refusing empty or undecodable ones."""
    if raw.ndim != 2 or raw.shape[1] != 1:
        raise RequestError(f"input '{name}' has shape {list(raw.shape)}; expected [batch, 1]")
    texts = []
    for i, value in enumerate(raw[:, 0]):
        if isinstance(value, str):
            text = value
        else:
            try:
                text = bytes(value).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RequestError(f"{name}[{i}] is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
        if not text.strip():
            raise RequestError(f"{name}[{i}] is empty")
        texts.append(text)
    if not texts:
        raise RequestError("the request has an empty batch")
    return texts


def item_from_encoding(enc: Any, input_names: Sequence[str]) -> Item:
    """One item from a tokenizer's encoding: ``input_ids``, ``attention_mask`` and, if the model takes them,
    ``token_type_ids``."""
    item = {"input_ids": np.asarray(enc.ids, dtype=np.int64),
            "attention_mask": np.asarray(enc.attention_mask, dtype=np.int64)}
    if "token_type_ids" in input_names:
        item["token_type_ids"] = np.asarray(enc.type_ids, dtype=np.int64)
    return item


def items_from_texts(texts: Sequence[str | tuple[str, str]], tokenizer: Any, input_names: Sequence[str]) -> list[Item]:
    """Tokenize texts, or (query, passage) pairs, as the tokenizer is set up, into items with the id inputs.

    A pair is tokenized as a pair: ``[CLS] query [SEP] passage [SEP]`` with ``token_type_ids`` 0 then 1
    (the model's own post-processor decides), which is what a cross-encoder was trained on. Texts over the
    model's maximum are the job of ``long_inputs`` (refused, truncated said, or chunked).
    """
    return [item_from_encoding(enc, input_names) for enc in tokenizer.encode_batch(list(texts))]


def texts_from_text_inputs(raw: Mapping[str, np.ndarray]) -> list[str] | list[tuple[str, str]]:
    """A request's BYTES inputs decoded: the ``text`` rows, or (query, passage) pairs (a reranker's)."""
    if "query" in raw or "passage" in raw:
        missing = [n for n in ("query", "passage") if n not in raw]
        if missing:
            raise RequestError(f"input '{missing[0]}' is missing: a reranker scores pairs, send 'query' and "
                               "'passage' together (one row each per pair)")
        queries, passages = decode_texts(raw["query"], "query"), decode_texts(raw["passage"], "passage")
        if len(queries) != len(passages):
            raise RequestError(f"'query' has {len(queries)} rows and 'passage' {len(passages)}; send one query "
                               "row per passage row")
        return list(zip(queries, passages))
    return decode_texts(raw["text"])


def items_from_text_inputs(raw: Mapping[str, np.ndarray], tokenizer: Any, input_names: Sequence[str]) -> list[Item]:
    """Items from a request's BYTES inputs: ``text``, or ``query`` + ``passage`` (a reranker's pairs)."""
    return items_from_texts(texts_from_text_inputs(raw), tokenizer, input_names)


def request_parameters(parameters: "str | Mapping[str, Any] | None") -> "Mapping[str, Any]":
    """A request's parameters (Triton hands them over as JSON text) as a mapping; ``{}`` when absent or unreadable."""
    import json

    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters) if parameters.strip() else {}
        except ValueError:
            return {}
    return parameters if isinstance(parameters, Mapping) else {}
