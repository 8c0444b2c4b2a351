"""The shared-slot graph of a GPT-2 folder, written op by op (onnxruntime-genai's model builder has no GPT-2).

The same engine I/O as the builder's graphs (``backend/contract.py``, "shared-slots"): ``input_ids``,
``attention_mask`` and per layer one KV buffer ``[batch, heads, max_context, head_dim]`` bound as both past and
present, written in place by ONNX Runtime's ``GroupQueryAttention`` (here with as many KV heads as heads, no rotary:
GPT-2 is multi-head attention with learned absolute positions). What GPT-2 needs beyond the builder's Llama graph:

* positions from the mask, as ``transformers`` derives them: ``cumsum(attention_mask) - 1`` over the whole row,
  its last ``new_tokens`` columns (a prefill row right-padded to its group's longest gets 0..len-1; a decode row
  gets its cached length), looked up in the learned position table ``wpe`` and added to the token embedding;
* LayerNorm with bias, the fused ``c_attn`` projection (Conv1D: its weight is already ``[in, out]``) and the MLP
  with GELU (``gelu_new`` / ``gelu_pytorch_tanh``: the tanh form; ``gelu``: the exact one);
* the LM head tied to ``wte`` (or ``lm_head.weight`` where the folder has its own).

Node names follow the builder's (``/model/layers.N/attn/qkv_proj/MatMul``, ``.../attn/o_proj/MatMul``,
``.../mlp/up_proj/MatMul``, ``.../mlp/down_proj/MatMul``, ``/lm_head/MatMul``), so the quantize stage's ladders find
the same parts. Weights are read from the safetensors one tensor at a time, but the graph holds them all until they
are written to one external data file: 4 bytes per parameter (the builder streams its graphs tensor by tensor; GPT-2's
largest, 1.5B parameters, needs about 6 GiB here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from model_factory.backend.contract import ATTENTION_MASK, INPUT_IDS, LOGITS, past_name, present_name
from model_factory.errors import FactoryError

OPSET = 21
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


def gpt2_geometry(cfg: dict[str, Any]) -> dict[str, Any]:
    """Layers, heads, sizes and options of a GPT-2 ``config.json``; refuses what this graph does not compute."""
    act = cfg.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise FactoryError(f"GPT-2 activation_function {act!r} is not built (use one of {', '.join(ACTIVATIONS)}). "
                           "Fix: save the model with a GELU activation")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if cfg.get(flag):
            raise FactoryError(f"GPT-2 {flag} = true is not built. Fix: use a GPT-2 without it")
    hidden, heads = int(cfg["n_embd"]), int(cfg["n_head"])
    if hidden % heads:
        raise FactoryError(f"GPT-2 n_embd {hidden} is not a multiple of n_head {heads}. Fix: check config.json")
    return {"layers": int(cfg["n_layer"]), "heads": heads, "hidden": hidden, "head_dim": hidden // heads,
            "inner": int(cfg.get("n_inner") or 4 * hidden), "eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
            "vocab": int(cfg["vocab_size"]), "gelu": ACTIVATIONS[act],
            "scale": (hidden // heads) ** -0.5 if cfg.get("scale_attn_weights", True) else 1.0}


def _weights(folder: Path) -> Any:
    """A reader of the folder's safetensors: name -> float32 array (one tensor read at a time)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FactoryError(f"{folder} has no .safetensors weights. Fix: save the model with "
                           "save_pretrained(safe_serialization=True)")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="np") as st:
            for key in st.keys():
                where[key] = f

    def get(name: str) -> np.ndarray:
        for key in (name, f"transformer.{name}"):
            if key in where:
                with safe_open(str(where[key]), framework="np") as st:
                    return np.ascontiguousarray(st.get_tensor(key), dtype=np.float32)
        raise FactoryError(f"{folder}: no weight {name!r} in its safetensors. Fix: save the whole GPT2LMHeadModel")

    get.has = lambda name: name in where or f"transformer.{name}" in where  # type: ignore[attr-defined]
    return get


