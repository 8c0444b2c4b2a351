"""The recipe's published forms, all made from the schema: JSON Schema text and the key reference in docs.

``model-factory schema`` prints :func:`schema_text`; ``docs/recipe.schema.json`` holds the same text and
``docs/recipes.md`` the :func:`reference_markdown` between generated markers (tests keep both equal).
Regenerate both with ``python -m model_factory.recipe.reference``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from model_factory.errors import FactoryError
from model_factory.fileio import atomic_file
from model_factory.recipe.schema import INT32_MAX, recipe_json_schema

BEGIN = "<!-- BEGIN recipe keys: generated from the schema by `python -m model_factory.recipe.reference` -->"
END = "<!-- END recipe keys -->"


def schema_text(prompt: bool = False) -> str:
    """The recipe's JSON Schema as the text ``model-factory schema`` prints (stable key order, one newline);
    ``prompt``: a prompt template's recipe's (``recipe/prompt.py``)."""
    if prompt:
        from model_factory.recipe.prompt import prompt_recipe_json_schema

        return json.dumps(prompt_recipe_json_schema(), indent=2, ensure_ascii=False) + "\n"
    return json.dumps(recipe_json_schema(), indent=2, ensure_ascii=False) + "\n"


def write_schema(path: Path, prompt: bool = False) -> Path:
    """Write the JSON Schema to ``path`` atomically (a temporary sibling renamed into place)."""
    path = Path(path)
    if path.is_dir():
        raise FactoryError(f"{path} is a folder. Fix: give a file name, e.g. {path / 'recipe.schema.json'}")
    with atomic_file(path) as f:
        f.write(schema_text(prompt))
    return path


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return defs[ref.rpartition("/")[2]] if ref else node


def _type_of(node: dict[str, Any], defs: dict[str, Any]) -> str:
    node = _resolve(node, defs)
    if "anyOf" in node:
        return " or ".join(_type_of(n, defs) for n in node["anyOf"])
    if "const" in node:
        return json.dumps(node["const"])
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"] if not (isinstance(v, str) and v != v.upper()
                                                                  and v.upper() in node["enum"]))
    kind = node.get("type", "")
    if kind == "array":
        return f"array of {_type_of(node.get('items', {}), defs)}"
    if kind == "object":
        return "table"
    words = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean"}.get(kind, kind)
    bounds = []
    for key, sign in (("exclusiveMinimum", ">"), ("minimum", "≥"), ("exclusiveMaximum", "<"), ("maximum", "≤")):
        if key in node and not (key == "maximum" and node[key] == INT32_MAX):  # the int32 cap goes unsaid
            bounds.append(f"{sign} {node[key]}")
    if "pattern" in node:
        bounds.append(f"matching `{node['pattern']}`")
    return f"{words} {', '.join(bounds)}".strip()


def _default(node: dict[str, Any]) -> str:
    if "default" not in node:
        return "derived" if "Default:" in node.get("description", "") else "unset"
    value = node["default"]
    return f"`{json.dumps(value)}`" if not isinstance(value, dict) else "—"


def _rows(props: dict[str, Any], required: list[str], defs: dict[str, Any]) -> list[str]:
    rows = ["| key | type | default | what it means |", "| --- | --- | --- | --- |"]
    for key, node in props.items():
        default = "required" if key in required else _default(node)
        cells = (f"`{key}`", _type_of(node, defs), default, node.get("description", ""))
        # A "|" inside a cell (a regex, a choice list) would end the cell: escape the unescaped ones.
        rows.append("| " + " | ".join(re.sub(r"(?<!\\)\|", r"\\|", c) for c in cells) + " |")
    return rows


def reference_markdown() -> str:
    """Every section and key of a recipe (type, default, meaning), as Markdown made from the JSON Schema."""
    schema = recipe_json_schema()
    defs = schema["$defs"]
    top = {k: v for k, v in schema["properties"].items() if "$ref" not in v and "$ref" not in v.get("items", {})}
    out = ["### Top-level keys", "", "Top-level keys come before the first `[table]`.", "",
           *_rows(top, schema.get("required", []), defs), ""]
    for key, node in schema["properties"].items():
        if key in top:
            continue
        table = _resolve(node.get("items", node), defs)
        header = f"[[{key}]]" if "items" in node else f"[{key}]"
        extra = " (required)" if key in schema.get("required", []) else ""
        out += [f"### `{header}`{extra}", "", node.get("description", ""), "",
                *_rows(table["properties"], table.get("required", []), defs), ""]
    return "\n".join(out).rstrip() + "\n"


def splice_reference(doc: str) -> str:
    """``doc`` (docs/recipes.md) with the generated reference between its markers replaced by the current one."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        raise FactoryError(f"the markers {BEGIN!r} ... {END!r} are missing. Fix: put them back in docs/recipes.md")
    return pattern.sub(lambda _: f"{BEGIN}\n{reference_markdown()}{END}", doc)


def main(argv: list[str] | None = None) -> int:
    """Regenerate docs/recipe.schema.json and the reference in docs/recipes.md (run from the repository root)."""
    docs = Path(argv[0] if argv else sys.argv[1] if len(sys.argv) > 1 else "docs")
    write_schema(docs / "recipe.schema.json")
    md = docs / "recipes.md"
    text = splice_reference(md.read_text())
    with atomic_file(md) as f:
        f.write(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
