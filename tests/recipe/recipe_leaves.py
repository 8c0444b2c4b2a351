"""Shared by the recipe schema tests: a recipe that parses, and every key of the published JSON Schema."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_factory.recipe import recipe_json_schema

SCHEMA = recipe_json_schema()
DEFS = SCHEMA["$defs"]


def base_recipe() -> dict[str, Any]:
    """A small recipe that parses in a folder holding ``tiny.onnx``, ``calib.txt`` and ``heldout.txt``."""
    return {"precisions": ["fp32"], "model": {"name": "m"}, "source": {"kind": "onnx", "path": "tiny.onnx"},
            "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
            "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}]}


def recipe_folder(root: Path) -> Path:
    """The files :func:`base_recipe` names (parsing checks only that they exist)."""
    (root / "tiny.onnx").write_bytes(b"placeholder")
    (root / "calib.txt").write_text("a\nb\n")
    (root / "heldout.txt").write_text("c\n")
    return root


@dataclass(frozen=True)
class Leaf:
    """One key a recipe may set: where it sits in the TOML mapping, the field name errors use, its schema."""

    path: tuple[Any, ...]
    label: str
    schema: dict[str, Any]

    def validator_schema(self) -> dict[str, Any]:
        return {**self.schema, "$defs": DEFS}


def resolve(node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return DEFS[ref.rpartition("/")[2]] if ref else node


def tables() -> dict[str, dict[str, Any]]:
    """Each ``[table]`` (and ``[[array of tables]]``) of a recipe, by key: its resolved schema."""
    out = {}
    for key, node in SCHEMA["properties"].items():
        target = node.get("items", node)
        if "$ref" in target:
            out[key] = resolve(target)
    return out


def leaves() -> list[Leaf]:
    """Every key of the schema: top-level values, each table's keys, the keys of the first [[inputs]]."""
    found = []
    for key, node in SCHEMA["properties"].items():
        target = node.get("items", node)
        if "$ref" not in target:
            found.append(Leaf((key,), key, node))
            continue
        table = resolve(target)
        prefix, label = ((key, 0), f"{key}[0]") if "items" in node else ((key,), key)
        for sub, sub_node in table["properties"].items():
            found.append(Leaf((*prefix, sub), f"{label}.{sub}", sub_node))
    return found


def with_value(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """A deep copy of ``data`` with the value at ``path`` set (tables on the way created)."""
    out = copy.deepcopy(data)
    node: Any = out
    for part in path[:-1]:
        if isinstance(part, int):
            node = node[part]
        else:
            node = node.setdefault(part, {})
    node[path[-1]] = value
    return out