def write_gpt2_graph(folder: Path, out: Path) -> Path:
    """Write ``out/model.onnx`` (+ ``model.onnx.data``): the FP32 shared-slot graph of the GPT-2 in ``folder``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from model_factory.build_engines import onnx_files

    cfg = json.loads((Path(folder) / "config.json").read_text())
    g = gpt2_geometry(cfg)
    w = _weights(folder)
    out.mkdir(parents=True, exist_ok=True)
    nodes, inits = [], []

    def init(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(op: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "", **attrs: Any) -> list[str]:
        outs = [f"{name}/output_{i}" for i in range(outputs)]
        nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        return outs

    def const(name: str, value: Any, dtype: Any = np.int64) -> str:
        return init(f"/model/constants/{name}", np.asarray(value, dtype=dtype))

    L, H, D = g["layers"], g["heads"], g["head_dim"]
    # The mask: each row's cached + new length, and the positions of the new tokens.
    one = const("one", [1])
    (total,) = node("ReduceSum", [ATTENTION_MASK, one], "/model/attn_mask/ReduceSum", keepdims=0)
    (seqlens,) = node("Sub", [total, one], "/model/attn_mask/Sub")
    (seqlens32,) = node("Cast", [seqlens], "/model/attn_mask/Cast", to=TensorProto.INT32)
    (shape,) = node("Shape", [ATTENTION_MASK], "/model/attn_mask/Shape")
    (width,) = node("Gather", [shape, const("index_one", 1)], "/model/attn_mask/Gather", axis=0)
    (width32,) = node("Cast", [width], "/model/attn_mask/Gather/Cast", to=TensorProto.INT32)
    (cum,) = node("CumSum", [ATTENTION_MASK, const("axis_one", 1)], "/model/positions/CumSum")
    (pos_all,) = node("Sub", [cum, const("one_scalar", 1)], "/model/positions/Sub")
    (ids_shape,) = node("Shape", [INPUT_IDS], "/model/positions/ShapeIds")
    (new,) = node("Slice", [ids_shape, const("start_one", [1]), const("end_two", [2])], "/model/positions/New")
    (start,) = node("Neg", [new], "/model/positions/Start")
    (positions,) = node("Slice", [pos_all, start, const("end_max", [np.iinfo(np.int64).max]), const("axes_one", [1])],
                        "/model/positions/Slice")

    def layer_norm(x: str, stored: str, weights: str, name: str) -> str:
        (y,) = node("LayerNormalization", [x, init(f"{stored}.weight", w(f"{weights}.weight")),
                                           init(f"{stored}.bias", w(f"{weights}.bias"))],
                    name, axis=-1, epsilon=g["eps"])
        return y

    def linear(x: str, weights: str, name: str) -> str:
        """``x @ W + b`` of one GPT-2 Conv1D (its weight is ``[in, out]``), named as the builder names it."""
        stored = name.strip("/").replace("/", ".")  # /model/layers.0/attn/qkv_proj -> model.layers.0.attn.qkv_proj
        (y,) = node("MatMul", [x, init(f"{stored}.MatMul.weight", w(f"{weights}.weight"))], f"{name}/MatMul")
        (y,) = node("Add", [y, init(f"{stored}.Add.bias", w(f"{weights}.bias"))], f"{name}/Add")
        return y

    (tok,) = node("Gather", [init("model.embed_tokens.weight", w("wte.weight")), INPUT_IDS],
                  "/model/embed_tokens/Gather")
    (pos,) = node("Gather", [init("model.embed_positions.weight", w("wpe.weight")), positions],
                  "/model/embed_positions/Gather")
    (x,) = node("Add", [tok, pos], "/model/embed/Add")
    for i in range(L):
        p, layer = f"h.{i}", f"/model/layers.{i}"
        h = layer_norm(x, f"model.layers.{i}.input_layernorm", f"{p}.ln_1", f"{layer}/input_layernorm/LayerNorm")
        qkv = linear(h, f"{p}.attn.c_attn", f"{layer}/attn/qkv_proj")
        (att, _k, _v) = node("GroupQueryAttention", [qkv, "", "", past_name(i, "key"), past_name(i, "value"), seqlens32,
                                                     width32], f"{layer}/attn/GroupQueryAttention", outputs=3,
                             domain="com.microsoft", num_heads=H, kv_num_heads=H, scale=g["scale"], do_rotary=0,
                             local_window_size=-1)
        nodes[-1].output[1], nodes[-1].output[2] = present_name(i, "key"), present_name(i, "value")
        (x,) = node("Add", [x, linear(att, f"{p}.attn.c_proj", f"{layer}/attn/o_proj")], f"{layer}/attn/residual/Add")
        h = layer_norm(x, f"model.layers.{i}.post_attention_layernorm", f"{p}.ln_2",
                       f"{layer}/post_attention_layernorm/LayerNorm")
        (act,) = node("Gelu", [linear(h, f"{p}.mlp.c_fc", f"{layer}/mlp/up_proj")], f"{layer}/mlp/act_fn/Gelu",
                      approximate=g["gelu"])
        (x,) = node("Add", [x, linear(act, f"{p}.mlp.c_proj", f"{layer}/mlp/down_proj")], f"{layer}/mlp/residual/Add")
    h = layer_norm(x, "model.final_norm", "ln_f", "/model/final_norm/LayerNorm")
    head = w("lm_head.weight") if w.has("lm_head.weight") else w("wte.weight")  # [vocab, hidden]
    nodes.append(helper.make_node("MatMul", [h, init("lm_head.MatMul.weight", head.T)], [LOGITS],
                                  name="/lm_head/MatMul"))

    kv_shape = ["batch_size", H, "past_sequence_length", D]
    inputs = [helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["batch_size", "sequence_length", g["vocab"]])]
    for i in range(L):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(past_name(i, kind), TensorProto.FLOAT, kv_shape))
            outputs.append(helper.make_tensor_value_info(present_name(i, kind), TensorProto.FLOAT,
                                                         ["batch_size", H, "total_sequence_length", D]))
    graph = helper.make_graph(nodes, "gpt2", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="model-factory gpt2_graph")
    model.ir_version = 10
    path = onnx_files.save(model, out / "model.onnx", external=True)
    onnx.checker.check_model(str(path))
    return path


def build_gpt2(folder: Path, out: Path, precision: str, options: dict[str, Any] | None = None) -> Path:
    """``out/model.onnx`` (+ data) of the GPT-2 in ``folder`` at ``precision``, as the model builder's graphs are for
    the other families: FP32 written here; FP16 the same graph in half precision (weights, activations, KV cache and
    logits; LayerNorm and softmax in float32: ``fp16.convert_fp16_graph``); INT8 / INT4 its MatMuls quantized
    block-wise, symmetric, by ONNX Runtime's ``MatMulNBitsQuantizer`` (the quantizer the builder runs) with the
    builder's options (``block_size``, ``accuracy_level``, ``algo_config`` ``k_quant``; ``matmul_mixed_precision``:
    any selector keeps the LM head at INT8, GPT-2 having no mixed-layer table)."""
    import shutil

    import onnx

    from model_factory.build_engines import onnx_files

    opts = dict(options or {})
    if precision == "fp32":
        return write_gpt2_graph(folder, out)
    work = out.parent / f".{out.name}.fp32"
    shutil.rmtree(work, ignore_errors=True)
    try:
        fp32 = write_gpt2_graph(folder, work)
        out.mkdir(parents=True, exist_ok=True)
        if precision == "fp16":
            from model_factory.build_engines.fp16 import convert_fp16_graph

            converted, convert = convert_fp16_graph(onnx.load(str(fp32), load_external_data=False), keep_io_types=False)
            return onnx_files.save(converted, out / "model.onnx", base_dir=work, external=True, convert=convert)
        if precision not in ("int8", "int4"):
            raise FactoryError(f"no GPT-2 graph at {precision}. Fix: use fp32, fp16, int8 or int4")
        from onnxruntime.quantization.matmul_nbits_quantizer import KQuantWeightOnlyQuantConfig, MatMulNBitsQuantizer

        bits = 4 if precision == "int4" else 8
        common = dict(block_size=int(opts.get("block_size", 32)), is_symmetric=True,
                      accuracy_level=int(opts.get("accuracy_level", 4 if bits == 4 else 1)))
        head = ["/lm_head/MatMul"] if opts.get("matmul_mixed_precision") and bits == 4 else []
        algo = KQuantWeightOnlyQuantConfig() if opts.get("algo_config") == "k_quant" else None
        model = onnx.load(str(fp32))
        quant = MatMulNBitsQuantizer(model, bits=bits, nodes_to_exclude=head, algo_config=algo, **common)
        quant.process()
        model = quant.model.model
        if head:  # the LM head one step wider: INT8
            wide = MatMulNBitsQuantizer(model, bits=8, nodes_to_include=head, **common)
            wide.process()
            model = wide.model.model
        return onnx_files.save(model, out / "model.onnx", external=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
