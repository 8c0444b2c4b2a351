"""The OpenAI API's request and response shapes, translated to and from Triton's generate inputs.

Pure functions (no server): :func:`completion_request` and :func:`chat_request` check an OpenAI body and
return the Triton generate body (``backend/contract.GENERATE_INPUTS`` names); :func:`render_chat` applies
the model's chat template (``generation.json``'s ``chat_template``, the tokenizer's) with Jinja2's sandbox;
the ``*_chunk`` / ``*_response`` functions build what the ``openai`` client reads. A bad value raises
:class:`OpenAIError` with the status and the parameter it names (400), as the OpenAI API answers.

Beyond OpenAI's own fields, the vLLM extensions ``top_k``, ``min_tokens``, ``ignore_eos``,
``repetition_penalty`` and ``stop_token_ids`` are taken (the ``openai`` client sends them with ``extra_body``).
Without ``temperature`` a request is generated as the model's generation config says (greedy unless it samples).

``n``, ``logprobs`` (completions: 0..5 alternatives; chat: ``logprobs`` true and ``top_logprobs`` 0..20),
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``stop_token_ids`` go to the backend in
``sampling_parameters`` (vLLM's JSON input); ``best_of`` (completions, not streamed) asks the backend for
``best_of`` sequences with their log-probabilities and keeps the ``n`` of the highest cumulative
log-probability (:func:`best_choices`); ``echo`` prepends the prompt (a text prompt here; a token-id prompt's text
comes from the backend, ``exclude_input_in_output`` false, not streamed). Prompt log-probabilities are not
available: the served graph computes logits only at each row's last position (``logits_positions``), so
``echo`` with ``logprobs`` is refused (400), never answered wrongly. ``max_completion_tokens`` is
``max_tokens`` (it wins when both are given). Structured outputs (``response_format``, vLLM's ``guided_*``:
``openai_guided``) and chat's tool calls (``tools``, ``tool_choice``, ``parallel_tool_calls``: ``openai_tools``) go to
the backend as ``sampling_parameters``' ``guided`` grammar; a tool call's answer is made by ``openai_tools``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Mapping

from model_factory.serving.openai_errors import OpenAIError
from model_factory.serving.openai_guided import guided_request
from model_factory.serving.openai_tools import ToolPlan, tool_plan

# OpenAI fields passed to the backend as they are (it checks their values and names the bad one).
_PASSED = ("max_tokens", "temperature", "top_p", "seed", "top_k", "min_tokens", "ignore_eos", "repetition_penalty")
# Fields taken and left at their meaning-free defaults (anything else in them is refused, not ignored).
_NEUTRAL = {"suffix": None, "user": None, "metadata": None, "store": None}
_IGNORED = ("user", "metadata", "store")  # informational: taken whatever they hold
MAX_N = 128  # OpenAI's bounds
MAX_BEST_OF = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
_TYPES = {"max_tokens": int, "temperature": (int, float), "top_p": (int, float), "seed": int, "top_k": int,
          "min_tokens": int, "ignore_eos": bool, "repetition_penalty": (int, float)}


@dataclass(frozen=True)
class GenerateCall:
    """What one OpenAI request asks Triton: the model, the generate body, whether to stream, usage in stream;
    the choices answered (``n``) out of those generated (``best_of``), the log-probabilities to answer with
    (None: none; completions: alternatives per token; chat: ``top_logprobs``), the text ``echo`` prepends."""

    model: str
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    n: int = 1
    best_of: int = 1
    logprobs: int | None = None
    echo: str = ""
    tools: ToolPlan | None = None  # chat's tool calls (openai_tools): how the output is answered
    guided_param: str | None = None  # the field that asked for a grammar: a 400 from compiling it names it
    shown: str = ""  # the model name answered when it is not ``model`` (a prompt template's: openai_prompts)
    target: str = ""  # the Triton model called, where ``model`` names a LoRA adapter of it (else ``model``)

    @property
    def triton_model(self) -> str:
        return self.target or self.model


def _whole(req: Mapping[str, Any], name: str, low: int, high: int, default: int | None) -> int | None:
    value = req.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(400, f"{name}={value!r} must be an integer", name)
    if not low <= value <= high:
        raise OpenAIError(400, f"{name}={value} must be between {low} and {high}", name)
    return value


def _real(req: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = req.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OpenAIError(400, f"{name}={value!r} must be a number", name)
    if not low <= value <= high:
        raise OpenAIError(400, f"{name}={value} must be between {low:g} and {high:g}", name)
    return float(value)


def _sampling_extras(req: Mapping[str, Any]) -> dict[str, Any]:
    """The fields the backend reads from ``sampling_parameters``: checked here for type and range (400 naming
    them), token ids against the vocabulary there."""
    extra: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _real(req, name, -2.0, 2.0)
        if value:
            extra[name] = value
    bias = req.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise OpenAIError(400, "logit_bias must be an object mapping token ids to a bias", "logit_bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise OpenAIError(400, f"logit_bias holds {len(bias)} tokens: at most {MAX_LOGIT_BIAS}", "logit_bias")
        clean = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.strip().lstrip("-").isdigit()):
                raise OpenAIError(400, f"logit_bias key {key!r} must be a token id", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise OpenAIError(400, f"logit_bias[{key!r}]={value!r} must be a number between -100 and 100",
                                  "logit_bias")
            clean[key.strip()] = float(value)
        if clean:
            extra["logit_bias"] = clean
    stop_ids = req.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise OpenAIError(400, "stop_token_ids must be a list of token ids", "stop_token_ids")
        if stop_ids:
            extra["stop_token_ids"] = stop_ids
    return extra


def _check_common(req: Mapping[str, Any], models: Mapping[str, Any]) -> tuple[str, dict[str, Any], bool, bool]:
    if not isinstance(req, Mapping):
        raise OpenAIError(400, "the body must be a JSON object")
    model = req.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model is required: one of " + ", ".join(sorted(models)), "model")
    if model not in models:
        raise OpenAIError(404, f"model {model!r} is not served here: use one of {', '.join(sorted(models))}", "model")
    body: dict[str, Any] = {"exclude_input_in_output": True}
    if req.get("max_completion_tokens") is not None:  # the chat API's new name of max_tokens (it wins)
        _whole(req, "max_completion_tokens", 1, 2**31 - 1, None)
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
        if name in _IGNORED:
            continue
        if value is not None and value != neutral:
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
    options = req.get("stream_options")
    if options is not None:
        if not isinstance(options, Mapping) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise OpenAIError(400, "stream_options must be an object with include_usage", "stream_options")
        if not stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options.get("include_usage", False), bool):
            raise OpenAIError(400, "stream_options.include_usage must be true or false", "stream_options")
    body["stream"] = stream
    return model, body, stream, bool((options or {}).get("include_usage"))


def _with_extras(body: dict[str, Any], req: Mapping[str, Any], generated: int, logprobs: int | None,
                 guided: dict[str, Any] | None = None) -> None:
    extra = _sampling_extras(req)
    if guided is not None:
        extra["guided"] = guided  # structured outputs: the grammar the backend compiles (openai_guided)
    if generated > 1:
        extra["n"] = generated
    if logprobs is not None:
        extra["logprobs"] = logprobs
    if extra:
        body["sampling_parameters"] = json.dumps(extra)


def routed(call: GenerateCall, models: Mapping[str, Any]) -> GenerateCall:
    """``call`` sent to its model's base with ``lora_name`` in ``sampling_parameters`` where the OpenAI ``model``
    names a LoRA adapter (``ServedModel.base``), as vLLM's Triton backend takes it."""
    served = models.get(call.model)
    base, adapter = getattr(served, "base", None), getattr(served, "adapter", None)
    if not base or not adapter:
        return call
    extra = json.loads(call.body.get("sampling_parameters") or "{}")
    extra["lora_name"] = adapter
    return replace(call, body={**call.body, "sampling_parameters": json.dumps(extra)}, target=base)


