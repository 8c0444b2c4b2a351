"""Quantize stage: FP16 and INT8 (explicit Q/DQ) ONNX models, scored against FP32.

FP16
    ``onnxruntime.transformers.float16.convert_float_to_float16`` with the graph
    inputs and outputs kept in their types; normalisations and reductions (the
    parts whose accumulation overflows or loses precision in half) stay in float.

INT8
    Explicit QuantizeLinear/DequantizeLinear pairs, the form TensorRT consumes
    in a strongly typed build: symmetric (zero point 0), weights per output
    channel, activations per tensor, and only on the inputs of MatMul, Gemm and
    Conv. Tensors computed from mask inputs alone (graph inputs whose name
    contains "mask") are never quantized: an additive mask holds float min and
    quantizing it wrecks the model. Other readers of a quantized tensor (the
    residual Add, say) keep reading the float tensor. Activation
    ranges come from the calibration data with the recipe's method: ``minmax``,
    ``percentile`` (99.99th of |x|) or ``entropy`` (KL-divergence threshold as
    in TensorRT's calibrator). Ranges are computed once; graph variants are then
    cheap to build.

Automatic mixed precision
    When the all-INT8 model misses the target (``min_accuracy``, or 0.99 when
    the recipe sets no gate), every candidate node's sensitivity is measured
    (the score with only that node in float), and the most harmful nodes are
    kept in float one at a time until the target is met; a last pass returns to
    INT8 any kept node the target does not need. The search scores on a slice of
    the *calibration* set and aims a little above the target (0.99 -> 0.992);
    the report and the gate use the held-out set only. One "switchable" model
    (``Where(switch, DQ(Q(x)), x)`` per input) serves every variant of the
    search from a single ONNX Runtime session.

Scoring
    INT8 models are run with Q/DQ simulated in float (ONNX Runtime with basic
    graph optimizations), which is what TensorRT's INT8 GEMMs compute; ORT's own
    fused int8 CPU kernels saturate on AVX2 machines without VNNI and would
    misjudge the model (see :func:`~model_factory.build_engines.accuracy.ort_session`).

``quant_pre_process`` is not used: its symbolic shape inference fails on these
exports (see docs/environment.md).
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

from model_factory.build_engines.accuracy import (  # noqa: F401 - AccuracyGateError is part of this API
    REPORT_NAME,
    AccuracyGateError,
    AccuracyReport,
    Evaluator,
    PrecisionAccuracy,
    check_gate,
    ort_session,
    primary_output,
)
from model_factory.build_engines.calibration import (
    DataSplit,
    Feeds,
    InputEncoder,
    batches,
    input_types,
    sample_count,
    split_data,
)
from model_factory.build_engines.export import ExportResult, check_onnx_file, onnxruntime_session
from model_factory.build_engines.golden import DEFAULT_THRESHOLD
from model_factory.errors import FactoryError, InternalError, require
from model_factory.fileio import atomic_dir, digest_path
from model_factory.memory import release_memory
from model_factory.build_engines import onnx_files
from model_factory.progress import Steps
from model_factory.recipe import Recipe

DEPARTURES_NAME = "departures.json"  # where a failing precision first departs from FP32, per layer
QUANTIZABLE_OPS = ("MatMul", "Gemm", "Conv")
# Kept in float32 inside FP16 models: normalisations and reductions accumulate over many values.
FP16_FLOAT_OPS = ("LayerNormalization", "ReduceSum", "ReduceMean", "ReduceL2", "ReduceSumSquare", "Pow", "Sqrt",
                  "Softmax", "Erf")
PERCENTILE = 99.99
HIST_BINS = 2048
CALIB_BATCH = 8
SEARCH_SAMPLES = 16
# A reranker's search scores rankings per query: 16 pairs are only four queries of four passages, too few
# to tell a node that flips a ranking from one that does not. Pairs are short and cheap to score.
SEARCH_SAMPLES_RERANKER = 64
# The search never sees the held-out set, so it aims a little above the gate: a fifth of the way from the
# target to a perfect score (0.99 -> 0.992). Without it a search that just crosses 0.99 on 16 samples
# passes or fails the held-out gate by chance.
SEARCH_MARGIN = 0.2


INT8_MAX = 127


def search_target(target: float) -> float:
    """The score the mixed-precision search aims for on its own samples, for a held-out ``target``."""
    return min(1.0, target + SEARCH_MARGIN * (1.0 - target))


@dataclass(frozen=True)
class QuantizeResult:
    """What the quantize stage produced."""

    models: dict[str, Path]  # precision -> ONNX file ("fp32" is the export's own file)
    report: AccuracyReport
    report_path: Path
    float_nodes: tuple[str, ...]  # INT8 candidates kept in float by mixed precision
    calibration_digest: str | None


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


def convert_fp16_graph(model: Any) -> tuple[Any, dict[str, Callable[[bytes], bytes]]]:
    """FP16 conversion of a graph whose large weights stay in a data file.

    Returns the converted graph (I/O types kept, sensitive ops in float32) and, for each weight still in
    the data file whose type became FP16, the conversion its bytes need: pass both to
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
        out = convert_float_to_float16(m, keep_io_types=True, disable_shape_infer=True,
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


class SwitchScorer:
    """Scores any INT8 subset through one switchable model and one ORT session."""

    def __init__(self, builder: QdqBuilder, evaluator: Evaluator, work: Path) -> None:
        model, self.switches = builder.build_switchable()
        path = work / "switchable.onnx"
        _save_beside(model, path)
        del model
        self.session = ort_session(path, simulate_qdq=True)
        self.evaluator = evaluator
        self.calls = 0

    def __call__(self, int8_nodes: Iterable[str]) -> float:
        on = set(int8_nodes)
        flags = {sw: np.array(node in on) for node, sw in self.switches.items()}
        self.calls += 1
        return self.evaluator.score(self.session, "int8", extra_feeds=flags).gate_score


def search_mixed_precision(names: Sequence[str], score: Callable[[Iterable[str]], float], target: float,
                           say: Callable[[str], None] = lambda _m: None) -> tuple[list[str], list[dict[str, Any]]]:
    """The nodes to keep in float so that ``score`` (of the INT8 node set) meets ``target``.

    1. Sensitivity: for every node, the score with that node alone in float.
    2. Keep the most harmful node in float, re-score, and repeat until the target is met.
    3. Give back: every kept node that the target does not need returns to INT8 (least harmful first),
       so as many nodes as the target allows stay in INT8.

    Returns the float nodes (most harmful first) and the steps taken (for the report). When even all
    candidates in float miss the target, every node is returned and the gate decides.
    """
    names = list(names)
    steps: list[dict[str, Any]] = []
    current = score(names)
    steps.append({"step": "all int8", "float_nodes": 0, "score": current})
    if current >= target:
        return [], steps
    all_int8 = current
    say(f"all-INT8 scores {all_int8:.5f} < {target:g}: measuring the sensitivity of {len(names)} nodes")
    steps_done = Steps(say, "  sensitivity, nodes measured", len(names))
    gain = {}
    for n in names:
        gain[n] = score([x for x in names if x != n]) - all_int8
        steps_done.step()
    ranked = sorted(names, key=lambda n: (-gain[n], names.index(n)))
    steps.append({"step": "sensitivity", "gain": {n: gain[n] for n in ranked}})
    kept: list[str] = []
    for n in ranked:
        kept.append(n)
        current = score([x for x in names if x not in kept])
        steps.append({"step": "keep in float", "node": n, "float_nodes": len(kept), "score": current})
        say(f"  kept {n} in float: {current:.5f}")
        if current >= target:
            break
    if current < target:
        return kept, steps
    for n in sorted(kept, key=lambda n: gain[n]):
        trial = [x for x in kept if x != n]
        s = score([x for x in names if x not in trial])
        if s >= target:
            kept, current = trial, s
            steps.append({"step": "back to int8", "node": n, "float_nodes": len(kept), "score": s})
            say(f"  {n} back to INT8: {s:.5f}")
    return kept, steps


# --------------------------------------------------------------------------- the stage


def quantize_model(recipe: Recipe, export: ExportResult, out_dir: Path | None = None,
                   progress: Callable[[str], None] | None = None, min_accuracy: float | None = None) -> QuantizeResult:
    """Produce the recipe's FP16/INT8 models from the FP32 export, score them and apply the gate.

    Writes ``model.fp16.onnx``, ``model.int8.onnx`` (as requested) and ``accuracy.json`` into ``out_dir``
    (default ``recipe.work_dir / "quantize"``) atomically. When a precision misses the gate the folder is
    still written (the report is the evidence) and :class:`AccuracyGateError` is raised.
    """
    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir or recipe.work_dir / "quantize")
    q = recipe.quantization
    gate = min_accuracy if min_accuracy is not None else q.min_accuracy
    if gate is not None and not 0 < gate <= 1:
        raise FactoryError(f"min_accuracy {gate} is outside (0, 1]. Fix: give a number such as 0.99")
    wanted = [p for p in recipe.precisions if p != "fp32"]
    models: dict[str, Path] = {"fp32": Path(export.onnx_path)}
    # The data is checked first: a missing file should not wait for a model load.
    split: DataSplit | None = split_data(q, need_calibration="int8" in wanted) if wanted else None
    base = check_onnx_file(Path(export.onnx_path))  # graph only: the weights stay in the export's data file
    base_dir = Path(export.onnx_path).parent
    ref_session = onnxruntime_session(export.onnx_path)
    output = primary_output(recipe.task, [o.name for o in ref_session.get_outputs()])
    if split is None:
        report = AccuracyReport(recipe.name, recipe.task, output, "", 0, "only fp32 requested: nothing to compare",
                                None, 0, None, 0, gate)
        with atomic_dir(out_dir) as tmp:
            report.write(tmp / REPORT_NAME)
        return QuantizeResult(models, report, out_dir / REPORT_NAME, (), None)

    encoder = InputEncoder(input_types(ref_session), export.tokenizer_dir, recipe.shapes.max_sequence_length)
    check_task_data(recipe.task, split)
    say(f"held-out: {split.note}")
    evaluator = Evaluator(ref_session, encoder.encode(split.heldout), recipe.task, output, split.heldout.groups())
    if recipe.task == "reranker" and evaluator.groups is not None and not any(
            evaluator.groups.count(g) > 1 for g in set(evaluator.groups)):
        raise FactoryError(f"quantization.heldout_data: no query in {split.heldout.source} has two passages, so the "
                           "ranking per query cannot be scored. Fix: give several passages per query in the held-out "
                           ".jsonl (one {\"query\": ..., \"passage\": ...} per line)")
    calib_feeds = search_eval = None
    if "int8" in wanted:
        assert split.calibration is not None
        calib_feeds = encoder.encode(split.calibration)
        if q.mixed_precision:
            groups = split.calibration.groups()
            n_search = SEARCH_SAMPLES_RERANKER if recipe.task == "reranker" else SEARCH_SAMPLES
            search_eval = Evaluator(ref_session, {k: v[:n_search] for k, v in calib_feeds.items()},
                                    evaluator.task, evaluator.output, None if groups is None else groups[:n_search])
    # Every FP32 output the scores need is computed: the reference session's weights can go.
    del ref_session
    release_memory()
    results: list[PrecisionAccuracy] = []
    float_nodes: tuple[str, ...] = ()
    search_steps: list[dict[str, Any]] = []
    calibration_digest = split.calibration.digest if split.calibration is not None and "int8" in wanted else None
    with atomic_dir(out_dir) as tmp:
        if "fp16" in wanted:
            say("converting to FP16")
            m16, converted = convert_fp16_graph(base)
            # FP16 weights are converted from the export's data file as they are written, never all in memory.
            onnx_files.save(m16, tmp / "model.fp16.onnx", base_dir=base_dir, consume=True, convert=converted)
            del m16
            release_memory()
            onnx_files.check(tmp / "model.fp16.onnx")
            results.append(evaluator.score(onnxruntime_session(tmp / "model.fp16.onnx"), "fp16"))
            release_memory()
            models["fp16"] = out_dir / "model.fp16.onnx"
        if "int8" in wanted:
            assert split.calibration is not None
            res, float_nodes, search_steps = _int8(recipe, base, Path(export.onnx_path), calib_feeds, search_eval,
                                                   evaluator, gate, tmp, say)
            results.append(res)
            models["int8"] = out_dir / "model.int8.onnx"
        report = AccuracyReport(
            model=recipe.name, task=recipe.task, output=output,
            heldout_source=str(split.heldout.source), heldout_samples=evaluator.samples, heldout_note=split.note,
            calibration_source=str(split.calibration.source) if split.calibration is not None else None,
            calibration_samples=len(split.calibration) if split.calibration is not None else 0,
            calibration_method=q.method if "int8" in wanted else None, overlap=split.overlap,
            min_accuracy=gate, results=tuple(results), search=tuple(search_steps))
        report.write(tmp / REPORT_NAME)
        (tmp / "quantize.json").write_text(json.dumps({
            "input_digest": digest_path(Path(export.onnx_path)), "calibration_digest": calibration_digest,
            "models": {p: path.name for p, path in models.items() if p != "fp32"},
            "float_nodes": list(float_nodes),
        }, indent=2) + "\n")
    report_path = out_dir / REPORT_NAME
    say("accuracy vs FP32: " + "; ".join(
        f"{r.precision} {r.metric} {r.score:.5f}" + "".join(f", {k} {v:.5f}" for k, v in r.extra)
        + (f" ({len(r.float_nodes)} of {r.candidates} kept in float)" if r.float_nodes else "")
        for r in report.results))
    check_gate(report, report_path, _departure_report(report, export.onnx_path, out_dir, evaluator.feeds))
    return QuantizeResult(models, report, report_path, float_nodes, calibration_digest)


