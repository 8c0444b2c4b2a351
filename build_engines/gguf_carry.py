"""Precision ``gguf``: the GGUF's own quantized blocks carried into the exported graph's MatMuls, not re-quantized.

The FP32 graph of a GGUF source (onnxruntime-genai's builder over the folder transformers dequantized) holds each
2-D weight as a MatMul initializer [K, N]: the GGUF tensor (N rows of K) transposed, several tensors side by side
where the builder packs them (``qkv_proj`` = attn_q | attn_k | attn_v, ``gate_up_proj``), the tied LM head the
embedding's table. Each such MatMul becomes a ``com.microsoft.MatMulNBits`` whose codes, scales and zero points are
the GGUF blocks' own (:mod:`build_engines.gguf_blocks`):

* 4 bits, block 32, when every part is Q4_0 (its integer zero point 8): exact; with ``float_zero_points`` also
  Q4_1 / Q4_K with a float zero point (ONNX Runtime's CPU kernel takes one at 4 bits): exact, but slow
  (:data:`FLOAT_ZERO_POINTS`);
* else 8 bits (the widest form), block 16 where a Q6_K part needs it, else 32: Q8_0 / Q5_0 / Q6_K / Q4_0 exact with
  integer zero points (128 / 16 / 32 / 8); a min type there (Q4_K, Q5_K, Q4_1, Q5_1) with its zero point rounded
  (the CPU kernel refuses float zero points at 8 bits), its error measured and reported.

Every part is matched against the FP32 initializer's values before it is written (the row order of llama.cpp's
Q/K permutation found so), so a part that is not the graph's weight is never carried: that MatMul stays in float and
the report says why. ``carry_report`` (``gguf_carry.json``) lists each MatMul's parts, types, form and its largest
difference from ``gguf.quants.dequantize``; the gate scores the graph like any precision.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from model_factory.build_engines.gguf_blocks import (CARRIED, FLOAT_TYPES, Blocks, dequantize, read_blocks,
                                                     split_blocks, to_uint8)

# The builder's MatMul (by node name) -> the GGUF tensors it packs, in column order.
_LAYER = re.compile(r"^/model/layers\.(\d+)/(?:attn|mlp)/(\w+)/MatMul$")
PARTS = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "q_proj": ("attn_q",), "k_proj": ("attn_k",),
         "v_proj": ("attn_v",), "o_proj": ("attn_output",), "gate_proj": ("ffn_gate",), "up_proj": ("ffn_up",),
         "down_proj": ("ffn_down",), "gate_up_proj": ("ffn_gate", "ffn_up")}
# MatMulNBits' activations quantized per block inside the kernel (the int8/int4 precisions' level: lm_quantize).
ACCURACY_LEVEL = 4
# The exact 4-bit form of a min type (Q4_K, Q4_1: a float zero point) is off by default: ONNX Runtime 1.32's CPU
# kernel takes float zero points at 4 bits but then dequantizes the weight on every call (a 2048 x 640 MatMulNBits,
# one row, 2 threads: 5.3 ms of CPU against 0.085 ms with uint8 zero points and 0.11 ms at 8 bits), which made
# Gemma 3 270M's gguf graph decode slower than FP32. Such a part takes the 8-bit form with its zero point rounded
# (gguf_blocks.to_uint8: within 1/32 of the type's step), the integer kernel's.
FLOAT_ZERO_POINTS = False


@dataclass(frozen=True)
class CarriedMatMul:
    """One MatMul of the graph and what became of it."""

    node: str
    parts: tuple[str, ...]
    types: tuple[str, ...]
    bits: int = 0  # 0: kept in float
    block: int = 0
    zero_points: str = ""  # "uint8" | "float"
    exact: bool = False  # the MatMulNBits values equal the GGUF's dequantized ones (float rounding aside)
    max_abs_error: float = 0.0  # vs gguf.quants.dequantize
    relative_rms_error: float = 0.0  # error RMS / weight RMS
    kept_float: str = ""  # why it was not carried


@dataclass(frozen=True)
class CarryReport:
    gguf: str
    accuracy_level: int
    matmuls: tuple[CarriedMatMul, ...] = ()
    by_type: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"gguf": self.gguf, "accuracy_level": self.accuracy_level, "by_type": dict(self.by_type),
                "matmuls": [asdict(m) for m in self.matmuls]}


def gguf_parts(node_name: str, tensors: Mapping[str, Any], tied: bool) -> tuple[str, ...] | None:
    """The GGUF tensor names a builder MatMul packs, or None for a MatMul with no GGUF weight."""
    if node_name == "/lm_head/MatMul":
        return ("output.weight",) if "output.weight" in tensors else ("token_embd.weight",)
    m = _LAYER.match(node_name)
    if not m or m.group(2) not in PARTS:
        return None
    layer, kind = m.group(1), m.group(2)
    fused = {"qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}.get(kind)
    if fused and f"blk.{layer}.{fused}.weight" in tensors and (kind == "qkv_proj" or
                                                               f"blk.{layer}.ffn_gate.weight" not in tensors):
        return (f"blk.{layer}.{fused}.weight",)
    return tuple(f"blk.{layer}.{p}.weight" for p in PARTS[kind])


def _llama_order(rows: int, heads: int) -> np.ndarray:
    """The GGUF row each Hugging Face row of a Q/K weight is (transformers' reverse of llama.cpp's permutation)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


