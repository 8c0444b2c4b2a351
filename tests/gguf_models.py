"""A tiny GGUF written in the test: a random Llama (generative_models) as llama.cpp's converter would write it.

gguf-py's ``GGUFWriter`` with its numpy quantizers (``gguf.quants.quantize``: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1; the
K-quants it dequantizes only), the metadata transformers reads back (``llama.*`` hyper-parameters, a byte-level BPE
tokenizer as ``tokenizer.ggml.model = "gpt2"``, bos/eos, the chat template), and Llama's Q/K rows permuted for
rotary as ``convert_hf_to_gguf.py`` permutes them (transformers undoes it on load).
"""

from __future__ import annotations

import json
from pathlib import Path

# Each weight's GGUF type: a packed QKV that mixes Q8_0 / Q4_0 / Q5_0 (8-bit form), a 4-bit o_proj (Q4_0), Q5_0
# gate, a Q4_0 up (4-bit), Q8_0 down, Q8_0 LM head; the embedding and the norms stay float.
TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q5_0", "attn_output": "Q4_0", "ffn_gate": "Q5_0",
         "ffn_up": "Q4_0", "ffn_down": "Q8_0", "output": "Q8_0", "token_embd": "F32"}


def _permute(w, heads: int):
    """llama.cpp's converter's row order of a Q/K weight (``LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(folder: Path, out: Path, types: dict[str, str] | None = None) -> Path:
    """``folder`` (a Llama saved by generative_models.make_causal_lm) written as the GGUF ``out``."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    types = {**TYPES, **(types or {})}
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(rope))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens") or ():
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv_: kv_[1])]
    special = {a["content"] for a in tok.get("added_tokens") or ()}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tc["bos_token"]])
    writer.add_eos_token_id(vocab[tc["eos_token"]])
    writer.add_pad_token_id(vocab[tc["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tc["chat_template"])

    def add(name: str, kind: str, array) -> None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        qtype = getattr(gguf.GGMLQuantizationType, types.get(kind, "F32"))
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    add("token_embd.weight", "token_embd", w["model.embed_tokens.weight"])
    add("output_norm.weight", "norm", w["model.norm.weight"])
    if "lm_head.weight" in w:
        add("output.weight", "output", w["lm_head.weight"])
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", "norm", w[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", "norm", w[p + "post_attention_layernorm.weight"])
        for kind, name in hf.items():
            weight = w[p + name + ".weight"]
            if kind == "attn_q":
                weight = _permute(weight, heads)
            elif kind == "attn_k":
                weight = _permute(weight, kv)
            add(f"blk.{i}.{kind}.weight", kind, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
