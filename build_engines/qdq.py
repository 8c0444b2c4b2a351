"""INT8 as explicit Q/DQ: the candidate nodes, activation ranges from calibration data, and the graph builder.

Symmetric (zero point 0), weights per output channel, activations per tensor, only on the inputs of MatMul,
Gemm and Conv, never on tensors computed from mask inputs alone (see :mod:`.quantize` for why). Ranges are
computed once (:func:`calibrate`); :class:`QdqBuilder` then makes cheap graph variants from them.
"""

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
from model_factory.build_engines.calibration import Feeds, batches, sample_count
from model_factory.build_engines.ort_session import onnxruntime_session
from model_factory.errors import FactoryError, InternalError, require
from model_factory.progress import Steps

QUANTIZABLE_OPS = ("MatMul", "Gemm", "Conv")
PERCENTILE = 99.99
HIST_BINS = 2048
CALIB_BATCH = 8
INT8_MAX = 127


@dataclass(frozen=True)
class Candidate:
    """One MatMul/Gemm/Conv that can run in INT8."""

    node: str
    op: str
    activations: tuple[str, ...]  # inputs quantized per tensor with calibrated ranges
    weight: str | None  # initializer quantized per channel
    weight_axis: int


# --------------------------------------------------------------------------- graph helpers


def _initializers(model: Any) -> dict[str, Any]:
    return {i.name: i for i in model.graph.initializer}


def _mask_only_tensors(model: Any) -> set[str]:
    """Tensors computed from mask inputs (and constants) alone: the additive-mask path."""
    graph = model.graph
    inits = set(_initializers(model))
    mask_inputs = {i.name for i in graph.input if "mask" in i.name.lower() and i.name not in inits}
    origin: dict[str, frozenset[str]] = {i.name: frozenset([i.name]) for i in graph.input if i.name not in inits}
    for node in graph.node:  # ONNX nodes are topologically sorted
        src = frozenset().union(*(origin.get(x, frozenset()) for x in node.input if x))
        for out in node.output:
            origin[out] = src
    return {t for t, src in origin.items() if src and src <= mask_inputs}


def find_candidates(model: Any) -> tuple[list[Candidate], dict[str, str]]:
    """The INT8 candidates, and the quantizable nodes left out with the reason."""
    inits = _initializers(model)
    mask_only = _mask_only_tensors(model)
    candidates: list[Candidate] = []
    skipped: dict[str, str] = {}
    for i, node in enumerate(model.graph.node):
        if node.op_type not in QUANTIZABLE_OPS or node.domain not in ("", "ai.onnx"):
            continue
        name = node.name or f"{node.op_type}_{i}"
        data_inputs = [x for x in node.input[:2] if x]
        if len(data_inputs) < 2:
            skipped[name] = "fewer than two inputs"
            continue
        if any(x in mask_only for x in data_inputs):
            skipped[name] = "reads the mask path"
            continue
        weight = None
        axis = 0
        acts = []
        for pos, x in enumerate(data_inputs):
            init = inits.get(x)
            if init is not None and pos == 1 and init.data_type == 1 and len(init.dims) >= 1:
                weight = x
                if node.op_type == "Conv":
                    axis = 0
                elif node.op_type == "Gemm":
                    trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
                    axis = 0 if trans_b else 1
                else:
                    axis = len(init.dims) - 1
            elif init is not None and init.data_type != 1:
                break
            else:
                acts.append(x)
        else:
            candidates.append(Candidate(name, node.op_type, tuple(acts), weight, axis))
            continue
        skipped[name] = "non-float constant input"
    return candidates, skipped


def _node_names(model: Any) -> None:
    """Give every node a name (the search and the report refer to nodes by name)."""
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}" if not node.name else f"{node.name}_{i}"
        seen.add(node.name)


# --------------------------------------------------------------------------- calibration


def _save_beside(model: Any, path: Path) -> None:
    """Write a graph-only working model whose weights stay in the data file already linked beside ``path``."""
    path.write_bytes(model.SerializeToString())