def _matched(blocks: Blocks, target: np.ndarray, heads: Sequence[int]) -> Blocks | None:
    """``blocks`` in the row order whose values are ``target`` ([rows, K], the graph's), or None."""
    tol = 1e-5 * max(float(np.abs(target).max()), 1e-12)
    orders = [None] + [_llama_order(blocks.rows, h) for h in dict.fromkeys(heads)
                       if h > 0 and blocks.rows % (2 * h) == 0]
    for order in orders:
        b = blocks if order is None else Blocks(blocks.gguf_type, blocks.codes[order], blocks.scales[order],
                                                blocks.zero_points[order], blocks.code_bits,
                                                blocks.integer_zero_points)
        if np.allclose(dequantize(b), target, rtol=0, atol=tol):
            return b
    return None


def _form(parts: Sequence[Blocks], float_zero_points: bool = True) -> tuple[int, int, str]:
    """(bits, block, zero-point type) of the one MatMulNBits that holds every part: 4 bits where all are 4-bit
    codes in blocks of 32 (``float_zero_points=False``: only where their zero points are whole), else 8 bits
    (block 16 where one needs it)."""
    if all(p.code_bits == 4 and p.block == 32 and (float_zero_points or p.integer_zero_points) for p in parts):
        return 4, 32, "uint8" if all(p.integer_zero_points for p in parts) else "float"
    return 8, min(p.block for p in parts), "uint8"


