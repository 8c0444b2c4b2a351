"""Prompt templates on the OpenAI API: a request naming a prompt becomes a request to its base model.

A prompt (``task = "prompt"``, packaged by ``build/prompt.py``) is a Triton model of its own that answers with its
signed definition (``backend/prompt_model.py``). For each ``/v1/chat/completions`` or ``/v1/completions`` request
whose ``model`` is a prompt, the front asks Triton for the definition of the version it serves now (one small
``infer`` call on loopback: during a rollout every request sent after the switch gets the new version's), fills
the template with the request's fields in Jinja2's sandbox, and hands the base model the request it stands for:

- **the fields**: ``fields`` (an object, ``extra_body={"fields": {...}}`` with the ``openai`` client), or, for a
  template of one field, the last user message's text (chat) or the ``prompt`` string (completions). A field the
  template reads that the request does not fill is a 400 naming it; a field the template does not read is a 400
  too (a misspelt name would otherwise be dropped unseen).
- **the messages**: the prompt's system text, the request's earlier turns (user and assistant; a system message of
  the request's own is a 400: the prompt owns it), then the filled template as the user's turn, through the base
  model's chat template. Completions: the system text, a blank line, the filled template.
- **the schema**: the output's JSON Schema as ``response_format`` ``json_schema`` (strict), enforced by the
  structured-output path like any request's; a request that asks for another format (``response_format``,
  ``guided_*``, ``tools``) is a 400.
- **the defaults**: the prompt's generation defaults, under the request's own values.

An unknown prompt is a 404 like an unknown model; answers carry the prompt's name as their ``model``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from model_factory.serving.openai_errors import OpenAIError

_OTHER_FORMATS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "tools")


@dataclass(frozen=True)
class ServedPrompt:
    """A prompt template the frontend serves: its name and the base model its config names (``serve`` starts only
    a prompt whose pinned base files are the ones the base serves: :func:`pin_problem`)."""

    name: str
    base: str
    pinned: str = ""  # what differs between its pins and the base served ("": nothing; serve refuses otherwise)


def pin_problem(repository: Path, name: str, version: int | str | None = None,
                served: Mapping[str, int] | None = None) -> str:
    """Why prompt ``name`` of ``repository`` cannot run on the base served there ("": it can, or it is no prompt):
    its served version's ``prompt.json`` pins the base by name, version and the sha256 of the base version's
    ``generation.json`` (its chat template) and tokenizer, and the base's served version must hold those files with
    those digests (any version number: a base rebuilt with its template and tokenizer unchanged still fits).
    ``version``: the prompt's version to check (a rollout's new one), by default the one ``config.pbtxt`` serves;
    ``served``: model -> the version a running ``serve`` serves (a base missing there is refused), by default the
    base's ``config.pbtxt``'s."""
    import hashlib

    from model_factory.backend.contract import PROMPT, Files
    from model_factory.build.repository import config_parameters, read_config
    from model_factory.serving.acceptance import served_version

    model_dir = Path(repository) / name
    try:
        config = read_config(model_dir)
        if config_parameters(config).get("task") != PROMPT:
            return ""
        version = str(version) if version is not None else served_version(model_dir, config)
        definition = json.loads((model_dir / version / Files.PROMPT).read_text())
        base = definition["base"]
        base_dir = Path(repository) / base["model"]
        if not base_dir.is_dir():
            return (f"prompt {name} v{version} runs on {base['model']}, which this repository does not hold. Fix: "
                    f"serve {base['model']} v{base['version']} beside it")
        if served is not None and base["model"] not in served:
            return (f"prompt {name} v{version} runs on {base['model']}, which this serve does not serve. Fix: serve "
                    f"{base['model']} v{base['version']} beside it")
        served = (str(served[base["model"]]) if served is not None
                  else served_version(base_dir, read_config(base_dir)))
        differ = [rel for rel, digest in sorted(base["digests"].items())
                  if not (base_dir / served / rel).is_file()
                  or hashlib.sha256((base_dir / served / rel).read_bytes()).hexdigest() != digest]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"prompt {name}: its base cannot be read ({type(exc).__name__}: {exc})"
    if not differ:
        return ""
    return (f"prompt {name} v{version} was written for {base['model']} v{base['version']}, and the {base['model']} "
            f"served here (v{served}) has another {' and '.join(differ)} (sha256 differs from the prompt's pins). "
            f"Fix: build the prompt on {base['model']} v{served} (its recipe's base.version) as a new version, or "
            f"serve {base['model']} v{base['version']}")


def prompt_models(repository: Path, names: list[str] | tuple[str, ...]) -> dict[str, ServedPrompt]:
    """The prompt templates among ``names`` in ``repository`` (``task`` parameter ``prompt``)."""
    from model_factory.backend.contract import PROMPT, PROMPT_BASE_PARAMETER
    from model_factory.build.repository import config_parameters, read_config

    out = {}
    for name in names:
        config = read_config(Path(repository) / name)
        params = config_parameters(config)
        if params.get("task") == PROMPT:
            out[name] = ServedPrompt(name, params.get(PROMPT_BASE_PARAMETER, ""), pin_problem(Path(repository), name))
    return out


def definition_request(request_id: str) -> dict[str, Any]:
    """The KServe ``infer`` body that asks a prompt model for its definition."""
    from model_factory.backend.contract import PROMPT_INPUT

    return {"inputs": [{"name": PROMPT_INPUT, "shape": [1], "datatype": "BYTES", "data": [request_id]}]}


def read_definition(status: int, text: str, name: str) -> dict[str, Any]:
    """The definition out of Triton's answer; a prompt model that cannot answer is a 503."""
    try:
        data = json.loads(text)
        definition = json.loads(data["outputs"][0]["data"][0])
    except (ValueError, KeyError, IndexError, TypeError):
        raise OpenAIError(503, f"prompt {name!r} is not available ({status}: {text[:200]})",
                          retry_after_s=1.0) from None
    if status != 200 or not isinstance(definition, dict):
        raise OpenAIError(503, f"prompt {name!r} is not available ({status})", retry_after_s=1.0)
    return definition


