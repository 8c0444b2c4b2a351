"""The grouped per-row INT8 MatMul in one node: the factory's second custom operator for ONNX Runtime's CPU provider.

INT8 dynamic's gate ladder can keep a MatMul in integers with a scale per row and per group of its inputs
(``build_engines/row_int8.py``; on Gemma 3 270M the step that keeps ``down_proj`` in integers). The packaged graph
writes that in standard ops: per MatMul a Reshape, the row's quantization in seven nodes, a Split, one MatMulInteger
per group, then a Concat, a Cast, two Muls and a ReduceSum. Each node's fixed cost, not the arithmetic, made Gemma's
18 ``down_proj`` a quarter of a decode step (RESULTS.md "decode_profile"). ``kernels/row_int8_matmul.cc`` computes
the same thing in one pass: the rows quantized as those nodes do, the products with the CPU's integer dot products
(AVX-512 VNNI, or AVX2), the scales applied per group and summed in order.

As for the INT8-cache attention (``int8_attention``): the packaged graph keeps the standard ops (what was gated and
signed, what any ONNX Runtime runs); at load, on a CPU instance, :func:`rewrite` replaces each grouped form in memory
by the operator, its weight repacked four inputs a column together, and the library is compiled on the host by
``int8_attention.library``'s rules (the same cache, compiler and ownership checks). Where it cannot be used the graph
runs as packaged and the reason is logged (``int8_matmul = "kernel"``: the load fails instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .int8_attention import KernelUnavailable, library

SOURCE = Path(__file__).resolve().parent / "kernels" / "row_int8_matmul.cc"
LIBRARY_NAME = "libmf_row_int8_matmul.so"
DOMAIN = "ai.model_factory.row_int8"
OP_TYPE = "RowInt8MatMul"
TILE = 32  # the operator's columns a task (kTile): a MatMul whose N it does not divide keeps its standard ops
# The names build_engines/row_int8.py gives a grouped form (``<prefix>`` = the MatMul's scope + "/row_int8"): its
# nodes ``<prefix>/<name>``, its weights ``<prefix>.weight_q.<i>`` and ``<prefix>.weight_scale``, its reshape
# ``<prefix>.groups`` ([0, 0, groups, group]).
SUM, RESHAPE, SPLIT = "/Sum", "/Reshape", "/Split"
_FIXED_NODES = ("Reshape", "Abs", "ReduceMax", "Max", "Scale", "Div", "Round", "Shift", "CastU8", "Split", "Concat",
                "CastF", "ColScale", "RowScale", "Sum")


@dataclass(frozen=True)
class Prepared:
    """A graph with its grouped forms on the operator: its bytes, the library to register, how many it replaced."""

    model: bytes
    library: Path
    nodes: int


def pack(weight_q: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """The operator's weight and column sums from the 7-bit weight ``[K, N]`` (N a multiple of :data:`TILE`):
    ``[N / TILE, K / 4, TILE, 4]`` (tiles of columns, each tile's inputs in order, four consecutive inputs of a column
    together as one integer dot product reads them) and each group's sum per column ``[K / group, N]`` (int32)."""
    k, n = weight_q.shape
    packed = np.ascontiguousarray(weight_q.reshape(k // 4, 4, n // TILE, TILE).transpose(2, 0, 3, 1))
    sums = weight_q.astype(np.int32).reshape(k // group, group, n).sum(axis=1, dtype=np.int32)
    return packed, sums


def _array(tensor: Any, folder: Path | None) -> np.ndarray:
    """An initializer's values, its bytes read from the graph's external data file where it keeps them there (the
    file the loader verified against the version's digests; read directly because a served version's weight files
    may be hard links, which onnx's own reader refuses)."""
    from onnx import TensorProto, helper, numpy_helper

    if tensor.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    where = {e.key: e.value for e in tensor.external_data}
    location = where.get("location", "")
    if folder is None or not location or Path(location).name != location:
        raise KernelUnavailable(f"{tensor.name}'s weights are outside the graph's folder ({location!r})")
    offset, length = int(where.get("offset", 0)), int(where.get("length", -1))
    with open(Path(folder) / location, "rb") as f:
        f.seek(offset)
        raw = f.read(length) if length >= 0 else f.read()
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.frombuffer(raw, dtype=dtype).reshape(tuple(tensor.dims)).copy()


def rewrite(model: Any, weights_folder: Path | None = None) -> int:
    """Replace every grouped per-row form of ``model`` (an ``onnx.ModelProto`` whose external weights, if any, lie in
    ``weights_folder``; edited in place) by the operator; returns how many. A form whose nodes are not all as
    ``row_int8.py`` writes them is left as it is."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    by_name = {n.name: n for n in graph.node}
    prefixes = [n.name[: -len(SUM)] for n in graph.node if n.op_type == "ReduceSum" and n.name.endswith("/row_int8" + SUM)]
    replaced: dict[str, Any] = {}  # the Sum node's name -> the operator's node
    dropped_nodes: set[str] = set()
    dropped_inits: set[str] = set()
    for p in prefixes:
        shape = inits.get(f"{p}.groups")
        reshape, split, total = by_name.get(p + RESHAPE), by_name.get(p + SPLIT), by_name.get(p + SUM)
        if shape is None or reshape is None or split is None or total is None:
            continue
        _, _, groups, group = (int(v) for v in numpy_helper.to_array(shape))
        names = [f"{p}/{m}" for m in _FIXED_NODES] + [f"{p}/MatMulInteger{i}" for i in range(groups)]
        weights = [f"{p}.weight_q.{i}" for i in range(groups)]
        if group % 4 or any(m not in by_name for m in names) or any(w not in inits for w in weights) \
                or f"{p}.weight_scale" not in inits:
            continue
        weight_q = np.concatenate([_array(inits[w], weights_folder) for w in weights], axis=0).astype(np.int8)
        scales = _array(inits[f"{p}.weight_scale"], weights_folder).astype(np.float32)
        if weight_q.shape[0] != groups * group or scales.shape != (groups, weight_q.shape[1]) \
                or weight_q.shape[1] % TILE:
            continue
        packed, sums = pack(weight_q, group)
        graph.initializer.extend([numpy_helper.from_array(packed, f"{p}.kernel_weight"),
                                  numpy_helper.from_array(sums, f"{p}.kernel_colsum"),
                                  numpy_helper.from_array(scales, f"{p}.kernel_scale")])
        replaced[total.name] = helper.make_node(
            OP_TYPE, [reshape.input[0], f"{p}.kernel_weight", f"{p}.kernel_colsum", f"{p}.kernel_scale"],
            [total.output[0]], name=p, domain=DOMAIN, group=group)
        dropped_nodes.update(names)
        dropped_inits.update([*weights, f"{p}.weight_scale", f"{p}.groups"])
    if not replaced:
        return 0
    kept = []
    for node in graph.node:
        if node.name in replaced:
            kept.append(replaced[node.name])
        elif node.name not in dropped_nodes:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    used = {i for n in graph.node for i in n.input}
    for t in [t for t in graph.initializer if t.name in dropped_inits or (t.name.startswith("row_int8.")
                                                                          and t.name not in used)]:
        graph.initializer.remove(t)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(replaced)


def has_grouped_form(model: Any) -> bool:
    """Whether ``model`` holds a grouped per-row form (the operator has something to replace)."""
    return any(n.op_type == "ReduceSum" and n.name.endswith("/row_int8" + SUM) for n in model.graph.node)


def prepare(source: Path | bytes, weights_folder: Path | None = None) -> Prepared | None:
    """``source`` (the graph's bytes, or its path) with its grouped forms on the operator and the library compiled for
    this host; None where the graph has none. :class:`KernelUnavailable` says why it cannot be used."""
    try:
        import onnx
    except ImportError as e:
        raise KernelUnavailable("the onnx package is not installed (pip install 'model-factory[serve]')") from e
    if isinstance(source, (bytes, bytearray)):
        model = onnx.load_from_string(bytes(source))
    else:
        model = onnx.load(str(source), load_external_data=False)
        weights_folder = weights_folder or Path(source).resolve().parent
    if not has_grouped_form(model):
        return None
    lib = library(SOURCE, name=LIBRARY_NAME)
    count = rewrite(model, weights_folder)
    if not count:
        raise KernelUnavailable("the graph's per-row INT8 MatMuls are not in the form row_int8.py writes")
    return Prepared(model.SerializeToString(), lib, count)
