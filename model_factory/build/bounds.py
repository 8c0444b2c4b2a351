"""The allowed values of a model's index-like inputs, found at packaging (the backend's ``input_bounds``).

Three sources, intersected for each declared integer input:

* the recipe: ``[[inputs]] range = [low, high]`` (a generic model's own knowledge);
* a Hugging Face config: ``input_ids`` below ``vocab_size``, ``token_type_ids`` below ``type_vocab_size``,
  ``position_ids`` below ``max_position_embeddings``, an ``attention_mask`` of 0 or 1;
* the ONNX graph: an integer input that reaches the indices of a ``Gather`` (through casts and reshapes)
  whose table is a weight, indexes that table: ``0 .. rows - 1``. ONNX's Gather accepts negative indices
  (counting from the end): a request's negative id would silently read another row, so none is allowed.

The result travels to the backend as the ``input_bounds`` model parameter (``backend/input_bounds.py``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from model_factory.errors import FactoryError
from model_factory.recipe import Recipe, read_hf_config

INTEGER_DTYPES = ("INT64", "INT32", "INT16", "INT8", "UINT8")
# Ops an index passes through unchanged on its way to a Gather (shape or type changes only).
_PASS_THROUGH = ("Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Expand")
# Ops between a Gather's table and its weight (FP16 casts, INT8 dequantization).
_TABLE_THROUGH = ("Cast", "Identity", "DequantizeLinear")


def graph_gather_bounds(model: Any) -> dict[str, tuple[int, int]]:
    """``input -> (0, rows - 1)`` for every integer graph input that indexes a weight table (a ``Gather``)."""
    graph = model.graph
    inits = {i.name: list(i.dims) for i in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[tuple[Any, int]]] = defaultdict(list)
    for node in graph.node:
        for idx, name in enumerate(node.input):
            consumers[name].append((node, idx))

    def rows(data: str, axis: int) -> int | None:
        for _ in range(8):
            if data in inits:
                dims = inits[data]
                return int(dims[axis % len(dims)]) if dims else None
            node = producers.get(data)
            if node is None or node.op_type not in _TABLE_THROUGH:
                return None
            data = node.input[0]
        return None

    out = {}
    for value in graph.input:
        if value.name in inits or value.type.tensor_type.elem_type not in (7, 6, 5, 3, 2, 12, 13, 4):
            continue
        found, frontier, seen = [], [value.name], set()
        while frontier:
            tensor = frontier.pop()
            if tensor in seen:
                continue
            seen.add(tensor)
            for node, idx in consumers.get(tensor, ()):
                if node.op_type == "Gather" and idx == 1:
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    size = rows(node.input[0], axis)
                    if size:
                        found.append(size)
                elif node.op_type in _PASS_THROUGH and idx == 0:
                    frontier.extend(node.output[:1])
        if found:
            out[value.name] = (0, min(found) - 1)
    return out


def hf_bounds(folder: Path) -> dict[str, tuple[int, int]]:
    """The bounds a Hugging Face ``config.json`` states."""
    cfg = read_hf_config(folder)
    out = {"attention_mask": (0, 1)}
    for name, key in (("input_ids", "vocab_size"), ("token_type_ids", "type_vocab_size"),
                      ("position_ids", "max_position_embeddings")):
        size = cfg.get(key)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            out[name] = (0, size - 1)
    return out


def input_bounds(recipe: Recipe, onnx_path: Path | None) -> dict[str, tuple[int, int]]:
    """The bounds of every declared integer input that has any, intersected over the three sources."""
    declared = {s.name: s for s in recipe.inputs if s.dtype in INTEGER_DTYPES}
    sources: list[dict[str, tuple[int, int]]] = []
    sources.append({n: tuple(s.range) for n, s in declared.items() if getattr(s, "range", None)})
    if recipe.source.kind == "huggingface" and recipe.source.path is not None:
        sources.append(hf_bounds(recipe.source.path))
    if onnx_path is not None and Path(onnx_path).is_file():
        try:
            import onnx

            graph = onnx.load(str(onnx_path), load_external_data=False)
        except Exception:  # not a graph this can read (the export checks the file): no bounds from it
            graph = None
        if graph is not None:
            sources.append(graph_gather_bounds(graph))
    out: dict[str, tuple[int, int]] = {}
    for found in sources:
        for name, (low, high) in found.items():
            if name not in declared:
                continue
            if name in out:
                low, high = max(low, out[name][0]), min(high, out[name][1])
            if low > high:
                raise FactoryError(f"input {name!r} has no allowed value: the recipe's range, the model's config and "
                                   f"its graph do not overlap (last: {found[name]}). Fix: correct [[inputs]] range "
                                   f"of {name!r} in the recipe")
            out[name] = (low, high)
    return out