def _run_extra(model: Any, tensors: list[str], feeds: Feeds, work: Path, fn: Callable[[str, np.ndarray], None],
               steps: Steps | None = None) -> None:
    path = work / "calibrate.onnx"
    _save_beside(onnx_files.with_outputs(model, tensors, float32=True), path)
    sess = onnxruntime_session(path)
    for batch in batches(feeds, CALIB_BATCH):
        for name, value in zip(tensors, sess.run(tensors, batch)):
            fn(name, np.abs(np.asarray(value, dtype=np.float32)))
        if steps is not None:
            steps.step(sample_count(batch))
    del sess
    path.unlink()


def _entropy_threshold(hist: np.ndarray, edges: np.ndarray, levels: int = INT8_MAX + 1) -> float:
    """TensorRT's KL-divergence calibration: the |x| threshold whose 8-bit histogram loses least."""
    hist = hist.astype(np.float64)
    n = hist.size
    if hist.sum() == 0:
        return float(edges[-1])
    best_i, best_kl = n, np.inf
    # Thresholds are tried every few bins: the curve is smooth and 2048 trials per tensor are slow.
    for i in range(levels, n + 1, 16 if n > 512 else 1):
        p = hist[:i].copy()
        p[i - 1] += hist[i:].sum()  # clip the outliers into the last bin
        # Merge the i bins into `levels` quantized bins, then expand back over the non-empty bins.
        idx = (np.arange(i) * levels) // i
        nonzero = hist[:i] > 0
        q_sum = np.bincount(idx, weights=hist[:i], minlength=levels)
        q_cnt = np.bincount(idx, weights=nonzero.astype(np.float64), minlength=levels)
        q = np.where(nonzero, q_sum[idx] / np.maximum(q_cnt[idx], 1), 0.0)
        ps, qs = p.sum(), q.sum()
        if qs == 0:
            continue
        p /= ps
        q /= qs
        mask = p > 0
        kl = float(np.sum(p[mask] * np.log(p[mask] / np.maximum(q[mask], 1e-12))))
        if kl < best_kl:
            best_kl, best_i = kl, i
    return float(edges[best_i])


def calibrate(model: Any, tensors: Sequence[str], feeds: Feeds, method: str, work: Path,
              say: Callable[[str], None] = lambda _m: None) -> dict[str, float]:
    """Per-tensor |x| ranges of ``tensors`` over ``feeds`` with ``method`` (minmax, percentile or entropy)."""
    if method not in ("minmax", "percentile", "entropy"):
        raise FactoryError(f"unknown calibration method {method!r}. Fix: use minmax, percentile or entropy")
    tensors = list(dict.fromkeys(tensors))
    amax = {t: 0.0 for t in tensors}

    def take_max(name: str, value: np.ndarray) -> None:
        if not np.isfinite(value).all():
            raise FactoryError(f"the FP32 model produced non-finite values in {name} on the calibration data. "
                               "Fix: check the calibration inputs are valid for this model")
        if value.size:
            amax[name] = max(amax[name], float(value.max()))

    n = sample_count(feeds)
    _run_extra(model, tensors, feeds, work, take_max, Steps(say, "calibration ranges, samples", n, reports=4))
    if method == "minmax":
        return amax
    hists = {t: np.zeros(HIST_BINS, dtype=np.int64) for t in tensors}

    def take_hist(name: str, value: np.ndarray) -> None:
        top = amax[name] or 1.0
        hists[name] += np.histogram(value, bins=HIST_BINS, range=(0.0, top))[0]

    _run_extra(model, tensors, feeds, work, take_hist, Steps(say, f"calibration histograms ({method}), samples", n,
                                                             reports=4))
    out = {}
    for t in tensors:
        edges = np.linspace(0.0, amax[t] or 1.0, HIST_BINS + 1)
        h = hists[t]
        if method == "percentile":
            cdf = np.cumsum(h) / max(h.sum(), 1)
            i = int(np.searchsorted(cdf, PERCENTILE / 100.0))
            out[t] = float(edges[min(i + 1, HIST_BINS)])
        else:
            out[t] = _entropy_threshold(h, edges)
        out[t] = min(out[t], amax[t]) or amax[t]
    return out