def _pack(parts: Sequence[Blocks], bits: int, block: int, zp_kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' B [N, blocks, block·bits/8], scales [N·blocks] and zero points (packed uint8 or float)."""
    codes, scales, zps = [], [], []
    for p in parts:
        p = split_blocks(p, block)
        if bits == 8:
            c, s, z = to_uint8(p)
        else:
            c, s, z = p.codes, p.scales, (p.zero_points.astype(np.uint8) if zp_kind == "uint8" else p.zero_points)
        codes.append(c)
        scales.append(s)
        zps.append(z)
    c, s, z = np.concatenate(codes), np.concatenate(scales), np.concatenate(zps)
    if bits == 4:
        c = (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
        if zp_kind == "uint8":
            if z.shape[1] % 2:
                z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
            z = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(c), s.reshape(-1).astype(np.float32), np.ascontiguousarray(z).reshape(-1)


def packed_values(b: np.ndarray, scales: np.ndarray, zps: np.ndarray, bits: int, block: int, n: int,
                  k: int) -> np.ndarray:
    """The [N, K] weight a MatMulNBits' initializers stand for (the tests read a written graph back with it)."""
    nb = k // block
    if bits == 4:
        codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, nb, block)
        if zps.dtype == np.uint8:
            zps = np.stack([zps.reshape(n, -1) & 0x0F, zps.reshape(n, -1) >> 4], axis=-1).reshape(n, -1)[:, :nb]
    else:
        codes = b.reshape(n, nb, block)
    z = zps.reshape(n, nb).astype(np.float32)
    return ((codes.astype(np.float32) - z[..., None]) * scales.reshape(n, nb)[..., None]).reshape(n, k)


def carry_gguf(fp32_graph: Path, gguf_path: Path, out_dir: Path, hf_config: Mapping[str, Any],
               accuracy_level: int = ACCURACY_LEVEL, float_zero_points: bool = FLOAT_ZERO_POINTS,
               progress: Callable[[str], None] | None = None) -> tuple[Path, CarryReport]:
    """Write ``out_dir/model.onnx`` (+ ``model.onnx.data``): ``fp32_graph`` with each MatMul whose weight is a
    quantized GGUF tensor as a MatMulNBits of that tensor's blocks."""
    import gguf
    import onnx
    from onnx import helper, numpy_helper

    say = progress or (lambda _m: None)
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    heads = [int(hf_config.get("num_attention_heads") or 0), int(hf_config.get("num_key_value_heads") or 0)]
    model = _load_with_data(Path(fp32_graph))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    rows: list[CarriedMatMul] = []
    new_nodes, dropped = [], set()
    for node in graph.node:
        names = gguf_parts(node.name, tensors, bool(hf_config.get("tie_word_embeddings")))
        if node.op_type != "MatMul" or names is None or node.input[1] not in inits:
            new_nodes.append(node)
            continue
        types = tuple(tensors[n].tensor_type.name if n in tensors else "missing" for n in names)
        why = ""
        if "missing" in types:
            why = "no such tensor in the GGUF"
        elif any(t in FLOAT_TYPES for t in types):
            why = "a float tensor in the GGUF (the graph's float weight is its value)"
        elif any(t not in CARRIED for t in types):
            why = f"no MatMulNBits form for {', '.join(t for t in types if t not in CARRIED)}"
        weight = numpy_helper.to_array(inits[node.input[1]])  # [K, N]
        k, n_out = weight.shape
        parts: list[Blocks] = []
        if not why:
            col = 0
            for name in names:
                t = tensors[name]
                cols, rows_t = int(t.shape[0]), int(np.prod(t.shape[1:]))
                if cols != k:
                    why = f"{name} has rows of {cols}, the graph's K is {k}"
                    break
                b = _matched(read_blocks(t.tensor_type.name, t.data, rows_t, cols),
                             weight[:, col:col + rows_t].T, heads)
                if b is None:
                    why = f"{name}'s values are not the graph's weight (columns {col}..{col + rows_t})"
                    break
                parts.append(b)
                col += rows_t
            if not why and col != n_out:
                why = f"the parts hold {col} columns, the graph's N is {n_out}"
        if why:
            rows.append(CarriedMatMul(node.name, names, types, kept_float=why))
            new_nodes.append(node)
            continue
        bits, block, zp_kind = _form(parts, float_zero_points)
        b, s, z = _pack(parts, bits, block, zp_kind)
        base = node.input[1].removesuffix(".weight")
        carried = [numpy_helper.from_array(b, f"{base}.gguf.qweight"), numpy_helper.from_array(s, f"{base}.gguf.scales"),
                   numpy_helper.from_array(z, f"{base}.gguf.zero_points")]
        graph.initializer.extend(carried)
        new_nodes.append(helper.make_node(
            "MatMulNBits", [node.input[0]] + [t.name for t in carried], list(node.output), name=node.name,
            domain="com.microsoft", K=k, N=n_out, bits=bits, block_size=block, accuracy_level=accuracy_level))
        dropped.add(node.input[1])
        values = packed_values(b, s, z, bits, block, n_out, k)
        # The graph's weight is transformers' dequantization of these tensors (gguf.quants.dequantize), in its row order.
        reference = weight.T
        err = float(np.abs(values - reference).max())
        rms = float(np.sqrt(np.mean((values - reference) ** 2) / max(float(np.mean(reference ** 2)), 1e-30)))
        exact = err <= 1e-6 * max(float(np.abs(reference).max()), 1e-12)
        rows.append(CarriedMatMul(node.name, names, types, bits, block, zp_kind, exact, err, rms))
    del graph.node[:]
    graph.node.extend(new_nodes)
    still_used = {i for nd in graph.node for i in nd.input}
    keep = [t for t in graph.initializer if t.name not in dropped or t.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "model.onnx"
    onnx.save(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=1024)
    report = CarryReport(Path(gguf_path).name, accuracy_level, tuple(rows), _by_type(rows))
    carried = sum(1 for r in rows if r.bits)
    say(f"[quantize] gguf: {carried} of {len(rows)} MatMuls carry the GGUF's blocks "
        + "; ".join(f"{t}: {v['form']}, " + ("exact" if v["exact"] else f"max abs error {v['max_abs_error']:.3g}")
                    for t, v in report.by_type.items()))
    return out, report


def _load_with_data(path: Path) -> Any:
    """The graph with its external data read in. onnx's own loader refuses a data file with several hard links,
    which the export's is once packaging has linked it into a version folder (a ``quantize`` after ``package``)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        ext = {e.key: e.value for e in t.external_data}
        location = (path.parent / ext["location"]).resolve()
        if path.parent.resolve() not in location.parents:
            raise ValueError(f"{path}: {t.name}'s data lies outside its folder ({ext['location']})")
        with open(location, "rb") as f:
            f.seek(int(ext.get("offset", 0)))
            t.raw_data = f.read(int(ext["length"]))
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
    return model


def _by_type(rows: Sequence[CarriedMatMul]) -> dict[str, Any]:
    """Per GGUF type: the MatMuls holding it, the forms written, exact or the largest error (the whole MatMul's)."""
    out: dict[str, Any] = {}
    for r in rows:
        for t in dict.fromkeys(r.types):
            e = out.setdefault(t, {"matmuls": 0, "forms": [], "exact": True, "max_abs_error": 0.0,
                                   "relative_rms_error": 0.0, "kept_float": 0})
            e["matmuls"] += 1
            if not r.bits:
                e["kept_float"] += 1
                continue
            form = f"{r.bits}-bit block {r.block} {r.zero_points} zero points"
            if form not in e["forms"]:
                e["forms"].append(form)
            e["exact"] = e["exact"] and r.exact
            e["max_abs_error"] = max(e["max_abs_error"], r.max_abs_error)
            e["relative_rms_error"] = max(e["relative_rms_error"], r.relative_rms_error)
    for e in out.values():
        e["form"] = " / ".join(e["forms"]) or "float"
    return out