def completion_request(req: Mapping[str, Any], models: Mapping[str, Any]) -> GenerateCall:
    """``/v1/completions``: ``prompt`` is a string, a list of one string, or a list of token ids."""
    model, body, stream, usage = _check_common(req, models)
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if req.get(name) is not None:
            raise OpenAIError(400, f"{name} is a /v1/chat/completions parameter, not taken by completions", name)
    guided, guided_param = guided_request(req)
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
    n = _whole(req, "n", 1, MAX_N, 1)
    best_of = _whole(req, "best_of", 1, MAX_BEST_OF, n)
    if best_of < n:
        raise OpenAIError(400, f"best_of={best_of} must be at least n={n}", "best_of")
    if stream and best_of > n:
        raise OpenAIError(400, "best_of cannot be streamed: leave it out or equal to n", "best_of")
    logprobs = _whole(req, "logprobs", 0, MAX_COMPLETION_LOGPROBS, None)
    echo = req.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise OpenAIError(400, f"echo={echo!r} must be true or false", "echo")
    echo_text = ""
    if echo:
        if logprobs is not None:
            raise OpenAIError(400, "echo with logprobs is not supported: the served graph computes logits for the "
                              "last position only, so the prompt's log-probabilities are not available", "echo")
        if isinstance(prompt, str):
            echo_text = prompt
        elif stream:
            raise OpenAIError(400, "echo of a token-id prompt cannot be streamed: send the prompt as text, or "
                              "stream false", "echo")
        else:
            body["exclude_input_in_output"] = False  # the backend prepends the prompt's text
    # best_of > n: the backend's sequences carry their log-probabilities (the choice is made by them).
    _with_extras(body, req, best_of, logprobs if logprobs is not None or best_of == n else 0, guided)
    return routed(GenerateCall(model, body, stream, usage, n=n, best_of=best_of, logprobs=logprobs, echo=echo_text,
                               guided_param=guided_param), models)


