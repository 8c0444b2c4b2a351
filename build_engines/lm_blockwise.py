"""Block-wise INT4 / INT8 weights written by the factory: ``MatMulNBits`` with a zero point and a searched scale per
block, the layers llama.cpp's Q4_K_M keeps wider at 8 bits, and the embedding an 8-bit table.

The model builder rounds each block of a MatMul's weights to nearest, symmetrically (``scale = max |w| / 7``): one
large weight sets the step of the whole block, and the block's other values use fewer of the 16 levels. llama.cpp's
K-quants fit each block instead (``make_qkx2_quants`` / ``make_qkx3_quants``): an offset (here the zero point) and a
scale chosen among candidates around ``(max - min) / 15``, each refitted by weighted least squares on the levels it
gives, the best kept; with an importance matrix the weights of that fit are how strongly the calibration text drives
each input channel. :func:`quantize_blocks` does that per block: ``importance`` is the mean square of the MatMul's
input activation per input channel (:func:`activation_importance`, read from the FP32 graph itself on the calibration
text), so the error minimised is the output's (``E[(Σ_k Δw_k x_k)²] ≈ Σ_k Δw_k² E[x_k²]``), not the weights'.
Without it the weights are qkx2's (``rms(block) + |w|``). It runs after AWQ's scaling (:mod:`build_engines.awq`) when
the recipe asks for both: AWQ moves which columns are rounded coarsely, this fits the rounding of each block.

Which MatMuls are wider is the builder's selectors (``last_matmul``, ``mixed_layers``: :func:`wide_nodes`), the
layers llama.cpp's ``use_more_bits`` picks (the first and last eighth, every third between). The embedding (a
``Gather`` of the float table, or of the tied LM head's transpose) becomes a ``GatherBlockQuantized`` of 8 bits,
the LM head's own bytes when that head is at 8 bits (llama.cpp keeps ``token_embd`` at Q8_0 / Q6_K in Q4_K_M).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from model_factory.errors import FactoryError

GPTQ = True  # the ladder's INT4 with GPTQ's error feedback over the searched blocks
STEPS = 16  # candidate scales per block (llama.cpp's make_qkx2_quants tries 20 around (max - min) / 15)
CHUNK_ROWS = 4096  # weight rows fitted at once (bounds the search's temporaries)
EMBED_BITS = 8


def _levels(bits: int) -> int:
    return 2 ** bits - 1


def quantize_blocks(w: np.ndarray, bits: int, block: int, symmetric: bool = False,
                    importance: np.ndarray | None = None, steps: int = STEPS,
                    hessian: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``w`` ``[N, K]`` (MatMulNBits' layout: a row per output, blocks along K) to unsigned ``bits``-bit levels.

    Returns (levels ``uint8 [N, nb * block]`` (K padded with zeros to whole blocks), scales ``float32 [N, nb]``, zero
    points ``uint8 [N, nb]``) with ``w ≈ (levels - zero_point) * scale``. Symmetric: the zero point is
    ``2 ** (bits - 1)`` (MatMulNBits' default) and only the scale is searched. ``importance`` ``[K]``: per input
    channel, how much its error costs (the activations' mean square); ``steps`` 0 is plain round to nearest.
    ``hessian`` ``[K, K]`` (the activations' ``E[x xᵀ]``): GPTQ's error feedback (:func:`_gptq`) on top."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    nb = -(-k // block)
    pad = nb * block - k
    if pad:
        w = np.pad(w, ((0, 0), (0, pad)))
    imp = None
    if importance is not None:
        imp = np.pad(np.asarray(importance, np.float32), (0, pad)).reshape(1, nb, block)
        imp = np.maximum(imp, 1e-12 * max(float(imp.max()), 1e-30))
    if hessian is not None:
        return _gptq(w, np.pad(np.asarray(hessian, np.float64), ((0, pad), (0, pad))), bits, block, imp, symmetric,
                     steps)
    q = np.empty((n, nb * block), np.uint8)
    scales = np.empty((n, nb), np.float32)
    zeros = np.empty((n, nb), np.uint8)
    for start in range(0, n, CHUNK_ROWS):
        rows = w[start:start + CHUNK_ROWS].reshape(-1, nb, block)
        cq, cs, cz = _fit(rows, bits, imp, symmetric, steps)
        q[start:start + CHUNK_ROWS] = cq.reshape(len(rows), -1)
        scales[start:start + CHUNK_ROWS], zeros[start:start + CHUNK_ROWS] = cs, cz
    return q, scales, zeros


def _gptq(w: np.ndarray, h: np.ndarray, bits: int, block: int, imp: np.ndarray | None, symmetric: bool, steps: int,
          damp: float = 0.01) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ (Frantar et al. 2022) over the padded ``w`` ``[N, K]``: columns rounded in order, each one's error
    spread over the columns not yet rounded through the inverse of ``h`` (its Cholesky factor), so that the output's
    error on the calibration activations, not each weight's, is what is minimised. A block's scale and zero point are
    fitted (:func:`_fit`) on its columns as the earlier blocks' errors left them."""
    n, k = w.shape
    nb, top = k // block, _levels(bits)
    w = w.astype(np.float64).copy()
    h = h.copy()
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    try:
        hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: row i holds column i's feedback onto those after it
    except np.linalg.LinAlgError:
        return quantize_blocks(w.astype(np.float32), bits, block, symmetric, None if imp is None else imp.ravel(), steps)
    q = np.empty((n, k), np.uint8)
    scales = np.empty((n, nb), np.float32)
    zeros = np.empty((n, nb), np.uint8)
    for b in range(nb):
        lo, hi = b * block, (b + 1) * block
        _q, d, z = _fit(w[:, None, lo:hi].astype(np.float32), bits, None if imp is None else imp[:, b:b + 1], symmetric,
                        steps)
        d, z = d[:, 0].astype(np.float64), z[:, 0].astype(np.float64)
        scales[:, b], zeros[:, b] = d, z
        err = np.empty((n, block))
        for i in range(lo, hi):
            col = np.clip(np.rint(w[:, i] / d) + z, 0, top)
            q[:, i] = col
            e = (w[:, i] - (col - z) * d) / hinv[i, i]
            w[:, i:hi] -= np.outer(e, hinv[i, i:hi])
            err[:, i - lo] = e
        w[:, hi:] -= err @ hinv[lo:hi, hi:]
    return q, scales, zeros


