"""Structured outputs on the OpenAI API: ``response_format``, vLLM's ``structured_outputs`` and its older ``guided_*``
extensions, checked (a 400 naming the field) and turned into the backend's ``guided`` object (``sampling_parameters``,
read by ``backend/generation/structured/grammar.py``, which compiles it against the model's tokenizer).

| asked | the backend's ``guided`` |
| --- | --- |
| ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` | ``{"json": schema}`` |
| ``response_format: {"type": "json_object"}`` | ``{"json_object": true}`` |
| ``response_format: {"type": "text"}`` | none |
| ``guided_json`` (a schema, or its JSON text), ``guided_regex``, ``guided_choice``, ``guided_grammar`` | ``json``, ``regex``, ``choice``, ``grammar`` |
| ``structured_outputs: {"json", "regex", "choice", "grammar" or "json_object": ...}`` (vLLM >= 0.10) | the same key |

``structured_outputs`` is vLLM's ``StructuredOutputsParams``: exactly one of ``json``, ``regex``, ``choice``,
``grammar``, ``json_object`` (each checked as its ``guided_*`` twin); its options ``disable_fallback``,
``disable_any_whitespace`` and ``disable_additional_properties`` are taken and change nothing (one engine, no
fallback; JSON is always generated compact and objects that do not say ``additionalProperties`` closed:
``grammar.closed_objects``); ``whitespace_pattern`` and ``structural_tag`` are refused (a 400 naming the key), as is
any key vLLM does not define.

At most one of them a request. ``strict`` is taken either way: the output always follows the schema (what the
engine cannot compile is refused with a 400 naming the construct, never loosened).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from model_factory.serving.openai_errors import OpenAIError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# structured_outputs' keys: the formats (one a request), the options taken and not used, those refused.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
STRUCTURED_REFUSED = ("whitespace_pattern", "structural_tag")


def _response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise OpenAIError(400, "response_format must be an object with a type: text, json_object or json_schema",
                          "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise OpenAIError(400, f"response_format.type={kind!r}: use text, json_object or json_schema", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise OpenAIError(400, "response_format.json_schema must be an object with name and schema", "response_format")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise OpenAIError(400, "response_format.json_schema.name must be a string", "response_format")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise OpenAIError(400, "response_format.json_schema.strict must be true or false", "response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, Mapping):
        raise OpenAIError(400, "response_format.json_schema.schema must be a JSON Schema object", "response_format")
    return {"json": dict(schema)}


def _one_format(field: str, kind: str, value: Any, param: str = "") -> dict[str, Any]:
    """The backend's ``guided`` object for one format ``kind`` given as ``value`` (``field`` names it in a 400's
    message, ``param`` in its ``param``: ``field`` by default)."""
    param = param or field
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise OpenAIError(400, f"{field} is not JSON: {exc}", param) from None
        if not isinstance(value, Mapping):
            raise OpenAIError(400, f"{field} must be a JSON Schema object", param)
        value = dict(value)
    elif kind == "json_object":
        if value is not True:
            raise OpenAIError(400, f"{field} must be true", param)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise OpenAIError(400, f"{field} must be a non-empty list of non-empty strings", param)
    elif not isinstance(value, str) or not value.strip():
        raise OpenAIError(400, f"{field} must be a non-empty string", param)
    return {kind: value}


def _structured_outputs(value: Any) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` (``StructuredOutputsParams``) as the backend's ``guided`` object."""
    field = "structured_outputs"
    if not isinstance(value, Mapping):
        raise OpenAIError(400, f"{field} must be an object with one of {', '.join(STRUCTURED_KINDS)}", field)
    for key in value:
        if key in STRUCTURED_REFUSED and value[key] is not None:
            raise OpenAIError(400, f"{field}.{key} is not supported here: JSON is generated compact and "
                              f"structural tags are not parsed. Fix: leave {key} out", field)
        if key not in STRUCTURED_KINDS + STRUCTURED_OPTIONS + STRUCTURED_REFUSED:
            raise OpenAIError(400, f"{field} has an unknown key {key!r}: use one of {', '.join(STRUCTURED_KINDS)} "
                              f"(options: {', '.join(STRUCTURED_OPTIONS)})", field)
    for key in STRUCTURED_OPTIONS:
        if value.get(key) is not None and not isinstance(value[key], bool):
            raise OpenAIError(400, f"{field}.{key} must be true or false", field)
    # json_object false is vLLM's "not asked", as None is.
    asked = [k for k in STRUCTURED_KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(asked) != 1:
        raise OpenAIError(400, f"{field} must name exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                          f"{' and '.join(asked) or 'none'}", field)
    return _one_format(f"{field}.{asked[0]}", asked[0], value[asked[0]], field)


def guided_request(req: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The backend's ``guided`` object this request asks for and the field that asked (for a 400 to name), or
    ``(None, None)``."""
    asked: list[tuple[str, dict[str, Any]]] = []
    if req.get("response_format") is not None:
        guided = _response_format(req["response_format"])
        if guided is not None:
            asked.append(("response_format", guided))
    if req.get("structured_outputs") is not None:
        asked.append(("structured_outputs", _structured_outputs(req["structured_outputs"])))
    for field, kind in GUIDED_FIELDS.items():
        if req.get(field) is not None:
            asked.append((field, _one_format(field, kind, req[field])))
    if len(asked) > 1:
        raise OpenAIError(400, f"{' and '.join(f for f, _ in asked)} each ask for a format: give one", asked[1][0])
    return (asked[0][1], asked[0][0]) if asked else (None, None)
