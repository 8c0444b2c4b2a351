"""INT8 MatMuls on the factory's own ONNX Runtime operators (``kernels/int8_matmul.cc``), for a CPU instance.

An INT8 dynamic graph (``build_engines/lm_quantize.dynamic_int8``) writes each projection and the LM head as
DynamicQuantizeLinear, then MatMulInteger on the 7-bit weight, a Cast and a Mul by the activation's scale times the
weight's; ONNX Runtime fuses those into MatMulIntegerToFloat, whose kernels read the weights well below memory speed at
the few rows a decode step has (Gemma 3 270M's 262,144-column LM head is a third of a step). And the form of a MatMul
that the gate ladder keeps in integers with a scale per row and per group of inputs (``build_engines/row_int8.py``:
Gemma's ``down_proj``) is about 24 standard nodes a layer whose fixed costs, not the arithmetic, were a quarter of a
step. Two operators compute the same things:

- ``Int8MatMulToFloat``: MatMulInteger -> Cast -> Mul in one node, bit for bit (the same int32 products, the same
  float conversion and product by the same scale);
- ``RowInt8MatMul``: the grouped per-row form in one node (the rows quantized with the same float division and
  round-half-to-even, the groups' parts summed in the same order: equal within float rounding).

Both multiply with the CPU's integer dot products (AVX-512 VNNI, or AVX2: 7-bit weights keep its u8 x s8 pairs
within int16), the weight repacked at load in tiles of 32 columns, each tile's inputs in order, so a task streams its
columns; where the CPU has Intel AMX (and the compiler and Linux allow it) from 2 rows as AMX tile products over the
same packed weight, the same exact integer sums (:func:`tile_rows` says whether; docs/generation.md, "AMX tiles").
As for the INT8-cache attention (``int8_attention``): the packaged graph keeps the standard ops (what was
gated and signed, what any ONNX Runtime runs); at load :func:`rewrite` replaces what it recognises in memory, and the
library is compiled on the host by ``int8_attention.library``'s rules (the same cache, compiler and ownership checks).
Where it cannot be used the graph runs as packaged and the reason is logged (``int8_matmul = "kernel"``: the load fails
instead). A MatMul whose weight is not 7-bit, whose columns are not whole tiles, or whose nodes are not as described
keeps its standard ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .int8_attention import KernelUnavailable, _cpu_flags, library

SOURCE = Path(__file__).resolve().parent / "kernels" / "int8_matmul.cc"
LIBRARY_NAME = "libmf_int8_matmul.so"
DOMAIN = "ai.model_factory.int8_matmul"
OP_TYPE = "RowInt8MatMul"
TO_FLOAT = "Int8MatMulToFloat"
WEIGHT_MAX = 64  # 7-bit weights: AVX2's vpmaddubsw pairs stay within int16
TILE = 32  # the operator's columns a task (kTile): a MatMul whose N it does not divide keeps its standard ops
# The names build_engines/row_int8.py gives a grouped form (``<prefix>`` = the MatMul's scope + "/row_int8"): its
# nodes ``<prefix>/<name>``, its weights ``<prefix>.weight_q.<i>`` and ``<prefix>.weight_scale``, its reshape
# ``<prefix>.groups`` ([0, 0, groups, group]).
SUM, RESHAPE, SPLIT = "/Sum", "/Reshape", "/Split"
_FIXED_NODES = ("Reshape", "Abs", "ReduceMax", "Max", "Scale", "Div", "Round", "Shift", "CastU8", "Split", "Concat",
                "CastF", "ColScale", "RowScale", "Sum")


@dataclass(frozen=True)
class Prepared:
    """A graph with its INT8 MatMuls on the operators: its bytes, the library to register, how many grouped per-row
    forms and how many MatMulInteger chains it replaced."""

    model: bytes
    library: Path
    nodes: int
    chains: int = 0
    tile_rows: int = 0  # from this many rows the products are AMX tile products (0: never here: tile_rows())


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


def rewrite(model: Any, weights_folder: Path | None = None, chains: bool = True) -> tuple[int, int]:
    """Both rewrites on ``model`` (an ``onnx.ModelProto`` edited in place; its external weights in ``weights_folder``):
    ``(grouped per-row forms, MatMulInteger chains)`` replaced; ``chains`` False leaves the chains to ONNX Runtime."""
    return rewrite_rows(model, weights_folder), rewrite_chains(model, weights_folder) if chains else 0


def vnni() -> bool:
    """Whether this CPU multiplies u8 x s8 with integer dot products (AVX-512 VNNI or AVX-VNNI). Without, the chains stay
    on ONNX Runtime's kernels: on AVX2's vpmaddubsw the operator computes a 32-row LM head about 3.8x slower than
    with VNNI (a single-thread harness, 2026-12-06), and ONNX Runtime's kernel was not measured against it there."""
    flags = _cpu_flags().split()
    return "avx512_vnni" in flags or "avx_vnni" in flags


