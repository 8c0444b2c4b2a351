"""What a Hugging Face causal-LM folder must be for ``task = "text-generation"``, checked before any build.

The factory never runs a model's own code, so a folder that needs it (``auto_map``) is refused; so is one
without a language-model head, without an end-of-sequence token (generation could never stop), of a family the
exporter does not build to the agreed engine I/O, or asked for a context longer than its positions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from model_factory.recipe.errors import field_error as _err
from model_factory.recipe.specs import GenerationSettings, TensorSpec

# model_type -> the architecture the exporter turns into the shared-slot graph (onnxruntime-genai's model builder;
# GPT-2, which it has no builder for, build_engines.gpt2_graph): every architecture the builder (0.18) has that
# transformers runs without the model's own code and whose graph is the contract's. Each is built and checked
# token-identical to transformers: the first seven end to end by tests/build/test_generative.py (the zoo), the
# others' export by tests/build_engines/test_families.py; Gemma 3 270M, a real one, by tests/build/test_gemma3.py.
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
            "gpt2": "GPT2LMHeadModel", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
            "granite": "GraniteForCausalLM", "phi": "PhiForCausalLM", "nemotron": "NemotronForCausalLM",
            "ernie4_5": "Ernie4_5ForCausalLM"}
# Families a user may hold that are refused, each with what is missing (measured on a tiny model of the family).
REFUSED = {
    "gemma3": "a Gemma3ForConditionalGeneration (vision and text): the factory builds the text model only",
    "smollm3": "onnxruntime-genai 0.18's builder fails on SmolLM3's layers without RoPE (no_rope_layers: "
               "KeyError 'position_ids')",
    "olmo": "onnxruntime-genai 0.18's builder writes OLMo's weightless LayerNorms wrongly (logits off by 2.1 from "
            "transformers on a test model)",
    "olmo2": "onnxruntime-genai 0.18's builder has no Olmo2ForCausalLM (OLMo 2's norms after attention and MLP)",
    "olmo3": "onnxruntime-genai 0.18's builder has no Olmo3ForCausalLM",
    "hunyuan_v1_dense": "onnxruntime-genai 0.18's HunYuan graph takes position_ids (its RoPE outside attention), "
                        "not the shared-slot I/O the backend runs",
    "gpt_oss": "a mixture of experts: the backend's graph I/O and KV account are for dense decoders",
    "granitemoehybrid": "Mamba layers keep a recurrent state, not the KV cache the backend runs",
    "lfm2": "convolution layers keep a recurrent state, not the KV cache the backend runs",
}
DEFAULT_MAX_CONTEXT = 4096
_SUPPORTED = ", ".join(FAMILIES)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def eos_token_ids(folder: Path, cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """The end-of-sequence ids: generation_config.json's, else config.json's, else the tokenizer's eos token."""
    gen = _read(folder / "generation_config.json")
    ids = _ids(gen.get("eos_token_id")) or _ids(cfg.get("eos_token_id"))
    if ids:
        return tuple(dict.fromkeys(ids))
    tc = _read(folder / "tokenizer_config.json")
    eos = tc.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str):
        vocab = _read(folder / "tokenizer.json")
        for added in vocab.get("added_tokens") or ():
            if isinstance(added, dict) and added.get("content") == eos and isinstance(added.get("id"), int):
                return (added["id"],)
        token_id = ((vocab.get("model") or {}).get("vocab") or {}).get(eos)
        if isinstance(token_id, int):
            return (token_id,)
    return ()


def check_causal_lm(folder: Path, cfg: Mapping[str, Any], max_context: int | None,
                    defaults: Mapping[str, Any]) -> tuple[GenerationSettings, int]:
    """Refuse what cannot be built; return the settings and the max context (default: the positions, capped)."""
    if cfg.get("auto_map") or cfg.get("trust_remote_code"):
        raise _err("source.path", f"{folder}/config.json has auto_map: the architecture is defined by the model's own "
                   "Python code, and the factory never runs a model's code", "use a folder of a family transformers "
                   f"ships ({_SUPPORTED}), saved with save_pretrained()")
    family = cfg.get("model_type")
    archs = [a for a in (cfg.get("architectures") or []) if isinstance(a, str)]
    if family == "gemma3" and "Gemma3ForConditionalGeneration" in (cfg.get("architectures") or []):
        raise _err("model.task", f"text-generation does not build the 'gemma3' family ({folder}/config.json "
                   f"model_type): {REFUSED['gemma3']}", "save its language model alone (a Gemma3ForCausalLM, "
                   "model_type gemma3_text), or use a model of a supported family: " + _SUPPORTED)
    if family not in FAMILIES:
        missing = REFUSED.get(str(family), "onnxruntime-genai 0.18's builder has no graph of it that the backend "
                              "runs")
        raise _err("model.task", f"text-generation does not build the {family!r} family ({folder}/config.json "
                   f"model_type): {missing}", f"use a model of a supported family: {_SUPPORTED}")
    arch = FAMILIES[family]
    if arch not in archs:
        holds = ", ".join(archs) if archs else "no architectures entry"
        raise _err("model.task", f"text-generation needs a language-model head ({arch}), but {folder}/config.json "
                   f"holds {holds}", f"save the model with its head (save_pretrained() of a {arch})")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") if isinstance(rope, Mapping) else None
    if rope_type == "dynamic":
        raise _err("source.path", f"{folder}/config.json has rope_scaling of type 'dynamic': its frequencies change "
                   "with each sequence's length, which a graph's fixed rotary caches cannot follow",
                   "use the model without rope_scaling (its trained context), or a static type (linear, llama3, "
                   "yarn)")
    eos = eos_token_ids(folder, cfg)
    if not eos:
        raise _err("source.path", f"{folder} names no end-of-sequence token (generation_config.json, config.json "
                   "eos_token_id, tokenizer eos_token): generation could never stop",
                   "save the tokenizer with its eos_token (tokenizer.save_pretrained) or set eos_token_id in "
                   "config.json")
    if not (folder / "tokenizer.json").is_file():
        raise _err("source.path", f"{folder} has no tokenizer.json (a fast tokenizer)",
                   "save the model's fast tokenizer into the folder (tokenizer.save_pretrained)")
    positions = cfg.get("max_position_embeddings")
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        raise _err("source.path", f"{folder}/config.json has no max_position_embeddings",
                   "save the model with its full config")
    if max_context is not None and max_context > positions:
        raise _err("shapes.max_context", f"{max_context} is longer than the {positions} positions the model has",
                   f"use at most {positions}")
    context = max_context if max_context is not None else min(positions, DEFAULT_MAX_CONTEXT)
    return GenerationSettings(family=family, architecture=arch, max_positions=positions, eos_token_ids=eos,
                              defaults=dict(defaults)), context


def generate_tensor_specs() -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The Triton-facing I/O of a text-generation model, as the contract declares it (GENERATE_INPUTS/OUTPUTS)."""
    from model_factory.backend.contract import GENERATE_INPUTS, GENERATE_OUTPUTS

    def spec(t: Any) -> TensorSpec:
        dtype = t.data_type.removeprefix("TYPE_")
        return TensorSpec(t.name, "BYTES" if dtype == "STRING" else dtype, tuple(t.dims), t.optional)

    return tuple(map(spec, GENERATE_INPUTS)), tuple(map(spec, GENERATE_OUTPUTS))
