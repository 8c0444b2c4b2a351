"""The OpenAI API's request and response shapes, translated to and from Triton's generate inputs.

Pure functions (no server): :func:`completion_request` and :func:`chat_request` check an OpenAI body and
return the Triton generate body (``backend/contract.GENERATE_INPUTS`` names); :func:`render_chat` applies
the model's chat template (``generation.json``'s ``chat_template``, the tokenizer's) with Jinja2's sandbox;
the ``*_chunk`` / ``*_response`` functions build what the ``openai`` client reads. A bad value raises
:class:`OpenAIError` with the status and the parameter it names (400), as the OpenAI API answers.

Beyond OpenAI's own fields, the vLLM extensions ``top_k``, ``min_tokens``, ``ignore_eos`` and
``repetition_penalty`` are taken (the ``openai`` client sends them with ``extra_body``). Without
``temperature`` a request is generated as the model's generation config says (greedy unless it samples).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

# OpenAI fields passed to the backend as they are (it checks their values and names the bad one).
_PASSED = ("max_tokens", "temperature", "top_p", "seed", "top_k", "min_tokens", "ignore_eos", "repetition_penalty")
# Fields taken and left at their meaning-free defaults (anything else in them is refused, not ignored).
_NEUTRAL = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": None,
            "top_logprobs": None, "echo": False, "suffix": None, "logit_bias": None, "user": None,
            "stream_options": None, "response_format": None, "tools": None, "tool_choice": None,
            "parallel_tool_calls": None, "max_completion_tokens": None, "metadata": None, "store": None}
_TYPES = {"max_tokens": int, "temperature": (int, float), "top_p": (int, float), "seed": int, "top_k": int,
          "min_tokens": int, "ignore_eos": bool, "repetition_penalty": (int, float)}


class OpenAIError(Exception):
    """An OpenAI-style error: HTTP ``status``, a message naming the problem, the parameter if one."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: float | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = status, message, param, retry_after_s
        self.kind = kind or {400: "invalid_request_error", 404: "not_found_error", 503: "server_busy"}.get(
            status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class GenerateCall:
    """What one OpenAI request asks Triton: the model, the generate body, whether to stream, usage in stream."""

    model: str
    body: dict[str, Any]
    stream: bool
    include_usage: bool


def _check_common(req: Mapping[str, Any], models: Mapping[str, Any]) -> tuple[str, dict[str, Any], bool, bool]:
    if not isinstance(req, Mapping):
        raise OpenAIError(400, "the body must be a JSON object")
    model = req.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model is required: one of " + ", ".join(sorted(models)), "model")
    if model not in models:
        raise OpenAIError(404, f"model {model!r} is not served here: use one of {', '.join(sorted(models))}", "model")
    body: dict[str, Any] = {"exclude_input_in_output": True}
    if "max_completion_tokens" in req and req.get("max_completion_tokens") is not None and "max_tokens" not in req:
        req = dict(req, max_tokens=req["max_completion_tokens"])
    for name in _PASSED:
        value = req.get(name)
        if value is None:
            continue
        kind = _TYPES[name]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise OpenAIError(400, f"{name}={value!r} has the wrong type", name)
        body[name] = value
    for name, neutral in _NEUTRAL.items():
        value = req.get(name)
        if name in ("max_completion_tokens", "stream_options", "user", "metadata", "store"):
            continue
        if value is not None and value != neutral and not (name == "tool_choice" and value == "none"):
            raise OpenAIError(400, f"{name}={value!r} is not supported by this server (use {neutral!r})", name)
    stop = req.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise OpenAIError(400, "stop must be a string or a list of strings", "stop")
        if stop:
            body["stop"] = stop
    stream = req.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise OpenAIError(400, f"stream={stream!r} must be true or false", "stream")
    options = req.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise OpenAIError(400, "stream_options must be an object", "stream_options")
    body["stream"] = stream
    return model, body, stream, bool(options.get("include_usage"))


def completion_request(req: Mapping[str, Any], models: Mapping[str, Any]) -> GenerateCall:
    """``/v1/completions``: ``prompt`` is a string, a list of one string, or a list of token ids."""
    model, body, stream, usage = _check_common(req, models)
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        body["text_input"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        body["prompt_ids"] = prompt
    else:
        raise OpenAIError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if "max_tokens" not in body:
        body["max_tokens"] = 16  # the OpenAI completions default
    return GenerateCall(model, body, stream, usage)


def render_chat(template: str | None, messages: Any) -> str:
    """The prompt of a chat: the model's chat template over ``messages``, with the assistant's turn opened."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise OpenAIError(400, f"messages[{i}] must be an object with a role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise OpenAIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise OpenAIError(400, f"messages[{i}].content must be a string", "messages")
        clean.append({"role": m["role"], "content": content})
    if not template:
        raise OpenAIError(400, "this model has no chat template: use /v1/completions", "messages")
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=clean, add_generation_prompt=True, bos_token="",
                                                eos_token="")
    except TemplateError as exc:
        raise OpenAIError(400, f"the chat template failed on these messages: {exc}", "messages") from None


def chat_request(req: Mapping[str, Any], models: Mapping[str, Any]) -> GenerateCall:
    """``/v1/chat/completions``: the messages rendered with the model's chat template."""
    model, body, stream, usage = _check_common(req, models)
    body["text_input"] = render_chat(getattr(models[model], "chat_template", None), req.get("messages"))
    return GenerateCall(model, body, stream, usage)


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": int(prompt), "completion_tokens": int(completion),
            "total_tokens": int(prompt) + int(completion)}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_response(model: str, text: str, finish: str, n_in: int, n_out: int) -> dict[str, Any]:
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": usage(n_in, n_out)}


def chat_response(model: str, text: str, finish: str, n_in: int, n_out: int) -> dict[str, Any]:
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": usage(n_in, n_out)}


def openai_finish(reason: str | None) -> str | None:
    """The backend's finish reason as OpenAI's (stop, length; a cancelled one never reaches a client)."""
    if not reason:
        return None
    return reason if reason in ("stop", "length") else "stop"


def triton_error(status: int, message: str) -> OpenAIError:
    """An error Triton answered, as the OpenAI API would: busy -> 503 with Retry-After, bad values -> 400."""
    if "server busy" in message:
        import re

        match = re.search(r"retry after (\d+)", message)
        return OpenAIError(503, message, retry_after_s=float(match.group(1)) if match else 1.0)
    if status == 400 or status == 0:
        param = message.split("=", 1)[0].strip() if "=" in message.split(" ", 1)[0] else None
        return OpenAIError(400, message, param)
    if status == 404:
        return OpenAIError(404, message)
    return OpenAIError(502 if status >= 500 else status, f"the inference server answered: {message}")
