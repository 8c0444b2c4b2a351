"""A prompt template's acceptance on the serving machine (``accept``, ``serve --accept``, a rollout's candidate):
what the OpenAI front will do with it (``openai_prompts``) checked on the verified bytes before it serves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


def accept_prompt(model_dir: Path, version: str, digests: Mapping[str, str] | None) -> dict[str, Any]:
    """A prompt version's acceptance on this machine (``accept``, a rollout's candidate): its ``prompt.json`` as
    verified, its template filled with every field it reads, its schema compiled by the grammar engine where it is
    installed. ``{"passed": ..., "reason": ...}`` for :class:`~.acceptance.AcceptanceResult`."""
    from model_factory.backend.contract import Files
    from model_factory.backend.integrity import read_checked
    from model_factory.recipe.prompt import MissingField, render_template, schema_problem

    try:
        definition = json.loads(read_checked(Path(model_dir), f"{version}/{Files.PROMPT}",
                                             dict(digests) if digests is not None else None))
        render_template(definition["template"], {f: "x" for f in definition.get("fields") or ()})
        problem = schema_problem(definition.get("schema"))
        if problem is not None:
            return {"passed": False, "reason": f"the output schema does not compile: {problem}"}
    except MissingField as exc:
        return {"passed": False, "reason": f"the template reads {exc.name!r}, which its fields do not list"}
    except Exception as exc:  # noqa: BLE001 - a definition the front could not serve: that is the verdict
        return {"passed": False, "reason": f"{type(exc).__name__}: {exc}"}
    return {"passed": True, "engine": "prompt", "file": Files.PROMPT}
