"""An INT8 KV cache for a text-generation graph: one byte per cached key or value instead of four.

At many concurrent sequences a CPU decode step is bound by reading the cache: ONNX Runtime's
``GroupQueryAttention`` reads every cached key and value of every sequence, every layer, every step
(docs/generation.md). Since 1.32 its CPU kernel also keeps the cache as int8 with a float scale per channel
(``k_quant_type`` / ``v_quant_type`` ``PER_CHANNEL``, ``kv_cache_bit_width`` 8, ``k_scale`` / ``v_scale``
inputs of ``kv_heads x head_dim`` floats): a new key or value is stored as ``round(x / scale)`` clamped to
int8 and read back as ``q * scale`` (checked against the float kernel in ``tests/build/test_kv_int8.py``).

The scales are fitted here on the customer's calibration text: the FP32 graph prefills each calibration prompt
and every layer's cached keys and values are read back (keys after the rotary embedding, as the kernel stores
them). A value's scale is its channel's largest magnitude / 127. A key channel that the rotary embedding pairs
with another (``i`` and ``i + rotary_dim / 2``, or ``2i`` and ``2i + 1`` when interleaved) takes the largest
norm of the pair: the rotation moves a pair's magnitude between its two channels by position, never its norm,
so a position the calibration text did not reach cannot exceed it. The graph then keeps its weights and its
I/O names; only each attention node's attributes and scales and the cache tensors' element type change
(``contract``: ``generation.json`` names the precision's KV type, ``"int8"``, and the backend's slots follow).
The precision's gate (token agreement, perplexity) is scored with the INT8 cache in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from model_factory.backend.contract import INT8_KV_ONNXRUNTIME, past_name, present_name, runs_int8_kv

# The first ONNX Runtime whose CPU GroupQueryAttention was seen to keep an INT8 cache (checked by the tests on the
# installed one); an older one is refused before anything is built, as the backend refuses it at load.
MIN_ONNXRUNTIME = INT8_KV_ONNXRUNTIME
QMAX = 127.0
_TINY = 1e-8  # a channel that was always 0 still gets a usable scale
GQA = "GroupQueryAttention"


def _rotary(graph_path: Path) -> tuple[int, bool]:
    """``(rotary_dim, interleaved)`` of the graph's attention (0 when it applies no rotary embedding)."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != GQA:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if not attrs.get("do_rotary", 0) or len(node.input) < 8 or not node.input[7]:
            return 0, False
        cos = inits.get(node.input[7])
        half = int(cos.dims[-1]) if cos is not None else None
        if half is None:  # the cache made by a node: its shape is not known without running it
            raise ValueError(f"{graph_path.name}: the rotary cache of {node.name} is not an initializer")
        return 2 * half, bool(attrs.get("rotary_interleaved", 0))
    raise ValueError(f"{graph_path.name} has no {GQA} node: its KV cache cannot be kept in INT8")


def _pair_norm(k: np.ndarray, rotary_dim: int, interleaved: bool) -> np.ndarray:
    """``|k|`` per channel, the rotary channels replaced by their pair's norm. ``k``: ``[..., head_dim]``."""
    out = np.abs(k)
    if rotary_dim <= 0:
        return out
    if interleaved:
        a, b = k[..., 0:rotary_dim:2], k[..., 1:rotary_dim:2]
        norm = np.sqrt(a * a + b * b)
        out[..., 0:rotary_dim:2] = norm
        out[..., 1:rotary_dim:2] = norm
    else:
        half = rotary_dim // 2
        a, b = k[..., :half], k[..., half:rotary_dim]
        norm = np.sqrt(a * a + b * b)
        out[..., :half] = norm
        out[..., half:rotary_dim] = norm
    return out


def check_runtime() -> None:
    """Refuse, with the fix, an ONNX Runtime too old to run an INT8 KV cache on the CPU."""
    import onnxruntime

    from model_factory.errors import FactoryError

    if not runs_int8_kv(onnxruntime.__version__):
        want = ".".join(map(str, MIN_ONNXRUNTIME))
        raise FactoryError(f"quantization.kv_cache = \"int8\" needs onnxruntime >= {want} (its CPU "
                           f"GroupQueryAttention with an INT8 cache); this one is {onnxruntime.__version__}. Fix: pip "
                           f"install 'onnxruntime>={want}' where the model is built and served, or set kv_cache = "
                           "\"float\"")