def _round(x: np.ndarray, d: np.ndarray, zp: np.ndarray, top: int) -> np.ndarray:
    return np.clip(np.rint(x / d[..., None]) + zp[..., None], 0, top)


def _fit(x: np.ndarray, bits: int, imp: np.ndarray | None, symmetric: bool, steps: int):
    """The search on blocks ``x`` ``[rows, nb, block]``: (levels, scales, zero points) minimising the weighted error."""
    top = _levels(bits)
    if imp is None:  # llama.cpp's make_qkx2_quants weights: rms of the block + |w|
        m = np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) + np.abs(x)
    else:
        m = np.broadcast_to(imp, x.shape)
    lo, hi = np.minimum(x.min(axis=-1), 0.0), np.maximum(x.max(axis=-1), 0.0)
    if symmetric:
        mid = 2 ** (bits - 1)
        amax = np.maximum(np.abs(lo), hi)
        amax = np.where(amax > 0, amax, 1.0)
        zp = np.full(amax.shape, mid, np.float32)
        candidates = [amax / (mid - 1)] + [amax / (mid - 1.5 + 0.25 * i) for i in range(steps)]
    else:
        span = np.where(hi > lo, hi - lo, 1.0)
        candidates = [span / top] + [span / (top - 1 + 0.15 * i) for i in range(steps)]
    best_err = best_d = best_zp = None
    for d in candidates if steps else candidates[:1]:
        z = zp if symmetric else np.clip(np.rint(-lo / d), 0, top)
        lv = _round(x, d, z, top) - z[..., None]
        if steps:  # refit the scale by weighted least squares on these levels (the zero point fixed)
            num, den = np.sum(m * x * lv, axis=-1), np.sum(m * lv * lv, axis=-1)
            d = np.where(den > 0, num / np.where(den > 0, den, 1.0), d)
            d = np.where(d > 0, d, candidates[0])
            if not symmetric:
                z = np.clip(np.rint(-lo / d), 0, top)
            lv = _round(x, d, z, top) - z[..., None]
        err = np.sum(m * (lv * d[..., None] - x) ** 2, axis=-1)
        if best_err is None:
            best_err, best_d, best_zp = err, d, z
        else:
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_d, best_zp = np.where(better, d, best_d), np.where(better, z, best_zp)
    levels = _round(x, best_d, best_zp, top).astype(np.uint8)
    return levels, best_d.astype(np.float32), best_zp.astype(np.uint8)