# --------------------------------------------------------------------------- Q/DQ graph


class QdqBuilder:
    """Builds INT8 Q/DQ variants of one FP32 model for any subset of the candidates.

    Quantized weights are computed once; a variant costs a graph copy.
    """

    def __init__(self, model: Any, candidates: Sequence[Candidate], amax: Mapping[str, float],
                 base_dir: Path | None = None) -> None:
        self.onnx = require("onnx", "onnx")
        self.model = model
        self.base_dir = Path(base_dir) if base_dir is not None else Path(".")  # where external weights live
        self.candidates = {c.node: c for c in candidates}
        self.amax = dict(amax)
        self._weights: dict[str, tuple[Any, Any, Any]] = {}
        if any(o.domain in ("", "ai.onnx") and o.version < 13 for o in model.opset_import):
            raise FactoryError("INT8 Q/DQ needs ONNX opset 13 or newer (per-channel DequantizeLinear). Fix: set "
                               "export.opset = 17")

    def _weight(self, c: Candidate) -> tuple[Any, Any, Any]:
        key = f"{c.weight}|{c.weight_axis}"
        if key not in self._weights:
            numpy_helper = self.onnx.numpy_helper
            w = onnx_files.tensor_array(_initializers(self.model)[c.weight], self.base_dir).astype(np.float32)
            reduce_axes = tuple(a for a in range(w.ndim) if a != c.weight_axis)
            amax = np.max(np.abs(w), axis=reduce_axes) if reduce_axes else np.abs(w)
            scale = (np.where(amax > 0, amax, 1.0) / INT8_MAX).astype(np.float32)
            shape = [1] * w.ndim
            shape[c.weight_axis] = -1
            q = np.clip(np.rint(w / scale.reshape(shape)), -INT8_MAX, INT8_MAX).astype(np.int8)
            base = f"{c.weight}_int8"
            self._weights[key] = (numpy_helper.from_array(q, base), numpy_helper.from_array(scale, base + "_scale"),
                                  numpy_helper.from_array(np.zeros(scale.shape, np.int8), base + "_zero_point"))
        return self._weights[key]

    def build(self, int8_nodes: Iterable[str]) -> Any:
        """A copy of the model with Q/DQ on the inputs of ``int8_nodes``."""
        chosen = set(int8_nodes)
        unknown = chosen - set(self.candidates)
        if unknown:
            raise InternalError(f"not INT8 candidates: {sorted(unknown)}")
        return self._rewrite(chosen, switchable=False)[0]

    def build_switchable(self) -> tuple[Any, dict[str, str]]:
        """One model for the search: every candidate reads ``Where(switch, DQ(Q(x)), x)``.

        Returns the model and, per candidate node, the name of its boolean scalar switch input. Feeding
        True runs that node on quantized inputs, False on float ones, so a sensitivity sweep needs one
        session instead of one per variant. (The final model is built without switches.)
        """
        return self._rewrite(set(self.candidates), switchable=True)

    def _rewrite(self, chosen: set[str], switchable: bool) -> tuple[Any, dict[str, str]]:
        onnx = self.onnx
        helper, numpy_helper = onnx.helper, onnx.numpy_helper
        m = onnx.ModelProto()
        m.CopyFrom(self.model)
        graph = m.graph
        new_nodes: list[Any] = []
        new_inits = [numpy_helper.from_array(np.zeros((), np.int8), "qdq_zero_point_int8")]
        zero = new_inits[0].name
        # (activation tensor, reader) -> its dequantized name. The final model gives every quantized reader its
        # own Q/DQ pair (same scale, same numbers): ONNX Runtime fuses a DequantizeLinear into an integer
        # MatMul only when that MatMul is its one reader, and a pair shared by MiniLM's Q/K/V projections left
        # 18 of 44 MatMuls in float on the CPU (benchmarks/RESULTS.md, "INT8 on the CPU"). The search's
        # switchable model shares one pair per tensor.
        act_dq: dict[tuple[str, str], str] = {}
        act_scales: set[str] = set()
        weight_dq: dict[str, str] = {}
        replaced_weights: set[str] = set()
        switches: dict[str, str] = {}
        for node in graph.node:
            c = self.candidates.get(node.name)
            if c is None or c.node not in chosen:
                new_nodes.append(node)
                continue
            if switchable:
                switches[c.node] = f"qdq_switch_{len(switches)}"
                graph.input.append(helper.make_tensor_value_info(switches[c.node], onnx.TensorProto.BOOL, []))
            for pos, x in enumerate(list(node.input)):
                if x in c.activations:
                    key = (x, "" if switchable else node.name)
                    if key not in act_dq:
                        scale_name = f"{x}_act_scale"
                        if scale_name not in act_scales:
                            act_scales.add(scale_name)
                            scale = max(self.amax.get(x, 0.0), 1e-8) / INT8_MAX
                            new_inits.append(numpy_helper.from_array(np.array(scale, np.float32), scale_name))
                        nth = sum(k[0] == x for k in act_dq)  # the first pair keeps the plain names
                        suffix = f"_{nth}" if nth else ""
                        q, dq = f"{x}_QuantizeLinear{suffix}", f"{x}_DequantizeLinear{suffix}"
                        new_nodes.append(helper.make_node("QuantizeLinear", [x, scale_name, zero], [q + "_output"],
                                                          name=q))
                        new_nodes.append(helper.make_node("DequantizeLinear", [q + "_output", scale_name, zero],
                                                          [dq + "_output"], name=dq))
                        act_dq[key] = dq + "_output"
                    quantized = act_dq[key]
                elif x == c.weight:
                    key = f"{x}|{c.weight_axis}"
                    if key not in weight_dq:
                        wq, scale, zp = self._weight(c)
                        new_inits.extend([wq, scale, zp])
                        dq = f"{wq.name}_DequantizeLinear"
                        new_nodes.append(helper.make_node("DequantizeLinear", [wq.name, scale.name, zp.name],
                                                          [dq + "_output"], name=dq, axis=c.weight_axis))
                        weight_dq[key] = dq + "_output"
                    quantized = weight_dq[key]
                    replaced_weights.add(x)
                else:
                    continue
                if switchable:
                    sel = f"{c.node}/qdq_switch_{pos}"
                    new_nodes.append(helper.make_node("Where", [switches[c.node], quantized, x], [sel + "_output"],
                                                      name=sel))
                    quantized = sel + "_output"
                node.input[pos] = quantized
            # Q/DQ nodes were appended right before their reader, after x's producer: the order stays topological.
            new_nodes.append(node)
        # Float weights nobody reads any more are dropped (that is where INT8 saves space).
        still_read = {x for n in new_nodes for x in n.input} | {o.name for o in graph.output}
        kept_inits = [i for i in graph.initializer if i.name not in replaced_weights or i.name in still_read]
        del graph.node[:]
        graph.node.extend(new_nodes)
        del graph.initializer[:]
        graph.initializer.extend(kept_inits + new_inits)
        return m, switches


def toposort(graph: Any) -> None:
    """Sort ``graph``'s nodes so every tensor is produced before it is read (Kahn's algorithm, stable).

    The FP16 converter appends its Cast nodes at the end; ONNX Runtime copes, the ONNX checker and
    TensorRT's parser do not.
    """
    nodes = list(graph.node)
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    deps = [{producer[x] for x in n.input if x in producer and producer[x] != i} for i, n in enumerate(nodes)]
    readers: dict[int, list[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            readers.setdefault(j, []).append(i)
    waiting = [len(d) for d in deps]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for r in readers.get(i, ()):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(nodes):
        raise FactoryError("the graph has a cycle, so it cannot be sorted. Fix: re-export the model")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


# --------------------------------------------------------------------------- FP16
