"""A generate request's inputs (``contract.GENERATE_INPUTS``) read into a prompt and checked parameters.

The names are those of Triton's vLLM and TensorRT-LLM backends: ``text_input`` (or our ``prompt_ids``),
``stream``, ``max_tokens``, the sampling parameters, ``exclude_input_in_output``, and vLLM's
``sampling_parameters`` JSON object (an explicit input wins over the same name in it; ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``stop_token_ids``, ``logprobs`` and ``n`` are read from it only, as
vLLM's backend reads them; so is ``guided``, the grammar the output follows, or vLLM's Triton backend's
``guided_decoding`` / ``structured_outputs`` for it: ``structured.grammar``). Every bad value is a
:class:`~.sampling.SamplingError` naming it; no exception of another kind leaves :func:`read_generate_request`
for what a client sent.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..lora_contract import LORA_NAME
from .sampling import JSON_NAMES, SamplingError, SamplingParams, parse_sampling
from .structured.grammar import GUIDED_NAMES, guided_parameters

_SCALARS = ("max_tokens", "min_tokens", "ignore_eos", "temperature", "top_k", "top_p", "repetition_penalty", "seed")


@dataclass(frozen=True)
class GenerateRequest:
    """What to generate for one request."""

    prompt_ids: tuple[int, ...]
    prompt_text: str | None
    params: SamplingParams
    stream: bool
    exclude_input: bool
    adapter: str | None = None  # sampling_parameters' lora_name: the LoRA adapter it runs with (None: the base)


def _text(name: str, value: np.ndarray) -> str:
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise SamplingError(f"{name} must be one string, got {flat.size}")
    item = flat[0]
    if isinstance(item, bytes):
        try:
            return item.decode("utf-8")
        except UnicodeDecodeError:
            raise SamplingError(f"{name} is not UTF-8 text") from None
    return str(item)


def _json_parameters(raw: np.ndarray | None) -> dict[str, Any]:
    if raw is None:
        return {}
    text = _text("sampling_parameters", raw)
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SamplingError(f"sampling_parameters is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SamplingError("sampling_parameters must be a JSON object")
    unknown = sorted(set(data) - set(JSON_NAMES) - set(GUIDED_NAMES) - {"stream", LORA_NAME})
    if unknown:
        raise SamplingError(f"sampling_parameters has unknown names {unknown}: use {', '.join(JSON_NAMES)}")
    return data


def read_generate_request(get: Callable[[str], np.ndarray | None], tokenizer: Any, spec: Any,
                          max_context: int) -> GenerateRequest:
    """Read one request; ``get(name)`` returns an input as numpy or None when absent."""
    given = _json_parameters(get("sampling_parameters"))
    adapter = given.pop(LORA_NAME, None)
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise SamplingError(f"{LORA_NAME} must be an adapter's name (a non-empty string)")
    for name in _SCALARS:
        value = get(name)
        if value is not None:
            given[name] = value
    stop = get("stop")
    if stop is not None:
        given["stop"] = stop
    text_raw, ids_raw = get("text_input"), get("prompt_ids")
    if text_raw is not None and ids_raw is not None:
        raise SamplingError("give text_input or prompt_ids, not both")
    text = None
    if ids_raw is not None:
        ids = np.asarray(ids_raw).reshape(-1)
        if ids.dtype.kind not in "iu":
            raise SamplingError("prompt_ids must be integers")
        bad = ids[(ids < 0) | (ids >= spec.vocab_size)]
        if bad.size:
            raise SamplingError(f"prompt_ids holds {int(bad[0])}, outside the vocabulary [0, {spec.vocab_size})")
        prompt = tuple(int(t) for t in ids)
    elif text_raw is not None:
        if tokenizer is None:
            raise SamplingError("this model has no tokenizer: give prompt_ids")
        text = _text("text_input", text_raw)
        prompt = tuple(tokenizer.encode(text).ids)
    else:
        raise SamplingError("the request has neither text_input nor prompt_ids")
    params = parse_sampling(given, spec.defaults, prompt_tokens=len(prompt), max_context=max_context,
                            vocab_size=spec.vocab_size)
    guided = guided_parameters(given)
    if guided is not None:
        params = dataclasses.replace(params, guided=guided)
    stream = _flag_input(get("stream"), given.get("stream"), "stream")
    exclude = _flag_input(get("exclude_input_in_output"), given.get("exclude_input_in_output"),
                          "exclude_input_in_output")
    return GenerateRequest(prompt, text, params, stream, exclude, adapter)


def request_inputs(req: GenerateRequest) -> dict[str, np.ndarray]:
    """The inputs that ask for ``req`` again, not streamed: its prompt ids and every sampling parameter (a
    rollout's shadow mirror sends them to the candidate, which reads them back to the same request)."""
    p = req.params
    inputs = {
        "prompt_ids": np.asarray(req.prompt_ids, dtype=np.int32),
        "stream": np.array([False]),
        "exclude_input_in_output": np.array([True]),  # the mirror compares ids: no prompt text to decode
        "max_tokens": np.array([p.max_tokens], dtype=np.int32),
        "min_tokens": np.array([p.min_tokens], dtype=np.int32),
        "ignore_eos": np.array([p.ignore_eos]),
        "temperature": np.array([p.temperature], dtype=np.float32),
        "top_k": np.array([p.top_k], dtype=np.int32),
        "top_p": np.array([p.top_p], dtype=np.float32),
        "repetition_penalty": np.array([p.repetition_penalty], dtype=np.float32),
    }
    if p.seed is not None:
        inputs["seed"] = np.array([p.seed], dtype=np.int64)
    if p.stop:
        inputs["stop"] = np.array([s.encode("utf-8") for s in p.stop], dtype=np.object_)
    extra = {name: value for name, value in (
        ("presence_penalty", p.presence_penalty), ("frequency_penalty", p.frequency_penalty),
        ("logit_bias", {str(t): b for t, b in p.logit_bias}), ("stop_token_ids", list(p.stop_token_ids)),
        ("guided", p.guided.as_json() if p.guided is not None else None), (LORA_NAME, req.adapter)) if value}
    if extra:
        inputs["sampling_parameters"] = np.array([json.dumps(extra).encode("utf-8")], dtype=np.object_)
    return inputs


def _flag_input(value: np.ndarray | None, fallback: Any, name: str) -> bool:
    if value is None:
        value = fallback
    if value is None:
        return False
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1 or flat.dtype.kind not in "b":
        raise SamplingError(f"{name} must be one boolean")
    return bool(flat[0])
