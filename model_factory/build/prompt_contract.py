"""The ``prompt`` section of a prompt template's ``contract.json``, and what changed between two versions.

:func:`prompt_contract` reads it from the version's ``prompt.json`` (``build/prompt.py`` packages it);
:func:`diff_prompts` names what changed (system text, template, its fields, each output-schema field added, removed
or retyped, defaults, the base) and which changes break a client. ``data_contract.diff_contracts`` (``model-factory
contract diff``) adds them to an encoder's or generator's changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from model_factory.backend.contract import Files

def _type_of(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return "any"
    if "enum" in schema:
        return "enum " + json.dumps(schema["enum"], sort_keys=True)
    if "const" in schema:
        return "const " + json.dumps(schema["const"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return f"{key} " + " | ".join(_type_of(s) for s in schema[key])
    kind = schema.get("type", "$ref " + str(schema["$ref"]) if "$ref" in schema else "any")
    return "/".join(kind) if isinstance(kind, list) else str(kind)


def schema_fields(schema: Any, prefix: str = "") -> dict[str, dict[str, Any]]:
    """Each field of an output schema by its path (``a.b``, ``items[].c``): its type and whether required."""
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(schema, Mapping):
        return out
    required = set(schema.get("required") or ())
    for name, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}{name}"
        out[path] = {"type": _type_of(sub), "required": name in required}
        out.update(schema_fields(sub, path + "."))
    items = schema.get("items")
    if isinstance(items, Mapping):
        out.update(schema_fields(items, prefix.rstrip(".") + "[]." if prefix else "[]."))
    return out


def prompt_contract(version_dir: Path) -> dict[str, Any] | None:
    """The ``prompt`` section of a prompt version's contract (None for any other model)."""
    path = Path(version_dir) / Files.PROMPT
    if not path.is_file():
        return None
    d = json.loads(path.read_text(encoding="utf-8"))
    return {"base": {"model": d["base"]["model"], "version": d["base"]["version"]},
            "system": d.get("system", ""), "template": d["template"], "fields": list(d.get("fields") or ()),
            "schema": d.get("schema") is not None, "schema_fields": schema_fields(d.get("schema")),
            "defaults": dict(d.get("defaults") or {})}


def diff_prompts(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> list[tuple[str, bool]]:
    """What changed between two prompts' contracts, as ``(what, breaking)``: a field the request must now fill,
    a field it may no longer send, an output field removed or retyped, or the schema gone break a client; the rest
    (system text, template wording, a field added to the output, defaults, the base) is said, not breaking."""
    if old is None and new is None:
        return []
    if old is None or new is None:
        return [("the model is now a prompt template" if old is None else "the model is no longer a prompt template",
                 True)]
    out: list[tuple[str, bool]] = []
    if old["base"] != new["base"]:
        out.append((f"base model {old['base']['model']} v{old['base']['version']} -> {new['base']['model']} "
                    f"v{new['base']['version']}", False))
    if old["system"] != new["system"]:
        out.append((f"system text changed ({len(old['system'])} -> {len(new['system'])} characters)", False))
    fo, fn = set(old["fields"]), set(new["fields"])
    for name in sorted(fn - fo):
        out.append((f"template field {name!r} is new: requests must fill it", True))
    for name in sorted(fo - fn):
        out.append((f"template field {name!r} is gone: requests that send it are refused", True))
    if old["template"] != new["template"] and fo == fn:
        out.append(("template text changed (same fields)", False))
    if old["schema"] and not new["schema"]:
        out.append(("output schema removed: answers are free text", True))
    elif new["schema"] and not old["schema"]:
        out.append(("output schema added: answers follow it", False))
    so, sn = old["schema_fields"], new["schema_fields"]
    for path in sorted(sn.keys() - so.keys()):
        out.append((f"output field {path!r} added ({sn[path]['type']}"
                    f"{', required' if sn[path]['required'] else ''})", False))
    for path in sorted(so.keys() - sn.keys()):
        out.append((f"output field {path!r} removed (was {so[path]['type']})", True))
    for path in sorted(so.keys() & sn.keys()):
        if so[path]["type"] != sn[path]["type"]:
            out.append((f"output field {path!r} retyped {so[path]['type']} -> {sn[path]['type']}", True))
        if so[path]["required"] and not sn[path]["required"]:
            out.append((f"output field {path!r} is no longer required", True))
        elif sn[path]["required"] and not so[path]["required"]:
            out.append((f"output field {path!r} is now required", False))
    do, dn = old["defaults"], new["defaults"]
    for key in sorted(do.keys() | dn.keys()):
        if do.get(key) != dn.get(key):
            out.append((f"default {key} {json.dumps(do.get(key))} -> {json.dumps(dn.get(key))}", False))
    return out