def _fields(req: Mapping[str, Any], wanted: list[str], chat: bool) -> tuple[dict[str, Any], bool]:
    """The template's values, and whether they came from the last user message (chat, a template of one field)."""
    given = req.get("fields")
    if given is not None:
        if not isinstance(given, Mapping):
            raise OpenAIError(400, "fields must be an object of the template's fields", "fields")
        return dict(given), False
    if len(wanted) == 1:
        if chat:
            users = [m for m in req.get("messages") or () if isinstance(m, Mapping) and m.get("role") == "user"]
            if users:
                return {wanted[0]: _text(users[-1].get("content"))}, True
        elif isinstance(req.get("prompt"), str):
            return {wanted[0]: req["prompt"]}, False
    if not wanted:
        return {}, False
    if len(wanted) == 1:
        raise OpenAIError(400, f"this prompt's template reads field {wanted[0]!r}: send it as fields (extra_body="
                          f"{{'fields': {{...}}}}) or as {'a user message' if chat else 'prompt'}", "fields")
    raise OpenAIError(400, f"this prompt's template reads fields {', '.join(map(repr, wanted))}: send them as fields "
                      "(extra_body={'fields': {...}})", "fields")


def _text(content: Any) -> str:
    if isinstance(content, list):  # [{"type": "text", "text": ...}]
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    if not isinstance(content, str):
        raise OpenAIError(400, "the user message's content must be text", "messages")
    return content


def base_request(req: Mapping[str, Any], definition: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The request the base model gets for ``req`` on the prompt ``definition`` (OpenAIError: 400 naming the field)."""
    from model_factory.recipe.prompt import MissingField, render_template

    name = definition.get("name", req.get("model"))
    wanted = list(definition.get("fields") or ())
    values, from_message = _fields(req, wanted, chat)
    unknown = sorted(set(values) - set(wanted))
    if unknown:
        raise OpenAIError(400, f"field {unknown[0]!r} is not read by prompt {name!r}: its template reads "
                          f"{', '.join(map(repr, wanted)) or 'no field'}", "fields")
    try:
        user = render_template(definition["template"], values)
    except MissingField as exc:
        raise OpenAIError(400, f"prompt {name!r} reads field {exc.name!r}, which the request does not fill: send "
                          f"it in fields", "fields") from None
    except ValueError as exc:
        raise OpenAIError(400, f"prompt {name!r}'s template failed on these fields: {exc}", "fields") from None
    out = {k: v for k, v in req.items() if k not in ("fields", "messages", "prompt")}
    system = definition.get("system") or ""
    if chat:
        earlier = list(req.get("messages") or ())
        if from_message:  # the last user message filled the template: it is replaced by the filled template
            last = max(i for i, m in enumerate(earlier) if isinstance(m, Mapping) and m.get("role") == "user")
            earlier = earlier[:last] + earlier[last + 1:]
        if any(isinstance(m, Mapping) and m.get("role") in ("system", "developer") for m in earlier):
            raise OpenAIError(400, f"prompt {name!r} sets the system text: leave system messages out", "messages")
        out["messages"] = ([{"role": "system", "content": system}] if system else []) + earlier + [
            {"role": "user", "content": user}]
    else:
        out["prompt"] = f"{system}\n\n{user}" if system else user
    schema = definition.get("schema")
    if schema is not None:
        asked = next((k for k in _OTHER_FORMATS if req.get(k) is not None), None)
        if asked is not None:
            raise OpenAIError(400, f"prompt {name!r} fixes its output's JSON Schema: leave {asked} out", asked)
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": str(name), "schema": schema, "strict": True}}
    for key, value in (definition.get("defaults") or {}).items():
        if out.get(key) is None and not (key == "max_tokens" and out.get("max_completion_tokens") is not None):
            out[key] = value
    out["model"] = definition["base"]["model"]
    return out