def _departure_report(report: AccuracyReport, fp32: Path, out_dir: Path, feeds: Feeds) -> str:
    """For each precision below the gate: the layers where it first departs from FP32 (also written as JSON)."""
    if report.passed:
        return ""
    from model_factory.build_engines.divergence import first_departures, render_departures

    texts, table = [], {}
    for r in report.failures:
        try:
            found = first_departures(Path(fp32), out_dir / f"model.{r.precision}.onnx", feeds,
                                     float(report.min_accuracy or DEFAULT_THRESHOLD))
        except Exception as exc:  # a diagnosis: failing to make it must not hide the gate's verdict
            texts.append(f"{r.precision}: per-layer comparison failed ({type(exc).__name__}: {exc})")
            continue
        table[r.precision] = [d.to_dict() for d in found]
        texts.append(render_departures(r.precision, found))
    if table:
        (out_dir / DEPARTURES_NAME).write_text(json.dumps(table, indent=2) + "\n")
    return "\n".join(texts)


def check_task_data(task: str, split: DataSplit) -> None:
    """Refuse data of the wrong kind for the task: a reranker is calibrated and scored on (query, passage) pairs."""
    for what, samples in (("quantization.calibration_data", split.calibration),
                          ("quantization.heldout_data", split.heldout)):
        if samples is None or not samples.is_text:
            continue
        if task == "reranker" and not samples.is_pairs:
            raise FactoryError(f"{what}: a reranker scores (query, passage) pairs, but {samples.source.name} holds "
                               "single texts. Fix: give a .jsonl with one {\"query\": ..., \"passage\": ...} per "
                               "line")
        if task != "reranker" and samples.is_pairs:
            raise FactoryError(f"{what}: {samples.source.name} holds (query, passage) pairs, which only a reranker "
                               "reads. Fix: give single texts (.txt, or .jsonl with \"text\"), or set "
                               "model.task = \"reranker\"")


