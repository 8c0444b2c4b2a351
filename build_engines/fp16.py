"""FP16: the graph converted to half precision, with normalisations and reductions kept in float."""

from __future__ import annotations

import dataclasses
import heapq
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from model_factory.build_engines import onnx_files
from model_factory.build_engines.qdq import toposort
from model_factory.errors import FactoryError, require

# Kept in float32 inside FP16 models: normalisations and reductions accumulate over many values.
FP16_FLOAT_OPS = ("LayerNormalization", "ReduceSum", "ReduceMean", "ReduceL2", "ReduceSumSquare", "Pow", "Sqrt",
                  "Softmax", "Erf")


def convert_fp16_graph(model: Any, keep_io_types: bool = True) -> tuple[Any, dict[str, Callable[[bytes], bytes]]]:
    """FP16 conversion of a graph whose large weights stay in a data file.

    Returns the converted graph (sensitive ops in float32; its float inputs and outputs kept float32 unless
    ``keep_io_types`` is false: then they are FP16 too, as a text-generation graph's KV cache) and, for each
    weight still in the data file whose type became FP16, the conversion its bytes need: pass both to
    :func:`onnx_files.save`, which converts them chunk by chunk as it writes. Shapes are inferred on
    the graph alone (``infer_shapes`` on a loaded model serializes the weights, and fails past 2 GB).
    """
    require("onnxruntime", "onnx")
    from onnxruntime.transformers.float16 import (DEFAULT_OP_BLOCK_LIST, convert_float_to_float16,
                                                  convert_np_to_float16)

    onnx = require("onnx", "onnx")
    try:
        m = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is a help for the converter, not a requirement
        m = onnx.ModelProto()
        m.CopyFrom(model)
    external = {i.name for i in m.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL
                and i.data_type == onnx.TensorProto.FLOAT}
    from onnxruntime.transformers import float16

    # The converter reads a converted initializer's shape through numpy_helper.to_array, which would load
    # a weight from its data file (relative to the working directory): the dims say the same.
    original = float16.make_value_info_from_tensor
    float16.make_value_info_from_tensor = lambda t: onnx.helper.make_tensor_value_info(t.name, t.data_type,
                                                                                       list(t.dims))
    try:
        out = convert_float_to_float16(m, keep_io_types=keep_io_types, disable_shape_infer=True,
                                       op_block_list=list(DEFAULT_OP_BLOCK_LIST) + list(FP16_FLOAT_OPS))
    except Exception as exc:  # the converter raises assorted types on odd graphs
        raise FactoryError(f"FP16 conversion failed: {type(exc).__name__}: {exc}. Fix: keep fp16 out of "
                           "the recipe's precisions for this model") from exc
    finally:
        float16.make_value_info_from_tensor = original
    toposort(out.graph)

    def to_fp16(chunk: bytes) -> bytes:
        # The converter's own rounding (tiny values kept non-zero, large ones clamped to FP16's range).
        return convert_np_to_float16(np.frombuffer(chunk, dtype=np.float32)).tobytes()

    converted = {i.name: to_fp16 for i in out.graph.initializer
                 if i.name in external and i.data_type == onnx.TensorProto.FLOAT16}
    return out, converted


def convert_fp16(model: Any, base_dir: Path | None = None) -> Any:
    """An FP16 copy of ``model`` with I/O types kept and sensitive ops in float32, weights in memory.

    For a model too large to hold, use :func:`convert_fp16_graph` and stream it to disk.
    """
    out, converted = convert_fp16_graph(model)
    return onnx_files.load_weights(out, Path(base_dir or "."), converted)


# --------------------------------------------------------------------------- mixed precision
