"""Tiny causal-LM folders for the generative tests: random weights, a byte-level BPE tokenizer trained here.

Nothing on the package registries ships small LLM weights, so the tests make them: a ``transformers`` config of
each family with random weights (std 0.1: at Hugging Face's default 0.02 greedy output is one token repeated),
saved with ``save_pretrained``, and a tokenizer trained with ``tokenizers`` on local text (Debian's license
texts), wrapped as ``PreTrainedTokenizerFast`` with bos/eos/pad and a chat template. Folders are written the way
4.x readers (vLLM, optimum, llama.cpp's converter) also read: ``tokenizer_class: PreTrainedTokenizerFast`` and a
top-level ``rope_theta`` and ``torch_dtype`` in ``config.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt2")
# Families the zoo's export check covers too (export only: tests/build_engines/test_families.py), each with the
# parts the builder must get right: Gemma 2/3 sliding and global layers (a window the golden prompts exceed),
# soft-capping, the query scalar, Gemma 3's two RoPE bases and Q/K norms; Granite's multipliers; SmolLM3's
# layers without RoPE; OLMo's norms without weights; Phi's partial rotary and LayerNorm with bias.
MORE_FAMILIES = ("gemma2", "gemma3_text", "granite", "smollm3", "olmo", "nemotron", "phi", "ernie4_5",
                 "hunyuan_v1_dense")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TEXT_DIR = Path("/usr/share/common-licenses")


def corpus_files(limit: int = 20) -> list[str]:
    """Local text to train the tokenizer on (the license texts every Debian system has)."""
    files = sorted(str(p) for p in _TEXT_DIR.glob("*") if p.is_file())[:limit]
    if not files:  # pragma: no cover - every Debian machine has them
        raise RuntimeError(f"no text under {_TEXT_DIR} to train a tokenizer on")
    return files


def train_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (bos = pad = <|endoftext|>, eos = <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[2],
                                   pad_token=SPECIAL[0])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(family: str, tok, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
            max_positions: int, tie: bool):
    import transformers

    if family == "gpt2":  # its own names; multi-head attention (no kv_heads), tied LM head as GPT-2 ships
        return transformers.GPT2Config(vocab_size=len(tok), n_embd=hidden, n_layer=layers, n_head=heads,
                                       n_inner=intermediate, n_positions=max_positions, bos_token_id=tok.bos_token_id,
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                       initializer_range=0.1, tie_word_embeddings=True)
    common = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate,
                  max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, initializer_range=0.1,
                  tie_word_embeddings=tie)
    extra: dict = {}
    if family in ("qwen3", "gemma", "gemma2", "gemma3_text", "hunyuan_v1_dense", "ernie4_5"):
        extra["head_dim"] = hidden // heads
    if family == "mistral":
        extra["sliding_window"] = None
    if family in ("gemma2", "gemma3_text"):  # a window the golden prompts (32 + 64 tokens) exceed, then a global layer
        extra.update(sliding_window=16, layer_types=["sliding_attention", "full_attention"][:layers] +
                     ["full_attention"] * max(0, layers - 2), query_pre_attn_scalar=2 * hidden // heads)
    if family == "granite":
        extra.update(embedding_multiplier=4.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0)
    if family == "smollm3":
        extra.update(no_rope_layers=[1, 0][:layers] + [1] * max(0, layers - 2))
    if family == "phi":
        extra.update(partial_rotary_factor=0.5)
    return transformers.AutoConfig.for_model(family, **common, **extra)


def make_causal_lm(family: str, out: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                   intermediate: int = 128, max_positions: int = 512, vocab_size: int = 2048, tie: bool = False,
                   seed: int = 0) -> Path:
    """Write a random-weight causal LM of ``family`` with its tokenizer into ``out`` (created); returns ``out``."""
    import torch
    import transformers

    if family not in FAMILIES + MORE_FAMILIES:
        raise ValueError(f"unknown family {family!r}: use one of {', '.join(FAMILIES + MORE_FAMILIES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    config = _config(family, tok, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                     intermediate=intermediate, max_positions=max_positions, tie=tie)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _compat(out)
    return out


def _compat(out: Path) -> None:
    """What 4.x readers need: a tokenizer class they know, top-level rope_theta and torch_dtype."""
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.setdefault("chat_template", CHAT_TEMPLATE)
    tc_path.write_text(json.dumps(tc, indent=2))
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    cfg_path.write_text(json.dumps(cfg, indent=2))


if __name__ == "__main__":  # python tests/generative_models.py FAMILY OUT
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(make_causal_lm(sys.argv[1], Path(sys.argv[2])))