def render_chat(template: str | None, messages: Any, tools: list | None = None) -> str:
    """The prompt of a chat: the model's chat template over ``messages`` (and ``tools``, as Hugging Face templates
    take them), with the assistant's turn opened. An assistant turn's ``tool_calls`` and a tool result's
    ``tool_call_id`` and ``name`` are passed on to the template."""
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
        if content is None and (m.get("tool_calls") or m["role"] == "assistant"):
            content = ""  # an assistant turn that called tools
        if not isinstance(content, str):
            raise OpenAIError(400, f"messages[{i}].content must be a string", "messages")
        entry = {"role": m["role"], "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                entry[key] = m[key]
        clean.append(entry)
    if not template:
        raise OpenAIError(400, "this model has no chat template: use /v1/completions", "messages")
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        extra = {"tools": tools} if tools else {}
        return env.from_string(template).render(messages=clean, add_generation_prompt=True, bos_token="",
                                                eos_token="", **extra)
    except TemplateError as exc:
        raise OpenAIError(400, f"the chat template failed on these messages: {exc}", "messages") from None


def chat_request(req: Mapping[str, Any], models: Mapping[str, Any]) -> GenerateCall:
    """``/v1/chat/completions``: the messages rendered with the model's chat template."""
    model, body, stream, usage = _check_common(req, models)
    plan = tool_plan(req)
    guided, guided_param = guided_request(req)
    if plan is not None and plan.guided() is not None:
        if guided is not None:
            raise OpenAIError(400, f"tool_choice={req.get('tool_choice')!r} and {guided_param} each ask for a format: "
                              "give one", guided_param)
        guided, guided_param = plan.guided(), "tools"
    body["text_input"] = render_chat(getattr(models[model], "chat_template", None), req.get("messages"),
                                     plan.template_tools() if plan is not None else None)
    for name, neutral in (("echo", False), ("best_of", 1)):  # completions' parameters
        if req.get(name) not in (None, neutral):
            raise OpenAIError(400, f"{name} is a /v1/completions parameter, not taken by chat", name)
    n = _whole(req, "n", 1, MAX_N, 1)
    asked = req.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise OpenAIError(400, f"logprobs={asked!r} must be true or false", "logprobs")
    top = _whole(req, "top_logprobs", 0, MAX_TOP_LOGPROBS, None)
    if top is not None and not asked:
        raise OpenAIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (top or 0) if asked else None
    _with_extras(body, req, n, logprobs, guided)
    return routed(GenerateCall(model, body, stream, usage, n=n, best_of=n, logprobs=logprobs, tools=plan,
                               guided_param=guided_param), models)


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": int(prompt), "completion_tokens": int(completion),
            "total_tokens": int(prompt) + int(completion)}


def _top_map(entry: Mapping[str, Any], with_chosen: bool = True) -> dict[str, float]:
    top = {alt["token"]: alt["logprob"] for alt in entry.get("top", ())}
    if with_chosen:
        top.setdefault(entry["token"], entry["logprob"])
    return top


def completion_logprobs(entries: list[Mapping[str, Any]], offset: int) -> tuple[dict[str, Any], int]:
    """The backend's per-token entries (``logprobs`` output) in the completions shape: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (per token, the alternatives and the chosen token: OpenAI's "up to
    logprobs + 1") and ``text_offset`` (each token's start in the text, from ``offset``); and the offset after."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        out["tokens"].append(entry["token"])
        out["token_logprobs"].append(entry["logprob"])
        out["top_logprobs"].append(_top_map(entry))
        out["text_offset"].append(offset)
        offset += 0 if entry["token"].startswith("bytes:") else len(entry["token"])
    return out, offset


def chat_logprobs(entries: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The backend's per-token entries in the chat shape: ``content``, each token with its ``logprob``,
    ``bytes`` and ``top_logprobs`` (``top_logprobs`` alternatives, the most likely first)."""
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": a["token"], "logprob": a["logprob"], "bytes": a["bytes"]}
                                          for a in e.get("top", ())]} for e in entries],
            "refusal": None}


def best_choices(choices: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``best_of``: the ``n`` choices of the highest cumulative log-probability (``cumulative_logprob``, as
    vLLM ranks them), best first, indexed 0..n-1."""
    kept = sorted(choices, key=lambda c: -c["cumulative_logprob"])[:n]
    return [dict(c, index=i) for i, c in enumerate(kept)]


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None, index: int = 0,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish: str | None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def completion_response(model: str, choices: list[dict[str, Any]], n_in: int, n_out: int) -> dict[str, Any]:
    """``choices``: each ``index``, ``text``, ``finish_reason`` and ``logprobs`` (completions' shape or None)."""
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                         "finish_reason": c["finish_reason"]} for c in choices],
            "usage": usage(n_in, n_out)}


def chat_response(model: str, choices: list[dict[str, Any]], n_in: int, n_out: int) -> dict[str, Any]:
    """``choices``: each ``index``, ``text``, ``finish_reason`` and ``logprobs`` (chat's shape or None)."""
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c["index"], "message": c.get("message") or {"role": "assistant", "content": c["text"]},
                         "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]} for c in choices],
            "usage": usage(n_in, n_out)}


def openai_finish(reason: str | None) -> str | None:
    """The backend's finish reason as OpenAI's (stop, length; a cancelled one never reaches a client)."""
    if not reason:
        return None
    return reason if reason in ("stop", "length", "tool_calls") else "stop"


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