def fit_kv_scales(fp32_graph: Path, head_dim: int, prompts: Sequence[Sequence[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, ``(k_scale, v_scale)``: ``kv_heads * head_dim`` float32 each, fitted on ``prompts`` (token ids)
    prefilled through the FP32 graph."""
    from model_factory.build_engines.lm_graph import DecoderRunner

    prompts = [list(p) for p in prompts if len(p) > 0]
    if not prompts:
        from model_factory.errors import FactoryError

        raise FactoryError("quantization.kv_cache = \"int8\" fits its scales on the calibration text and none of "
                           "quantization.calibration_data's samples has a token. Fix: give text samples (one per "
                           "line, or a .jsonl \"text\" field)")
    rotary_dim, interleaved = _rotary(Path(fp32_graph))
    runner = DecoderRunner(Path(fp32_graph), max(len(p) for p in prompts), head_dim)
    layers, kv = runner.shape.num_layers, runner.shape.num_kv_heads
    k_max = np.zeros((layers, kv, runner.shape.head_dim), np.float32)
    v_max = np.zeros_like(k_max)
    for prompt in prompts:
        runner.logits(prompt)
        n = len(prompt)
        for layer in range(layers):
            k = runner.cached(layer, "key")[0, :, :n, :].astype(np.float32)
            v = runner.cached(layer, "value")[0, :, :n, :].astype(np.float32)
            k_max[layer] = np.maximum(k_max[layer], _pair_norm(k, rotary_dim, interleaved).max(axis=1))
            v_max[layer] = np.maximum(v_max[layer], np.abs(v).max(axis=1))
    return [((np.maximum(k_max[i], _TINY) / QMAX).ravel().astype(np.float32),
             (np.maximum(v_max[i], _TINY) / QMAX).ravel().astype(np.float32)) for i in range(layers)]


def quantize_kv_cache(graph: Path, scales: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """Rewrite ``graph`` (in place; its external data untouched) to keep its KV cache in INT8 with ``scales``
    (:func:`fit_kv_scales`, one pair per layer)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = Path(graph)
    model = onnx.load(str(graph), load_external_data=False)
    g = model.graph
    layer_of = {past_name(i, "key"): i for i in range(len(scales))}
    done = set()
    for node in g.node:
        if node.op_type != GQA:
            continue
        layer = layer_of.get(node.input[3]) if len(node.input) > 3 else None
        if layer is None:
            raise ValueError(f"{graph.name}: {node.name} reads {node.input[3] if len(node.input) > 3 else 'no past'}, "
                             "not a layer's past_key_values input: not the contract's shared-slot graph")
        attrs = {a.name: a for a in node.attribute}
        if "k_quant_type" in attrs and helper.get_attribute_value(attrs["k_quant_type"]) not in (b"NONE", "NONE"):
            raise ValueError(f"{graph.name}: {node.name}'s KV cache is already quantized")
        for name in ("k_quant_type", "v_quant_type", "kv_cache_bit_width"):
            if name in attrs:
                node.attribute.remove(attrs[name])
        node.attribute.extend([helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("kv_cache_bit_width", 8)])
        k_scale, v_scale = scales[layer]
        names = (f"kv_int8.{layer}.k_scale", f"kv_int8.{layer}.v_scale")
        g.initializer.extend([numpy_helper.from_array(np.asarray(k_scale, np.float32), names[0]),
                              numpy_helper.from_array(np.asarray(v_scale, np.float32), names[1])])
        inputs = list(node.input) + [""] * max(0, 12 - len(node.input))
        inputs[12:14] = list(names)
        del node.input[:]
        node.input.extend(inputs)
        done.add(layer)
    if done != set(range(len(scales))):
        raise ValueError(f"{graph.name}: {len(done)} attention nodes for {len(scales)} layers' scales")
    kv_names = {past_name(i, k) for i in range(len(scales)) for k in ("key", "value")}
    kv_names |= {present_name(i, k) for i in range(len(scales)) for k in ("key", "value")}
    for value in list(g.input) + list(g.output):
        if value.name in kv_names:
            value.type.tensor_type.elem_type = TensorProto.INT8
    onnx.save(model, str(graph))