def _int8(recipe: Recipe, base: Any, fp32_path: Path, calib_feeds: Feeds, search_eval: Evaluator | None,
          evaluator: Evaluator, gate: float | None, tmp: Path,
          say: Callable[[str], None]) -> tuple[PrecisionAccuracy, tuple[str, ...], list[dict[str, Any]]]:
    q = recipe.quantization
    onnx = require("onnx", "onnx")
    model = onnx.ModelProto()
    model.CopyFrom(base)
    _node_names(model)
    candidates, skipped = find_candidates(model)
    if not candidates:
        raise FactoryError("the model has no MatMul/Gemm/Conv that INT8 can quantize. Fix: drop int8 from the "
                           "recipe's precisions")
    n = sample_count(calib_feeds)
    base_dir = fp32_path.parent
    with tempfile.TemporaryDirectory(prefix=".calibrate-", dir=tmp) as work_s:  # gone before tmp is committed
        work = Path(work_s)
        # Working models (calibration outputs, the search's switchable model) are graph files in `work`
        # whose float weights stay in the export's data file, linked beside them: never copied.
        if onnx_files.data_file(fp32_path).is_file():
            onnx_files.hardlink_or_copy(onnx_files.data_file(fp32_path), work / onnx_files.data_file(fp32_path).name)
        t0 = time.perf_counter()
        say(f"calibrating {len(candidates)} nodes on {n} samples ({q.method})")
        amax = calibrate(model, [a for c in candidates for a in c.activations], calib_feeds, q.method, work, say)
        say(f"calibrated in {time.perf_counter() - t0:.1f}s")
        release_memory()
        builder = QdqBuilder(model, candidates, amax, base_dir)
        names = [c.node for c in candidates]
        kept: list[str] = []
        steps: list[dict[str, Any]] = []
        if q.mixed_precision:
            assert search_eval is not None
            target = search_target(gate if gate is not None else DEFAULT_THRESHOLD)
            scorer = SwitchScorer(builder, search_eval, work)
            kept, steps = search_mixed_precision(names, scorer, target, say)
            steps.insert(0, {"step": "search", "gate": gate, "target": target, "scored_on":
                             f"first {search_eval.samples} calibration samples (Q/DQ simulated in float)",
                             "evaluations": scorer.calls})
            del scorer
            release_memory()
        final = builder.build([x for x in names if x not in kept])
        del builder
    path = tmp / "model.int8.onnx"
    # The float weights INT8 keeps stream from the export's data file; the INT8 ones from memory.
    onnx_files.save(final, path, base_dir=base_dir, consume=True)
    del final
    release_memory()
    onnx_files.check(path)
    res = evaluator.score(ort_session(path, simulate_qdq=True), "int8")
    release_memory()
    res = dataclasses.replace(res, float_nodes=tuple(kept), int8_nodes=len(names) - len(kept), candidates=len(names))
    if skipped:
        steps.insert(0, {"step": "not candidates", "nodes": skipped})
    return res, tuple(kept), steps


