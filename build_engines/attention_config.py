"""The builder's attention set as transformers computes it: sliding windows per layer and the rotary caches.

onnxruntime-genai's model builder reads a layer's sliding window only from ``layer_types`` (a Mistral, whose config
has ``sliding_window`` and no ``layer_types``, came out with full attention in every layer), and wrote its rotary
caches unscaled for ``rope_type = "linear"``. Either graph passed nothing wrong at short lengths and then differed
from transformers (the export check stopped both builds: logits off by 3.3). So after the builder:

- the builder runs with ``windowed_kv_cache`` off (``causal_lm.run_builder``): a sliding layer's cache is the same
  max-length slot as every other layer's (the contract's shared slots), not a window-sized ring
  (``sliding_window_cache``, which is removed if a builder writes it anyway);
- each ``GroupQueryAttention`` of layer ``i`` gets ``local_window_size`` = the window transformers gives that layer
  (``layer_types[i] == "sliding_attention"``, or every layer where the config has ``sliding_window`` and no layer
  types, as Mistral and Phi-3 attend), -1 where it attends to everything. ONNX Runtime's window and transformers'
  are the same count (measured: 16 gives Mistral's greedy tokens with ``sliding_window = 16``, 15 does not);
- ``cos_cache`` and ``sin_cache`` are compared with transformers' own rotary embedding of the model (its
  ``*RotaryEmbedding`` class on the config: every static RoPE type it implements, scaling and attention factor
  included) and rewritten with its values where they differ. RoPE whose frequencies depend on the sequence's
  length (``dynamic``, ``longrope``) cannot be one static cache: left as the builder writes them (it knows
  LongRoPE), and the export check judges.

Only the graph's attributes and those two initializers change (in place in the external data file when they are
stored there): the weights are not read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

LAYER = re.compile(r"/layers\.(\d+)/")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
ROTARY_CACHES = ("cos_cache", "sin_cache")


def hf_config(folder: Path) -> Any:
    """The folder's config as transformers reads it (its config class: ``layer_types``, RoPE parameters)."""
    import transformers

    return transformers.AutoConfig.from_pretrained(str(folder), trust_remote_code=False)


