"""Where a reduced-precision graph first departs from FP32: per-layer outputs compared by exact tensor name.

Both ONNX models are run with ONNX Runtime on the CPU with every intermediate tensor exposed as a graph
output (basic graph optimizations only, so Q/DQ pairs stay float arithmetic as TensorRT computes them and
no fusion hides a tensor). Tensors are paired by *exact name* (FP16 and INT8 Q/DQ models keep the FP32
graph's node outputs), compared by cosine similarity per sample (mean over samples), and walked in the
FP32 graph's topological order: the first tensors below the threshold are where the departure starts;
everything after them inherits it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from model_factory.errors import require

MAX_SAMPLES = 4


@dataclass(frozen=True)
class Departure:
    """One tensor of the reduced-precision graph below the threshold, in FP32 graph order."""

    tensor: str
    node: str
    op: str
    cosine: float
    max_abs_error: float
    position: int  # index of the producing node in the FP32 graph

    def describe(self) -> str:
        return f"{self.node} ({self.op}) -> {self.tensor}: cosine {self.cosine:.4f}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _load(model: Path | bytes) -> Any:
    """The model with its weights in the proto (read past onnx's loader: packaged data files are hard links)."""
    onnx = require("onnx", "onnx")
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    from model_factory.build_engines.onnx_files import load_graph, load_weights

    return load_weights(load_graph(Path(model)), Path(model).parent)


def _cosine(ref: np.ndarray, cand: np.ndarray) -> float:
    n = ref.shape[0] if ref.ndim else 1
    r = ref.reshape(n, -1).astype(np.float64)
    c = cand.reshape(n, -1).astype(np.float64)
    rn, cn = np.linalg.norm(r, axis=1), np.linalg.norm(c, axis=1)
    with np.errstate(all="ignore"):
        cos = np.sum(r * c, axis=1) / (rn * cn)
    both_zero = (rn == 0) & (cn == 0)
    cos = np.where(both_zero, 1.0, cos)
    cos = np.where(np.isfinite(cos) & np.isfinite(c).all(axis=1), cos, -1.0)
    return float(np.mean(cos))


def first_departures(reference: Path | bytes, candidate: Path | bytes, feeds: Mapping[str, np.ndarray],
                     threshold: float, limit: int = 3) -> list[Departure]:
    """The first ``limit`` tensors (FP32 graph order) where ``candidate`` falls below ``threshold`` cosine."""
    ref_model, cand_model = _load(reference), _load(candidate)
    cand_tensors = {o for n in cand_model.graph.node for o in n.output}
    order: list[tuple[str, str, str, int]] = []
    for i, node in enumerate(ref_model.graph.node):
        for out in node.output:
            if out and out in cand_tensors:
                order.append((out, node.name or f"{node.op_type}_{i}", node.op_type, i))
    names = [t for t, *_ in order]
    if not names:
        return []
    from model_factory.build_engines.export import onnxruntime_session
    from model_factory.build_engines.onnx_files import with_outputs

    ref_s = onnxruntime_session(with_outputs(ref_model, names).SerializeToString(), basic_optimizations=True)
    cand_s = onnxruntime_session(with_outputs(cand_model, names).SerializeToString(), basic_optimizations=True)
    inputs = {i.name for i in ref_s.get_inputs()}
    small = {k: np.asarray(v)[:MAX_SAMPLES] for k, v in feeds.items() if k in inputs}
    ref_out = dict(zip([o.name for o in ref_s.get_outputs()], ref_s.run(None, small)))
    cand_inputs = {i.name for i in cand_s.get_inputs()}
    cand_out = dict(zip([o.name for o in cand_s.get_outputs()],
                        cand_s.run(None, {k: v for k, v in small.items() if k in cand_inputs})))
    found: list[Departure] = []
    for tensor, node, op, pos in order:
        r, c = ref_out.get(tensor), cand_out.get(tensor)
        if r is None or c is None or r.shape != c.shape:
            continue
        r, c = np.asarray(r), np.asarray(c)
        if not (np.issubdtype(r.dtype, np.floating) and np.issubdtype(c.dtype, np.floating)) or r.size == 0:
            continue
        cos = _cosine(r, c)
        if cos < threshold:
            max_abs = float(np.max(np.abs(r.astype(np.float64) - c.astype(np.float64))))
            found.append(Departure(tensor, node, op, cos, max_abs, pos))
            if len(found) >= limit:
                break
    return found


def render_departures(precision: str, departures: list[Departure]) -> str:
    """One line per departure, for the gate's report."""
    if not departures:
        return f"{precision}: no intermediate tensor below the threshold (the departure is in the last layers)"
    lines = [f"{precision} first departs from FP32 at (per-layer outputs by exact tensor name):"]
    lines += [f"  {d.describe()} (max abs err {d.max_abs_error:.3g})" for d in departures]
    return "\n".join(lines)