def load_export(recipe: Recipe) -> ExportResult:
    """The export stage's result as it lies in ``recipe.work_dir / "export"`` (for stand-alone commands)."""
    export_dir = recipe.work_dir / "export"
    onnx_path, info_path = export_dir / "model.onnx", export_dir / "export.json"
    if not onnx_path.is_file() or not info_path.is_file():
        raise FactoryError(f"{onnx_path} (with export.json) is missing. Fix: run model-factory export on the "
                           "recipe first")
    try:
        info = json.loads(info_path.read_text())
        tok = export_dir / "tokenizer"
        return ExportResult(onnx_path, float(info["max_abs_error"]), float(info["tolerance"]),
                            tok if tok.is_dir() else None, str(info["source_digest"]), int(info["opset"]),
                            tuple(info["inputs"]), tuple(info["outputs"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise FactoryError(f"{info_path} is unreadable ({exc}). Fix: run model-factory export again") from exc


def quantize_existing(recipe: Recipe, min_accuracy: float | None = None,
                      progress: Callable[[str], None] | None = None) -> QuantizeResult:
    """``model-factory quantize``: quantize the export already in the recipe's work dir."""
    return quantize_model(recipe, load_export(recipe), progress=progress, min_accuracy=min_accuracy)


def quantized_models(recipe: Recipe) -> dict[str, Path]:
    """The recipe's models as earlier stages left them in its work dir; refuses models that failed the gate."""
    export_onnx = recipe.work_dir / "export" / "model.onnx"
    if not export_onnx.is_file():
        raise FactoryError(f"{export_onnx} is missing. Fix: run model-factory export on the recipe first")
    models = {"fp32": export_onnx}
    quant_dir = recipe.work_dir / "quantize"
    wanted = [p for p in recipe.precisions if p != "fp32"]
    if not wanted:
        return models
    report_path = quant_dir / REPORT_NAME
    if not report_path.is_file():
        raise FactoryError(f"{report_path} is missing. Fix: run model-factory quantize on the recipe first")
    report = AccuracyReport.read(report_path)
    failed = {r.precision for r in report.failures}
    for p in wanted:
        path = quant_dir / f"model.{p}.onnx"
        if not path.is_file():
            raise FactoryError(f"{path} is missing. Fix: run model-factory quantize on the recipe first")
        if p in failed:
            raise FactoryError(f"the {p} model failed the accuracy gate ({report_path}). Fix: see the report, "
                               "change the quantization settings and run model-factory quantize again")
        models[p] = path
    return models
