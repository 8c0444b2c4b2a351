"""Tool calls on the OpenAI chat API: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked (a 400 naming
the field), the grammar a forced call is generated under, and the output parsed back into ``tool_calls``.

- ``tool_choice`` a named function: the arguments alone are generated under that function's ``parameters`` schema
  (any model: the grammar decides the shape), answered as one call of that function.
- ``"required"``: a JSON array of ``{"name": ..., "arguments": {...}}`` objects is generated, each one of the
  tools under its own schema (one item at most with ``parallel_tool_calls`` false), answered as those calls.
- ``"auto"`` (the default with tools): the tools are passed to the model's chat template (``tools``, as Hugging Face
  templates take them) and the model writes what it will; its family's tool-call format is parsed: Hermes / Qwen
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, or a bare JSON call (an object or a list of
  them). No call found: a normal message.
- ``"none"``: no tools, a normal message.

Calls are answered in OpenAI's shape (``tool_calls`` with an id each, ``arguments`` as JSON text,
``finish_reason: "tool_calls"``), streamed as deltas (a named call's arguments as they are generated; the others once
the output is complete, since a call is known only then).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from model_factory.serving.openai_errors import OpenAIError

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask: ``choice`` is ``auto``, ``required`` or ``named`` (``name`` then)."""

    tools: tuple[Mapping[str, Any], ...]  # OpenAI's tool objects, as the chat template takes them
    choice: str
    name: str | None = None
    parallel: bool = True

    def schemas(self) -> dict[str, Mapping[str, Any]]:
        return {t["function"]["name"]: t["function"].get("parameters") or EMPTY_PARAMETERS for t in self.tools}

    def guided(self) -> dict[str, Any] | None:
        """The backend's ``guided`` object: a named or required call's schema; None for ``auto``."""
        if self.choice == "named":
            return {"json": dict(self.schemas()[self.name])}
        if self.choice == "required":
            items = [{"type": "object", "properties": {"name": {"const": name}, "arguments": dict(schema)},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, schema in self.schemas().items()]
            array = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return {"json": array}
        return None

    def template_tools(self) -> list[Mapping[str, Any]] | None:
        """The tools passed to the chat template (``auto``: the model decides; forced calls need no prompt)."""
        return list(self.tools) if self.choice == "auto" else None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` from a choice's whole text: calls found, or the text as a normal message."""
        calls: list[ToolCall] = []
        content: str | None = text
        if self.choice == "named":
            return None, [ToolCall(self.name or "", text.strip(), call_id())]
        if self.choice == "required":
            calls = self._calls(_loads(text))
            content = None if calls else text
        else:
            blocks = _BLOCK.findall(text)
            if blocks:
                for block in blocks:
                    calls += self._calls(_loads(block))
                rest = _BLOCK.sub("", text).strip()
                content = rest or None
            elif text.strip()[:1] in ("{", "["):
                calls = self._calls(_loads(text.strip()))
                content = None if calls else text
            if not calls:
                content = text
        if not self.parallel:
            calls = calls[:1]
        return content, calls

    def _calls(self, value: Any) -> list[ToolCall]:
        known = self.schemas()
        items = value if isinstance(value, list) else [value]
        out = []
        for item in items:
            if not isinstance(item, Mapping) or item.get("name") not in known:
                continue
            args = item.get("arguments", item.get("parameters", {}))
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            out.append(ToolCall(item["name"], args, call_id()))
        return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def tool_plan(req: Mapping[str, Any]) -> ToolPlan | None:
    """The request's :class:`ToolPlan`, None when it calls no tool (no tools, or ``tool_choice`` ``"none"``)."""
    tools, choice = req.get("tools"), req.get("tool_choice")
    parallel = req.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise OpenAIError(400, f"parallel_tool_calls={parallel!r} must be true or false", "parallel_tool_calls")
    if tools is not None:
        if not isinstance(tools, list):
            raise OpenAIError(400, "tools must be a list of function tools", "tools")
        seen = set()
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
                raise OpenAIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
            name = fn.get("name")
            if not isinstance(name, str) or not _NAME.match(name):
                raise OpenAIError(400, f"tools[{i}].function.name={name!r} must be 1-64 letters, digits, _ . or -",
                                  "tools")
            if name in seen:
                raise OpenAIError(400, f"tools[{i}].function.name={name!r} is given twice", "tools")
            seen.add(name)
            params = fn.get("parameters")
            if params is not None and not isinstance(params, Mapping):
                raise OpenAIError(400, f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    name = None
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise OpenAIError(400, "tool_choice must be none, auto, required or {'type': 'function', 'function': "
                              "{'name': ...}}", "tool_choice")
        if name not in {t["function"]["name"] for t in tools or ()}:
            raise OpenAIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise OpenAIError(400, f"tool_choice={choice!r}: use none, auto, required or a named function", "tool_choice")
    if choice == "none" or (choice == "auto" and not tools):
        return None
    if not tools:
        raise OpenAIError(400, f"tool_choice={choice!r} needs tools", "tool_choice")
    clean = tuple({"type": "function", "function": dict(t["function"])} for t in tools)
    return ToolPlan(clean, choice, name, parallel is not False)


def tool_message(plan: ToolPlan, text: str, finish: str) -> tuple[dict[str, Any], str]:
    """A chat choice's ``message`` and ``finish_reason`` from its whole text: ``tool_calls`` when calls were made."""
    content, calls = plan.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    message = {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}
    return message, "tool_calls" if finish == "stop" else finish


class ToolStream:
    """A streamed chat's deltas for its tool calls: a named call's arguments as they come (its id and name in the
    first delta), the others from the whole text once the choice ends. :meth:`feed` takes one choice's text piece
    and finish reason and returns the ``(delta, finish_reason)`` chunks to send."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._texts: dict[int, list[str]] = {}
        self._started: set[int] = set()

    def feed(self, index: int, text: str, finish: str | None) -> list[tuple[dict[str, Any], str | None]]:
        if self.plan.choice == "named":
            out: list[tuple[dict[str, Any], str | None]] = []
            if index not in self._started:
                self._started.add(index)
                call = ToolCall(self.plan.name or "", text, call_id())
                out.append(({"tool_calls": [call.as_openai(0)]}, None))
            elif text:
                out.append(({"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, None))
            if finish:
                out.append(({}, "tool_calls" if finish == "stop" else finish))
            return out
        self._texts.setdefault(index, []).append(text)
        if not finish:
            return []
        whole = "".join(self._texts.pop(index))
        content, calls = self.plan.parse(whole)
        if not calls:
            return [({"content": whole} if whole else {}, finish)]
        out = [({"content": content}, None)] if content else []
        out.append(({"tool_calls": [c.as_openai(k) for k, c in enumerate(calls)]}, None))
        out.append(({}, "tool_calls" if finish == "stop" else finish))
        return out