def dequantize_blocks(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, block: int, k: int) -> np.ndarray:
    """The float ``[N, K]`` that MatMulNBits computes with."""
    n, nb = scales.shape
    lv = q.reshape(n, nb, block).astype(np.float32) - zeros[..., None].astype(np.float32)
    return (lv * scales[..., None]).reshape(n, -1)[:, :k]


def pack(q: np.ndarray, zeros: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' B ``uint8 [N, nb, block * bits / 8]`` and packed zero points ``uint8 [N, ceil(nb * bits / 8)]``:
    4-bit values two a byte, the first in the low nibble."""
    n, nb = zeros.shape
    if bits == 8:
        return q.reshape(n, nb, block), zeros
    if bits != 4:
        raise FactoryError(f"no {bits}-bit MatMulNBits packing here. Fix: use 4 or 8 bits")
    b = q.reshape(n, nb, block // 2, 2)
    packed = (b[..., 0] | (b[..., 1] << 4)).astype(np.uint8)
    z = zeros if nb % 2 == 0 else np.pad(zeros, ((0, 0), (0, 1)), constant_values=0)
    return packed, (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)


# --------------------------------------------------------------------------------------------- which MatMuls

LAYER = re.compile(r"/model/layers\.(\d+)/")
MIXED_PARTS = ("/attn/qkv_proj/", "/attn/v_proj/", "/mlp/down_proj/")


def more_bits_layers(num_layers: int) -> list[int]:
    """llama.cpp's ``use_more_bits(i, n)``, in its integer arithmetic: the first and last eighth of the layers and
    every third between, the layers whose attention v and MLP down Q4_K_M keeps wider (Gemma 3 270M's GGUF: v at
    Q8_0 and down at Q6_K in layers 0, 1, 4, 7, 10, 13, 15, 16, 17). The builder's ``mixed_layers`` divides in floats
    and picks 0, 1, 2, 4, 7, 10, 13, 16, 17 there."""
    eighth = num_layers // 8
    return [i for i in range(num_layers)
            if i < eighth or i >= 7 * num_layers // 8 or (i - eighth) % 3 == 2]


def wide_nodes(names: Sequence[str], selectors: Sequence[str], head: str | None) -> set[str]:
    """The MatMul nodes ``selectors`` (the builder's ``last_matmul:int8`` / ``mixed_layers:int8``) keep at 8 bits:
    ``head`` (the LM head's node) and, in :func:`more_bits_layers`, attention's qkv (v) and the MLP's down."""
    wide: set[str] = set()
    layers = {int(m.group(1)) for n in names if (m := LAYER.search(n))}
    num_layers = max(layers) + 1 if layers else 0
    chosen = set(more_bits_layers(num_layers))
    for sel in selectors:
        part, _, bits = sel.partition(":")
        if bits != "int8":
            raise FactoryError(f"selector {sel!r}: only int8 widens here. Fix: use last_matmul:int8 or mixed_layers:int8")
        if part == "last_matmul" and head is not None:
            wide.add(head)
        elif part == "mixed_layers":
            wide.update(n for n in names if (m := LAYER.search(n)) and int(m.group(1)) in chosen
                        and any(p in n for p in MIXED_PARTS))
        elif part != "last_matmul":
            raise FactoryError(f"unknown selector {sel!r}. Fix: use last_matmul:int8 or mixed_layers:int8")
    return wide


def _weight_matmuls(model: Any) -> dict[str, Any]:
    """Node name -> node of every MatMul whose second input is a 2-D float initializer ``[K, N]``."""
    from onnx import TensorProto

    inits = {t.name: t for t in model.graph.initializer}
    return {n.name: n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2 and inits[n.input[1]].data_type == TensorProto.FLOAT}


def _head_node(model: Any, matmuls: Mapping[str, Any]) -> str | None:
    outputs = {o.name for o in model.graph.output}
    return next((name for name, n in matmuls.items() if n.output[0] in outputs), None)


# ----------------------------------------------------------------------------------------- activation importance

def activation_importance(graph: Path, token_batches: Sequence[Sequence[int]], head_dim: int,
                          second_moments: bool = False) -> dict[str, np.ndarray]:
    """Per weight MatMul of ``graph`` (a shared-slot FP32 decoder), the mean square of its input per input channel
    over ``token_batches`` (the calibration text), read by running the graph with those inputs as extra outputs.
    ``second_moments``: the whole ``E[x xᵀ]`` ``[K, K]`` instead (GPTQ's Hessian; its diagonal is the importance),
    for the 4-bit MatMuls (an input wider than 4096 channels, the LM head's at 8 bits: the diagonal)."""
    import onnx

    from model_factory.backend.contract import ATTENTION_MASK, INPUT_IDS, LOGITS_POSITIONS, past_name
    from model_factory.build_engines.lm_graph import graph_shape
    from model_factory.build_engines.ort_session import onnxruntime_session

    graph = Path(graph)
    model = onnx.load(str(graph), load_external_data=False)
    matmuls = _weight_matmuls(model)
    inputs = sorted({n.input[0] for n in matmuls.values()})
    head = _head_node(model, matmuls)
    heads = {matmuls[head].input[0]} if head else set()
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
                              for t in inputs if t not in known)
    session = onnxruntime_session(model.SerializeToString(), data_folder=graph.parent)  # the graph's folder untouched
    del model
    sums: dict[str, np.ndarray] = {}
    count = 0
    shape = graph_shape(session, head_dim)
    names = {i.name for i in session.get_inputs()}
    for ids in token_batches:
        t = len(ids)
        feeds: dict[str, np.ndarray] = {INPUT_IDS: np.asarray([list(ids)], np.int64),
                                        ATTENTION_MASK: np.ones((1, t), np.int64)}
        if LOGITS_POSITIONS in names:
            feeds[LOGITS_POSITIONS] = np.asarray([list(range(t))], np.int64)
        kv = np.zeros((1, shape.num_kv_heads, t, shape.head_dim), shape.kv_dtype)
        for layer in range(shape.num_layers):
            for kind in ("key", "value"):
                feeds[past_name(layer, kind)] = kv
        for name, value in zip(inputs, session.run(inputs, feeds)):
            x = np.asarray(value, np.float64).reshape(-1, value.shape[-1])
            full = second_moments and name not in heads and x.shape[1] <= 4096
            sums[name] = sums.get(name, 0.0) + (x.T @ x if full else np.sum(x * x, axis=0))
        count += t
    means = {name: (total / max(count, 1)).astype(np.float32) for name, total in sums.items()}
    return {node: means[n.input[0]] for node, n in matmuls.items()}  # nodes reading one input share its array


# ----------------------------------------------------------------------------------------------- the graph

def blockwise_graph(fp32_graph: Path, out: Path, block: int, wide: Callable[[Sequence[str], str | None], set[str]],
                    symmetric: bool = False, importance: Mapping[str, np.ndarray] | None = None,
                    accuracy_level: int = 4, steps: int = STEPS,
                    say: Callable[[str], None] = lambda _m: None) -> tuple[Path, dict[str, Any]]:
    """Write ``out/model.onnx`` (+ ``.data``): ``fp32_graph``'s weight MatMuls as 4-bit MatMulNBits (8-bit for the
    nodes ``wide(names, head)`` returns), the embedding as an 8-bit GatherBlockQuantized. Returns the graph and what
    was done (bits per node kind, for the gate's report)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(fp32_graph))
    matmuls = _weight_matmuls(model)
    if not matmuls:
        raise FactoryError(f"{fp32_graph} has no MatMul with a 2-D float weight. Fix: pass the builder's FP32 graph")
    head = _head_node(model, matmuls)
    eight = wide(list(matmuls), head)
    inits = {t.name: t for t in model.graph.initializer}
    new_inits, replaced, head_q = [], {}, None
    for name, node in matmuls.items():
        wt = numpy_helper.to_array(inits[node.input[1]]).T  # [N, K]
        bits = 8 if name in eight else 4
        imp = importance.get(name) if importance else None
        hessian = imp if imp is not None and imp.ndim == 2 and bits == 4 else None
        imp = np.diag(imp) if imp is not None and imp.ndim == 2 else imp
        q, scales, zeros = quantize_blocks(wt, bits, block, symmetric, imp, steps if bits == 4 else 0, hessian)
        packed, zp = pack(q, zeros, bits, block)
        base = node.input[1]
        tensors = [numpy_helper.from_array(packed, f"{base}_Q{bits}"),
                   numpy_helper.from_array(scales, f"{base}_scales"),
                   numpy_helper.from_array(zp, f"{base}_zp")]
        new_inits += tensors
        n_out, k = wt.shape
        replaced[name] = helper.make_node(
            "MatMulNBits", [node.input[0]] + [t.name for t in tensors], list(node.output), name=f"{name}_Q{bits}",
            domain="com.microsoft", K=k, N=n_out, bits=bits, block_size=block, accuracy_level=accuracy_level)
        if name == head and bits == 8:
            head_q = (base, tensors)
        del wt, q
    nodes = [replaced.get(n.name, n) for n in model.graph.node]
    embedded = _embedding(model, nodes, inits, block, head_q, new_inits)
    del model.graph.node[:]
    model.graph.node.extend(n for n in nodes if n is not None)
    used = {x for n in model.graph.node for x in n.input}
    live = [t for t in list(model.graph.initializer) + new_inits if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(live)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    out.mkdir(parents=True, exist_ok=True)
    graph = out / "model.onnx"
    for f in (graph, out / "model.onnx.data"):
        f.unlink(missing_ok=True)
    onnx.save(model, str(graph), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    layout = {"method": ("symmetric" if symmetric else "asymmetric (zero points)")
                        + (f", scale searched per block ({steps} candidates, least squares"
                           + (", activation-weighted)" if importance else ", weights' magnitude)") if steps else
                           ", round to nearest")
                        + (", GPTQ error feedback" if importance and any(v.ndim == 2 for v in importance.values())
                           else ""),
              "block_size": block, "int4_matmuls": len(matmuls) - len(eight), "int8_matmuls": sorted(eight),
              "embedding": embedded}
    say(f"[quantize] blockwise: {layout['int4_matmuls']} MatMuls at 4 bits, {len(eight)} at 8, embedding {embedded}")
    return graph, layout


def _embedding(model: Any, nodes: list, inits: Mapping[str, Any], block: int, head_q: tuple | None,
               new_inits: list) -> str:
    """The token embedding's Gather (of a float ``[V, H]`` table, or of the tied LM head's ``Transpose``) rewritten in
    ``nodes`` as an 8-bit GatherBlockQuantized: the LM head's own bytes when it is at 8 bits and tied."""
    from onnx import helper, numpy_helper

    producers = {o: n for n in nodes for o in n.output}
    for i, node in enumerate(nodes):
        if node.op_type != "Gather" or node.input[1] != "input_ids":
            continue
        src, transpose = node.input[0], None
        if src not in inits and src in producers and producers[src].op_type == "Transpose":
            transpose = producers[src]
            src = transpose.input[0]
        if src not in inits or len(inits[src].dims) != 2:
            return "float"
        attrs = {"block_size": block, "bits": EMBED_BITS, "gather_axis": 0, "quantize_axis": 1}
        name = f"{node.name}_Q{EMBED_BITS}"
        if transpose is not None and head_q is not None and head_q[0] == src:
            packed, scales, zp = head_q[1]
            v, nb = list(scales.dims)
            shape = numpy_helper.from_array(np.asarray([v, -1], np.int64), f"{src}_Q8_table_shape")
            new_inits.append(shape)
            table = helper.make_node("Reshape", [packed.name, shape.name], [f"{src}_Q8_table"], name=f"{name}/Reshape")
            nodes[i] = helper.make_node("GatherBlockQuantized", [table.output[0], "input_ids", scales.name, zp.name],
                                        list(node.output), name=name, domain="com.microsoft", **attrs)
            nodes.insert(i, table)
            how = "8 bits, the LM head's table"
        else:
            w = numpy_helper.to_array(inits[src])
            w = w.T if transpose is not None else w  # [V, H]
            q, scales, zeros = quantize_blocks(w, EMBED_BITS, block, steps=0)
            v, h = w.shape
            tensors = [numpy_helper.from_array(q[:, :h].copy() if q.shape[1] != h else q, f"{src}_embed_Q8"),
                       numpy_helper.from_array(scales, f"{src}_embed_scales"),
                       numpy_helper.from_array(zeros, f"{src}_embed_zp")]
            if q.shape[1] != h:
                raise FactoryError(f"the embedding's width {h} is not a multiple of block {block}. "
                                   "Fix: choose an int4_block_size that divides the hidden size")
            new_inits.extend(tensors)
            nodes[i] = helper.make_node("GatherBlockQuantized", ["", "input_ids", "", ""], list(node.output),
                                        name=name, domain="com.microsoft", **attrs)
            nodes[i].input[:] = [tensors[0].name, "input_ids", tensors[1].name, tensors[2].name]
            how = "8 bits"
        if transpose is not None and not any(transpose.output[0] in n.input for n in nodes if n is not nodes[i]
                                             and n is not transpose):
            nodes[nodes.index(transpose)] = None
        return how
    return "float"


@dataclass(frozen=True)
class BlockwiseInput:
    """What every step of INT4's ladder is written from: the FP32 graph of the (AWQ-scaled) source and its
    activations' importance on the calibration text, made once (a step only refits the blocks)."""

    fp32: Path
    importance: Mapping[str, np.ndarray] | None  # per node: [K] (mean squares) or [K, K] (E[x xᵀ]: GPTQ)

    @classmethod
    def prepare(cls, source: Path, original: Path, export_graph: Path, work: Path, token_batches: Sequence[Sequence[int]],
                head_dim: int, say: Callable[[str], None] = lambda _m: None, gptq: bool = GPTQ) -> "BlockwiseInput":
        """The export's own FP32 graph when ``source`` is the original folder, else the builder's FP32 graph of
        ``source`` (AWQ's scaled copy) in ``work``."""
        if Path(source) == Path(original):
            fp32 = Path(export_graph)
        else:
            from model_factory.build_engines.causal_lm import run_builder

            fp32 = run_builder(Path(source), work, "fp32", None, say)
        importance = activation_importance(fp32, token_batches, head_dim, gptq) if token_batches else None
        if importance is not None:
            say(f"[quantize] int4: activation importance of {len(importance)} MatMuls from {len(token_batches)} "
                "calibration samples")
        return cls(fp32, importance)

    def write(self, out: Path, block: int, wider: Sequence[str],
              say: Callable[[str], None] = lambda _m: None) -> tuple[Path, dict[str, Any]]:
        """One ladder step: the MatMuls ``wider`` selects at 8 bits, the rest at 4."""
        return blockwise_graph(self.fp32, out, block, lambda names, head: wide_nodes(names, wider, head),
                               importance=self.importance, say=say)
