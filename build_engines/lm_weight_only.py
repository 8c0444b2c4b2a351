"""Weight-only INT8 / INT4 of the TensorRT graph of a text-generation model, in the Q/DQ form TensorRT consumes.

Every MatMul (or untransposed Gemm) whose second input is a 2-D weight initializer ``[K, N]`` gets it through a
``DequantizeLinear`` of integer weights: INT4 in symmetric blocks of ``block`` rows along K (opset 21's ``block_size``; TensorRT's INT4
weight-only quantization), INT8 symmetric per output channel (``axis = 1``). Activations stay FP32, so the strongly
typed network is FP32 with integer weights, as TensorRT's weight-only quantization (WoQ) expects; the embedding's
Gather is left in float. Scales are round-to-nearest (``max |w| / 7`` or ``/ 127`` per block or channel): the
data-aware (AWQ) scaling of the ONNX Runtime graphs is theirs (``lm_quantize``). ONNX Runtime runs the same graph on
the CPU, which is how the build checks it before any plan is built (``lm_tensorrt``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from model_factory.errors import FactoryError

QMAX = {"int4": 7, "int8": 127}
OPSET = 21  # DequantizeLinear with block_size and INT4


def _int4_raw(q: np.ndarray) -> bytes:
    """ONNX's INT4 storage: two values a byte, the first in the low nibble (an odd count padded with 0)."""
    flat = (q.reshape(-1).astype(np.int16) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()


def quantize_weight(w: np.ndarray, precision: str, block: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(integer weights ``[K, N]``, scales) of one ``[K, N]`` weight; None when INT4 blocks do not divide K."""
    k, n = w.shape
    qmax = QMAX[precision]
    if precision == "int4":
        if k % block:
            return None
        grouped = w.reshape(k // block, block, n)
        scale = np.abs(grouped).max(axis=1) / qmax  # [K / block, N]
        scale[scale == 0] = 1.0
        q = np.clip(np.rint(grouped / scale[:, None, :]), -qmax - 1, qmax).reshape(k, n)
    else:
        scale = np.abs(w).max(axis=0) / qmax  # [N]
        scale[scale == 0] = 1.0
        q = np.clip(np.rint(w / scale), -qmax, qmax)
    return q.astype(np.int8), scale.astype(np.float32)


def _takes_weight(node: Any) -> bool:
    """A MatMul, or a Gemm with neither input transposed (GPT-2's Conv1D exports as ``Gemm(x, W [K, N], b)``): its
    second input may be a ``[K, N]`` weight."""
    if len(node.input) < 2:
        return False
    if node.op_type == "Gemm":
        return not any(a.name in ("transA", "transB") and a.i for a in node.attribute)
    return node.op_type == "MatMul"


def weight_only_qdq(graph: Path, out: Path, precision: str, block: int = 32) -> dict[str, Any]:
    """Write ``out`` (+ ``.data``): ``graph`` with its MatMul weights as ``precision`` (``int8`` / ``int4``) behind
    DequantizeLinear. Returns what was done: weights quantized, kept in float (a K that INT4 blocks do not divide)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if precision not in QMAX:
        raise FactoryError(f"no weight-only form for {precision}. Fix: use int8 or int4")
    model = onnx.load(str(graph))
    inits = {t.name: t for t in model.graph.initializer}
    nodes, quantized, kept = [], [], []
    for node in model.graph.node:
        weight = inits.get(node.input[1]) if _takes_weight(node) else None
        if weight is not None and len(weight.dims) == 2 and weight.data_type == TensorProto.FLOAT:
            done = quantize_weight(numpy_helper.to_array(weight), precision, block)
            if done is None:
                kept.append(node.name)
            else:
                q, scale = done
                name = weight.name
                if precision == "int4":
                    qt = helper.make_tensor(f"{name}_int4", TensorProto.INT4, list(q.shape), _int4_raw(q), raw=True)
                else:
                    qt = numpy_helper.from_array(q, f"{name}_int8")
                st = numpy_helper.from_array(scale, f"{name}_scale")
                model.graph.initializer.extend([qt, st])
                attrs = {"axis": 0, "block_size": block} if precision == "int4" else {"axis": 1}
                nodes.append(helper.make_node("DequantizeLinear", [qt.name, st.name], [f"{name}_dq"],
                                              name=f"{node.name}/weights_dq", **attrs))
                node.input[1] = f"{name}_dq"
                quantized.append(node.name)
        nodes.append(node)
    if not quantized:
        raise FactoryError(f"{graph.name} has no MatMul with a 2-D float weight to quantize to {precision}")
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {x for n in model.graph.node for x in n.input}
    live = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(live)
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            imp.version = max(imp.version, OPSET)
    out = Path(out)
    for f in (out, out.with_name(out.name + ".data")):
        f.unlink(missing_ok=True)
    onnx.save(model, str(out), save_as_external_data=True, location=out.name + ".data", size_threshold=1024)
    return {"precision": precision, "method": "round to nearest, symmetric",
            "granularity": f"blocks of {block} along K" if precision == "int4" else "per output channel",
            "quantized_matmuls": len(quantized), "float_matmuls": kept}
