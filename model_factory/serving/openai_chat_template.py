"""A chat template given at serve time (``serve --chat-template [MODEL=]FILE``, vLLM's ``--chat-template``): a Jinja2
template the OpenAI front renders ``/v1/chat/completions`` with instead of the model's own (``generation.json``'s,
from the tokenizer), for a base model that has none or to override one.

- **loading**: the file is read as UTF-8 and compiled in the same sandbox the model's own template runs in
  (``openai_protocol.render_chat``: Jinja2's ``ImmutableSandboxedEnvironment``); a file that does not parse is refused
  at start with the file and line (:func:`load_chat_template`). Its sha256 is logged at start beside the digest of the
  model's own template (``serve`` prints both).
- **which models**: ``MODEL=FILE`` overrides that model (and the LoRA adapters it serves); a bare ``FILE`` overrides
  every text-generation model served. A ``MODEL`` this serve does not serve as text generation is refused at start.
- **prompt templates**: a prompt pins its base's ``generation.json`` by sha256, the chat template with it
  (``openai_prompts.pin_problem``: every built prompt pins it), and its chat requests are rendered with its base's
  chat template. A prompt on a base whose template this serve overrides would run through a template it was not
  written for: it is refused by name (not served on the OpenAI front, the reason printed at start), as a prompt whose
  base files differ is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from model_factory.errors import FactoryError


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template from a file: its ``path``, ``text`` and the text's ``sha256`` (of the file's bytes)."""

    path: Path
    text: str
    sha256: str


def load_chat_template(path: str | Path) -> ChatTemplate:
    """The chat template in ``path``, compiled once in the chat sandbox (refused with the file and line if it does
    not parse)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(path)
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except OSError as exc:
        raise FactoryError(f"--chat-template {path} cannot be read ({exc.strerror or exc}). Fix: give the path of "
                           "a Jinja2 chat template file") from None
    except UnicodeDecodeError as exc:
        raise FactoryError(f"--chat-template {path} is not UTF-8 text (byte {exc.start}). Fix: give a Jinja2 chat "
                           "template file") from None
    if not text.strip():
        raise FactoryError(f"--chat-template {path} is empty. Fix: give a Jinja2 chat template file")
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(text)
    except TemplateSyntaxError as exc:
        raise FactoryError(f"--chat-template {path}, line {exc.lineno}: {exc.message}. Fix: correct the template "
                           "(Jinja2, as Hugging Face chat templates are written)") from None
    return ChatTemplate(path, text, hashlib.sha256(data).hexdigest())


def parse_chat_template_options(values: tuple[str, ...] | list[str]) -> dict[str, ChatTemplate]:
    """``--chat-template`` values, ``[MODEL=]FILE`` each, as model -> template (``""``: every text-generation model).
    A value naming an existing file is a bare ``FILE`` even with ``=`` in its path."""
    out: dict[str, ChatTemplate] = {}
    for value in values:
        model, path = ("", value) if Path(value).is_file() or "=" not in value else value.split("=", 1)
        if model in out:
            raise FactoryError(f"--chat-template is given twice for {model or 'every model'}. Fix: give one")
        out[model] = load_chat_template(path)
    return out


def template_digest(text: str | None) -> str:
    """The sha256 of a chat template's text (UTF-8), or ``"none"``."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest() if text else "none"


def apply_chat_templates(models: Mapping[str, Any], prompts: Mapping[str, Any],
                         templates: Mapping[str, ChatTemplate]) -> tuple[dict[str, Any], dict[str, Any],
                                                                         dict[str, str], dict[str, str]]:
    """``models`` (``openai_api.ServedModel``) with their chat templates overridden by ``templates``, ``prompts``
    (``openai_prompts.ServedPrompt``) less those on an overridden base, the refused prompts (name -> why) and one
    line a model overridden (name -> what to log)."""
    from model_factory.backend.contract import Files

    unknown = sorted(m for m in templates if m and m not in models)
    if unknown:
        raise FactoryError(f"--chat-template names {', '.join(unknown)}, which this serve does not serve as text "
                           f"generation (served: {', '.join(sorted(models)) or 'none'}). Fix: name a served model, "
                           "or give FILE alone for every text-generation model")
    out, logged, chosen_path = dict(models), {}, {}
    for name, model in models.items():
        chosen = templates.get(name) or templates.get(model.base or "") or templates.get("")
        if chosen is None:
            continue
        out[name] = replace(model, chat_template=chosen.text)
        chosen_path[name] = chosen.path
        logged[name] = (f"chat template {chosen.path} (sha256 {chosen.sha256}) instead of the model's own "
                        f"(sha256 {template_digest(model.chat_template)})")
    kept, refused = {}, {}
    for name, prompt in prompts.items():
        if prompt.base not in logged:
            kept[name] = prompt
            continue
        refused[name] = (f"prompt {name} pins {prompt.base}'s chat template (the sha256 of its {Files.GENERATION}), "
                         f"and this serve renders {prompt.base}'s chats with --chat-template {chosen_path[prompt.base]}. "
                         f"Fix: serve without --chat-template for {prompt.base}, or put the template in {prompt.base}'s "
                         "tokenizer, rebuild it and build the prompt on that version")
    return out, kept, refused, logged
