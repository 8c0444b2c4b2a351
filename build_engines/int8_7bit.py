"""The INT8 model's 7-bit weight form: ONNX Runtime's integer kernels cannot saturate on it, on any x86 CPU.

Without an integer dot-product instruction (AVX-512 VNNI, AVX-VNNI, AMX), ONNX Runtime's x86 kernels multiply
u8 activations by s8 weights with ``vpmaddubsw``, which adds each pair of products into a *16-bit* sum with
saturation: with 8-bit weights a pair reaches 2·255·127 = 64770 > 32767, and the result is silently wrong
(seen on an AVX2-only EPYC: 5 of 40 outputs of one INT8 MatMul off by up to 5.6). With weights in
``[-63, 63]`` a pair is at most 2·255·63 = 32130: it fits. This is ONNX Runtime's own ``reduce_range``
remedy, applied here to the graph the quantize stage already built: every int8 weight of a DequantizeLinear
is re-quantized per output channel to 7 bits (its scale doubled, about), activations and graph unchanged.

The form costs weight precision, so the quantize stage scores it with the held-out data like any precision
and writes it (``backend.contract.Files.INT8_7BIT``) only when it passes the gate; the backend then runs it
with integer kernels on CPUs without dot products (``backend.cpu_features``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from model_factory.build_engines import onnx_files
from model_factory.errors import InternalError, require

WEIGHT_MAX = 63  # |w| <= 63: 2 * 255 * 63 = 32130 fits a signed 16-bit pair sum


def seven_bit(q: np.ndarray, scale: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``(q7, scale7)``: int8 weights ``q`` (per-channel along ``axis``, or per tensor) in ``[-63, 63]``.

    Each channel's largest magnitude maps to 63 (channels already within range are left as they are), so
    ``q7 * scale7`` is the nearest 7-bit value to ``q * scale``.
    """
    qf = q.astype(np.float32)
    if axis is None or scale.ndim == 0 or scale.size == 1:
        peak = np.max(np.abs(qf)) if qf.size else 0.0
        factor = np.float32(WEIGHT_MAX / peak) if peak > WEIGHT_MAX else np.float32(1.0)
        q7 = np.clip(np.rint(qf * factor), -WEIGHT_MAX, WEIGHT_MAX).astype(np.int8)
        return q7, (scale / factor).astype(scale.dtype)
    axis = axis % q.ndim
    others = tuple(a for a in range(q.ndim) if a != axis)
    peak = np.max(np.abs(qf), axis=others) if others else np.abs(qf)
    factor = np.where(peak > WEIGHT_MAX, WEIGHT_MAX / np.maximum(peak, 1.0), 1.0).astype(np.float32)
    shape = [1] * q.ndim
    shape[axis] = -1
    q7 = np.clip(np.rint(qf * factor.reshape(shape)), -WEIGHT_MAX, WEIGHT_MAX).astype(np.int8)
    return q7, (scale / factor).astype(scale.dtype)


def write_7bit(int8_path: Path, dest: Path) -> tuple[Path, int]:
    """Write the 7-bit weight form of the INT8 Q/DQ model at ``int8_path`` to ``dest``; ``(dest, weights changed)``.

    A weight is an int8 initializer read by DequantizeLinear as its first input, with its scale an initializer;
    a weight several DequantizeLinear nodes read must have one scale and axis for all of them.
    """
    onnx = require("onnx", "onnx")
    numpy_helper = onnx.numpy_helper
    int8_path = Path(int8_path)
    model = onnx_files.load_graph(int8_path)
    base = int8_path.parent
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, tuple[str, int | None]] = {}
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
            continue
        if inits[node.input[0]].data_type != onnx.TensorProto.INT8 or len(node.input) < 2 or node.input[1] not in inits:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        seen = readers.setdefault(node.input[0], (node.input[1], axis))
        if seen != (node.input[1], axis):
            raise InternalError(f"weight {node.input[0]} is dequantized with two scales: cannot re-quantize it")
    scales = [s for s, _ in readers.values()]
    if len(set(scales)) != len(scales):
        raise InternalError("two INT8 weights share one scale tensor: cannot re-quantize them apart")
    changed = 0
    for weight, (scale_name, axis) in readers.items():
        q = onnx_files.tensor_array(inits[weight], base)
        scale = onnx_files.tensor_array(inits[scale_name], base)
        q7, scale7 = seven_bit(q, scale, axis if scale.ndim else None)
        changed += int(np.any(q7 != q))
        _replace(inits[weight], numpy_helper.from_array(q7, weight))
        _replace(inits[scale_name], numpy_helper.from_array(scale7, scale_name))
    onnx_files.save(model, dest, base_dir=base, consume=True)
    return Path(dest), changed


def _replace(tensor: Any, new: Any) -> None:
    """Put ``new``'s values into the graph's ``tensor`` (in memory from now on, not in a data file)."""
    tensor.CopyFrom(new)
