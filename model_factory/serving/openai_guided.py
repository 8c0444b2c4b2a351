"""Structured outputs on the OpenAI API: ``response_format`` and vLLM's ``guided_*`` extensions, checked (a 400
naming the field) and turned into the backend's ``guided`` object (``sampling_parameters``, read by
``backend/generation/structured/grammar.py``, which compiles it against the model's tokenizer).

| asked | the backend's ``guided`` |
| --- | --- |
| ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` | ``{"json": schema}`` |
| ``response_format: {"type": "json_object"}`` | ``{"json_object": true}`` |
| ``response_format: {"type": "text"}`` | none |
| ``guided_json`` (a schema, or its JSON text), ``guided_regex``, ``guided_choice``, ``guided_grammar`` | ``json``, ``regex``, ``choice``, ``grammar`` |

At most one of them a request. ``strict`` is taken either way: the output always follows the schema (what the
engine cannot compile is refused with a 400 naming the construct, never loosened).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from model_factory.serving.openai_errors import OpenAIError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


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


def guided_request(req: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The backend's ``guided`` object this request asks for and the field that asked (for a 400 to name), or
    ``(None, None)``."""
    asked: list[tuple[str, dict[str, Any]]] = []
    if req.get("response_format") is not None:
        guided = _response_format(req["response_format"])
        if guided is not None:
            asked.append(("response_format", guided))
    for field, kind in GUIDED_FIELDS.items():
        value = req.get(field)
        if value is None:
            continue
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise OpenAIError(400, f"guided_json is not JSON: {exc}", field) from None
            if not isinstance(value, Mapping):
                raise OpenAIError(400, "guided_json must be a JSON Schema object", field)
            value = dict(value)
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise OpenAIError(400, "guided_choice must be a non-empty list of non-empty strings", field)
        elif not isinstance(value, str) or not value.strip():
            raise OpenAIError(400, f"{field} must be a non-empty string", field)
        asked.append((field, {kind: value}))
    if len(asked) > 1:
        raise OpenAIError(400, f"{' and '.join(f for f, _ in asked)} each ask for a format: give one", asked[1][0])
    return (asked[0][1], asked[0][0]) if asked else (None, None)