def layer_windows(config: Any, layers: int) -> list[int]:
    """Each layer's sliding window as transformers attends (-1: full attention)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return [-1] * layers
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else -1 for t in list(types)[:layers]] + \
            [-1] * max(0, layers - len(types))
    return [window] * layers


def rotary_caches(config: Any, rows: int, half: int,
                  layer_type: str | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """transformers' cos and sin for positions ``0..rows-1`` (``[rows, half]``), or None where the model has no
    static rotary embedding this can compute (no RoPE, or a type whose frequencies depend on the length).
    ``layer_type``: the layers' kind where the config nests its RoPE per kind (Gemma 3: ``full_attention``,
    ``sliding_attention``)."""
    import torch
    import transformers

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    if (params.get("rope_type") or params.get("type") or "default") not in STATIC_ROPE:
        return None
    arch = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, arch, None) if arch else None
    if model_class is None:
        return None
    module = __import__(model_class.__module__, fromlist=["_"])
    rotary = next((getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")
                   and not n.startswith("_")), None)
    if rotary is None:
        return None
    with torch.no_grad():
        emb = rotary(config=config)
        kind = {"layer_type": layer_type} if layer_type is not None else {}
        cos, sin = emb(torch.zeros(1, dtype=torch.float32), torch.arange(rows)[None], **kind)
    cos, sin = cos[0].float().numpy(), sin[0].float().numpy()
    if cos.shape[-1] < 2 * half:
        return None
    return np.ascontiguousarray(cos[:, :half]), np.ascontiguousarray(sin[:, :half])


def align_attention(folder: Path, graph: Path, say: Callable[[str], None] = lambda _m: None,
                    atol: float = 1e-5) -> dict[str, Any]:
    """Set ``graph``'s sliding windows and rotary caches as transformers computes them for ``folder``; returns
    what changed (``windows``: layer -> window set, ``rotary``: whether the caches were rewritten)."""
    import onnx
    from onnx import helper

    graph = Path(graph)
    model = onnx.load(str(graph), load_external_data=False)
    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    layers = 1 + max((int(m.group(1)) for n in attention if (m := LAYER.search(n.name))), default=-1)
    changed: dict[str, Any] = {"windows": {}, "rotary": False}
    config = hf_config(folder)
    windows = layer_windows(config, layers)
    for node in attention:
        m = LAYER.search(node.name)
        if m is None:
            continue
        want = windows[int(m.group(1))]
        ring = next((a for a in node.attribute if a.name == "sliding_window_cache"), None)
        attr = next((a for a in node.attribute if a.name == "local_window_size"), None)
        if ring is None and attr is not None and attr.i == want:
            continue
        if ring is not None:  # the contract's slots hold every position: no window-sized ring
            node.attribute.remove(ring)
        if attr is not None:
            node.attribute.remove(attr)
        node.attribute.append(helper.make_attribute("local_window_size", want))
        changed["windows"][int(m.group(1))] = want
    rewrite: list[tuple[Any, np.ndarray]] = []
    for (cos_name, sin_name), layer_type in _cache_sets(config):
        inits = {i.name: i for i in model.graph.initializer if i.name in (cos_name, sin_name)}
        if len(inits) != 2:
            continue
        shape = tuple(inits[cos_name].dims)
        want = rotary_caches(config, shape[0], shape[1], layer_type) if len(shape) == 2 else None
        if want is not None:
            for name, values in zip((cos_name, sin_name), want):
                have = _read(inits[name], graph.parent)
                close = max(atol, 4 * float(np.finfo(have.dtype).eps))  # an FP16 cache holds 3 decimals
                if have.shape != values.shape or not np.allclose(have.astype(np.float32), values, atol=close):
                    rewrite.append((inits[name], values.astype(have.dtype)))
    for init, values in rewrite:
        _write(init, values, graph.parent)
    changed["rotary"] = bool(rewrite)
    if changed["windows"] or rewrite:
        onnx.save(model, str(graph))
        say(f"[export] attention as transformers computes it: sliding windows {_windows(changed['windows'])}, "
            f"rotary caches {'rewritten' if rewrite else 'kept'}")
    return changed


def _cache_sets(config: Any) -> list[tuple[tuple[str, str], str | None]]:
    """The graph's rotary cache pairs and the layer kind each serves: one ``cos_cache``/``sin_cache``, or where the
    config nests RoPE per layer kind (Gemma 3), the builder's ``*_global`` (full attention) and ``*_local``
    (sliding) pairs, each computed with its own kind's parameters."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        sets: list[tuple[tuple[str, str], str | None]] = [(("cos_cache_global", "sin_cache_global"), "full_attention")]
        if isinstance(params.get("sliding_attention"), dict):
            sets.append((("cos_cache_local", "sin_cache_local"), "sliding_attention"))
        return sets + [(ROTARY_CACHES, "full_attention")]
    return [(ROTARY_CACHES, None)]


def _windows(windows: dict[int, int]) -> str:
    if not windows:
        return "kept"
    values = sorted(set(windows.values()))
    return ", ".join(f"{v} in {sum(1 for w in windows.values() if w == v)} layers" for v in values)


def _external(init: Any) -> dict[str, str] | None:
    from onnx import TensorProto

    if init.data_location != TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in init.external_data}


def _read(init: Any, base: Path) -> np.ndarray:
    from onnx import helper, numpy_helper

    ext = _external(init)
    if ext is None:
        return numpy_helper.to_array(init)
    dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
    with open(base / ext["location"], "rb") as f:
        f.seek(int(ext.get("offset", 0)))
        raw = f.read(int(ext["length"]))
    return np.frombuffer(raw, dtype=dtype).reshape(tuple(init.dims)).copy()


def _write(init: Any, values: np.ndarray, base: Path) -> None:
    """``values`` into ``init`` where it is stored: in the external data file at its offset (same size), or in
    the proto."""
    from onnx import numpy_helper

    ext = _external(init)
    if ext is None:
        init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(values), init.name))
        return
    raw = np.ascontiguousarray(values).tobytes()
    if len(raw) != int(ext["length"]):
        raise ValueError(f"{init.name}: {len(raw)} bytes for a tensor stored in {ext['length']}")
    with open(base / ext["location"], "r+b") as f:
        f.seek(int(ext.get("offset", 0)))
        f.write(raw)


def config_window(folder: Path) -> int | None:
    """The largest sliding window any layer has (generation.json's ``sliding_window``), None without one."""
    config = hf_config(folder)
    windows = [w for w in layer_windows(config, int(config.num_hidden_layers)) if w > 0]
    return max(windows) if windows else None