def rewrite_rows(model: Any, weights_folder: Path | None = None) -> int:
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
                or weight_q.shape[1] % TILE or int(np.abs(weight_q.astype(np.int16)).max()) > WEIGHT_MAX:
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


def rewrite_chains(model: Any, weights_folder: Path | None = None) -> int:
    """Replace every ``MatMulInteger(A, W, a_zero, [0]) -> Cast(float) -> Mul(scale)`` of ``model`` whose ``A`` comes
    from a DynamicQuantizeLinear and whose ``W`` is a 7-bit int8 initializer of whole tiles of columns by one
    ``Int8MatMulToFloat``; returns how many."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    replaced: dict[int, Any] = {}  # id of the Mul -> the operator's node
    dropped: set[int] = set()
    dropped_inits: set[str] = set()
    zero_name = "int8_matmul.zero_u8"
    needs_zero = False
    for n in graph.node:
        if n.op_type != "MatMulInteger" or n.domain not in ("", "ai.onnx"):
            continue
        ins = list(n.input) + [""] * (4 - len(n.input))
        a, w_name, a_zero, w_zero = ins[:4]
        producer = producers.get(a)
        if producer is None or producer.op_type != "DynamicQuantizeLinear" or producer.output[0] != a:
            continue
        w_init = inits.get(w_name)
        if w_init is None or w_init.data_type != TensorProto.INT8 or len(w_init.dims) != 2:
            continue
        k, cols = (int(d) for d in w_init.dims)
        if k % 4 or cols % TILE:
            continue
        if w_zero and (w_zero not in inits or np.any(_array(inits[w_zero], weights_folder) != 0)):
            continue
        cast = consumers.get(n.output[0], [])
        if len(cast) != 1 or cast[0].op_type != "Cast" or n.output[0] in outputs:
            continue
        cast = cast[0]
        to = next((helper.get_attribute_value(x) for x in cast.attribute if x.name == "to"), None)
        mul = consumers.get(cast.output[0], [])
        if to != TensorProto.FLOAT or len(mul) != 1 or mul[0].op_type != "Mul" or cast.output[0] in outputs:
            continue
        mul = mul[0]
        scale = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
        weight = _array(w_init, weights_folder)
        if int(np.abs(weight.astype(np.int16)).max()) > WEIGHT_MAX:
            continue
        packed, sums = pack(weight, k)
        p = n.name or w_name
        graph.initializer.extend([numpy_helper.from_array(packed, f"{p}.kernel_weight"),
                                  numpy_helper.from_array(sums, f"{p}.kernel_colsum")])
        if not a_zero:
            needs_zero = True
        replaced[id(mul)] = helper.make_node(
            TO_FLOAT, [a, a_zero or zero_name, f"{p}.kernel_weight", f"{p}.kernel_colsum", scale], [mul.output[0]],
            name=p, domain=DOMAIN)
        dropped.update((id(n), id(cast)))
        dropped_inits.update([w_name] + ([w_zero] if w_zero else []))
    if not replaced:
        return 0
    kept = [replaced.get(id(n), n) for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    used = {i for n in graph.node for i in n.input}
    for t in [t for t in graph.initializer if t.name in dropped_inits and t.name not in used]:
        graph.initializer.remove(t)
    if needs_zero:
        graph.initializer.append(numpy_helper.from_array(np.asarray(0, np.uint8), zero_name))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(replaced)


def prepare(source: Path | bytes, weights_folder: Path | None = None) -> Prepared | None:
    """``source`` (the graph's bytes, or its path) with its INT8 MatMuls on the operators and the library compiled
    for this host; None where the graph has none the operators take. :class:`KernelUnavailable` says why they cannot
    be used."""
    try:
        import onnx
    except ImportError as e:
        raise KernelUnavailable("the onnx package is not installed (pip install 'model-factory[serve]')") from e
    if isinstance(source, (bytes, bytearray)):
        model = onnx.load_from_string(bytes(source))
    else:
        model = onnx.load(str(source), load_external_data=False)
        weights_folder = weights_folder or Path(source).resolve().parent
    if not any(n.op_type == "MatMulInteger" for n in model.graph.node):
        return None
    lib = library(SOURCE, name=LIBRARY_NAME)
    rows, chains = rewrite(model, weights_folder, chains=vnni())
    if not rows and not chains:
        return None
    return Prepared(model.SerializeToString(), lib, rows, chains, tile_rows(lib))


def tile_rows(lib: Path) -> int:
    """The fewest rows the compiled library multiplies on AMX tiles in this process (compiled with them where
    ``-march=native`` has them, and granted the tile state by the kernel); 0 where it does not."""
    import ctypes

    try:
        return int(ctypes.CDLL(str(lib)).MfInt8MatMulTileRows())
    except (OSError, AttributeError):  # a library without the symbol, or one that does not load here
        return 0
