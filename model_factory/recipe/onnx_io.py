"""An ONNX graph's inputs and outputs as the recipe's :class:`TensorSpec` (for an ``onnx`` source)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_factory.errors import require
from model_factory.recipe.errors import field_error as _err
from model_factory.recipe.schema import ONNX_DTYPES
from model_factory.recipe.specs import TensorSpec


def onnx_tensor_specs(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The inputs and outputs of an ONNX graph as Triton sees them (the batch axis dropped, ``-1`` dynamic).

    Reads the graph only (external weight files are not loaded). Axis 0 of every tensor must be the batch
    axis, dynamic; an axis with a symbolic or unknown size is dynamic.
    """
    onnx = require("onnx", "onnx")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others: all mean "not an ONNX file"
        raise _err("source.path", f"{path} is not a readable ONNX model ({type(exc).__name__})",
                   "point it at an .onnx file saved by torch.onnx.export or onnx.save") from exc
    return graph_tensor_specs(model)


def graph_tensor_specs(model: Any) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """:func:`onnx_tensor_specs` of an already loaded ``onnx.ModelProto``."""
    inits = {i.name for i in model.graph.initializer}

    def specs(values: Any, section: str) -> tuple[TensorSpec, ...]:
        out = []
        for v in values:
            if v.name in inits:
                continue
            t = v.type.tensor_type
            dtype = ONNX_DTYPES.get(t.elem_type)
            if dtype is None or not t.HasField("shape"):
                raise _err(section, f"the graph's tensor {v.name!r} has an element type or shape that cannot be "
                           "read", f"declare [[{section}]] with name, dtype and dims for every graph {section[:-1]}")
            dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in t.shape.dim]
            if not dims or dims[0] != -1:
                raise _err(section, f"the graph's tensor {v.name!r} has shape {dims}: axis 0 is not a dynamic batch "
                           "axis", "export the model with a dynamic batch axis (torch.onnx.export(..., "
                           "dynamic_axes={name: {0: 'batch'}}))")
            out.append(TensorSpec(v.name, dtype, tuple(dims[1:])))
        return tuple(out)

    return specs(model.graph.input, "inputs"), specs(model.graph.output, "outputs")

