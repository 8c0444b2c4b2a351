"""A PEFT LoRA adapter built onto a packaged base: converted, checked against transformers + peft, and gated.

The adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) is scanned like any source (no pickle is
read: ``adapter_model.bin`` is refused unless clean and allowed), then each ``lora_A`` / ``lora_B`` pair is turned into
the pair the base graph's projection takes (``lora_contract``: ``A`` [in, r], ``B`` [r, out] with PEFT's scaling
folded in; q, k and v side by side in ``A`` and block-diagonal in ``B`` where the builder packed them into one
``qkv_proj``). The check runs the base's packaged graph rewritten as the backend serves it (``generation/lora.py``,
imported on purpose: the served path) with the adapter in slot 1:

* greedy tokens identical to ``transformers`` + ``peft`` (``PeftModel`` on the base's Hugging Face folder) for the
  golden prompts, up to a near-tie of the reference's top two logits, as the base's own export check;
* the gate on the held-out text: the perplexity under the graph with the adapter divided by that of the base with
  the adapter merged into its weights in FP32 (``merge_and_unload``), and the teacher-forced agreement of their
  next-token choices.

What PEFT can express and the graph cannot is refused by name: DoRA, biases, ``modules_to_save``, targets that are
not a layer's projection (embeddings, the LM head), GPT-2's ``fan_in_fan_out`` Conv1D layout.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from model_factory.backend.lora_contract import (ADAPTER_WEIGHTS, LORA_MASK, AdapterSpec, file_sha256, graph_module,
                                                  lora_inputs)
from model_factory.errors import FactoryError

_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
HELDOUT_TOKENS = 128  # tokens per held-out sample scored (perplexity and agreement)
HELDOUT_SAMPLES = 8


@dataclass(frozen=True)
class AdapterCheck:
    """What the check found: the adapter's spec (without its final name/version), the weights file, the report."""

    spec: AdapterSpec
    weights: Path
    report: dict


def base_digests(version_dir: Path) -> dict[str, str]:
    """The sha256 of the base version's graphs, their weights and generation.json (what an adapter is tied to)."""
    files = sorted(p for p in Path(version_dir).iterdir() if p.is_file() and (
        p.name.endswith(".onnx") or p.name.endswith(".onnx.data") or p.name == "generation.json"))
    return {p.name: file_sha256(p) for p in files}


def read_peft(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``adapter_config.json`` and the tensors of ``adapter_model.safetensors`` (float32)."""
    folder = Path(folder)
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise FactoryError(f"{folder} has no adapter_model.safetensors. Fix: save the adapter with "
                           "save_pretrained(..., safe_serialization=True)")
    from safetensors.numpy import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    return config, {k: np.asarray(v, np.float32) for k, v in load_file(str(weights)).items()}


def _refusals(config: dict) -> list[str]:
    out = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        out.append(f"peft_type {config.get('peft_type')} (only LORA is served)")
    if config.get("use_dora"):
        out.append("use_dora (DoRA's magnitude vector is not a low-rank product)")
    if config.get("bias", "none") != "none":
        out.append(f"bias = {config.get('bias')!r} (set bias = \"none\")")
    if config.get("modules_to_save"):
        out.append(f"modules_to_save {config['modules_to_save']} (whole modules replaced, not adapted)")
    if config.get("fan_in_fan_out"):
        out.append("fan_in_fan_out (GPT-2's Conv1D layout)")
    return out


def graph_pairs(config: dict, tensors: dict[str, np.ndarray], hf_config: dict,
                modules: set[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The adapter's pairs per graph module (``modules``: those the base graph has)."""
    bad = _refusals(config)
    if bad:
        raise FactoryError(f"this LoRA adapter cannot be served: {'; '.join(bad)}. Fix: train it without them")
    parts: dict[tuple[int, str, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise FactoryError(f"adapter tensor {key} is not a layer projection's lora_A/lora_B (targets such as "
                               "embed_tokens or lm_head are not served). Fix: target the attention and MLP projections")
        layer, block, proj, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        parts.setdefault((layer, "attn" if block == "self_attn" else "mlp", proj), {})[ab] = value
    alpha_default = float(config.get("lora_alpha", 8))
    alpha_pattern = config.get("alpha_pattern") or {}  # ranks come from the tensors themselves

    def scaling(proj: str, r: int) -> float:
        alpha = next((float(v) for k, v in alpha_pattern.items() if k in proj), alpha_default)
        return alpha / (math.sqrt(r) if config.get("use_rslora") else r)

    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    sizes = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim,
             "gate_proj": int(hf_config.get("intermediate_size", 0)),
             "up_proj": int(hf_config.get("intermediate_size", 0))}
    grouped: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    for (layer, block, proj), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise FactoryError(f"layers.{layer}.{proj} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        r = a.shape[0]
        pair = (proj, a.T.copy(), (b.T * scaling(f"layers.{layer}.{proj}", r)).astype(np.float32))
        direct = f"layers.{layer}.{block}.{proj}"
        packed = next((f"layers.{layer}.{block}.{p}" for p, members in _PACKED.items() if proj in members), None)
        if direct in modules:
            grouped.setdefault(direct, []).append(pair)
        elif packed in modules:
            grouped.setdefault(packed, []).append(pair)
        else:
            raise FactoryError(f"the base graph has no projection for layers.{layer}.{proj}. Fix: target the "
                               "attention (q/k/v/o_proj) and MLP (gate/up/down_proj) projections")
    out = {}
    for module, members in grouped.items():
        if len(members) == 1 and module.endswith(members[0][0]):
            out[module] = members[0][1:]
            continue
        order = _PACKED[module.rsplit(".", 1)[1]]
        offsets, at = {}, 0
        for p in order:
            offsets[p], at = at, at + sizes[p]
        rank = sum(a.shape[1] for _, a, _ in members)
        a_all = np.zeros((members[0][1].shape[0], rank), np.float32)
        b_all = np.zeros((rank, at), np.float32)
        k = 0
        for proj, a, b in sorted(members, key=lambda m: order.index(m[0])):
            r = a.shape[1]
            a_all[:, k:k + r] = a
            b_all[k:k + r, offsets[proj]:offsets[proj] + b.shape[1]] = b
            k += r
        out[module] = (a_all, b_all)
    return out


def write_weights(pairs: dict[str, tuple[np.ndarray, np.ndarray]], path: Path) -> None:
    arrays = {}
    for module, (a, b) in sorted(pairs.items()):
        arrays[module + ".A"], arrays[module + ".B"] = a, b
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def lora_runner(graph: Path, pairs: dict[str, tuple[np.ndarray, np.ndarray]], max_context: int, head_dim: int) -> Any:
    """The build's decoder runner on the base graph rewritten as served, the adapter bound alone (every row its)."""
    from model_factory.backend.generation.lora import prepare, stacked
    from model_factory.build_engines.lm_graph import DecoderRunner

    # The graph rewritten without its weights, which ONNX Runtime reads from the version folder: onnx's own loader
    # refuses a data file with several hard links ("hardlink attack"), as every packaged base's is (the build folder's
    # and the repository's), and a 1 GB graph read into a proto would be one more copy in memory.
    prepared = prepare(Path(graph), sorted(pairs))
    rank = max(a.shape[1] for a, _ in pairs.values())
    one = stacked(pairs, prepared.shapes, rank)
    feeds: dict[str, np.ndarray] = {LORA_MASK: np.ones((1, 1, rank), np.float32)}  # broadcast over the rows
    for module, (a, b) in one.items():
        name_a, name_b = lora_inputs(module)
        feeds[name_a] = np.ascontiguousarray(a.T)
        feeds[name_b] = b
    return DecoderRunner(prepared.model, max_context, head_dim, feeds=feeds, data_folder=prepared.weights_folder)


def _graph_modules(graph: Path) -> set[str]:
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    return {m for m in (graph_module(n.name) for n in model.graph.node) if m}


def check_adapter(recipe: Any, out_dir: Path, progress: Callable[[str], None] = lambda _m: None) -> AdapterCheck:
    """Convert, check and gate ``recipe``'s adapter (source.kind = "lora") on its base; FactoryError when it fails."""
    from model_factory.backend.contract import Files
    from model_factory.build_engines.causal_lm import golden_texts, load_torch_model, torch_continuations
    from model_factory.build_engines.lm_graph import head_dim_of
    from model_factory.build_engines.source_scan import scan_files
    from model_factory.recipe import read_hf_config

    base = recipe.adapter
    folder = Path(recipe.source.path)
    scan = scan_files([p for p in folder.rglob("*") if p.is_file()], folder,
                      allow_pickle=recipe.source.allow_pickle).check()
    graph = base.version_dir / Files.ONNX
    if not graph.is_file():
        raise FactoryError(f"{graph} is missing: the base's FP32 graph is what the adapter is checked on. Fix: point "
                           "adapter.base at a text-generation model built by model-factory")
    hf_config = read_hf_config(base.source)
    config, tensors = read_peft(folder)
    pairs = graph_pairs(config, tensors, hf_config, _graph_modules(graph))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / ADAPTER_WEIGHTS
    write_weights(pairs, weights)
    progress(f"[adapter] {len(pairs)} graph projections, rank {max(a.shape[1] for a, _ in pairs.values())}; source "
             f"scan {scan.verdict}")

    from peft import PeftModel

    base_model, tok = load_torch_model(base.source)
    reference_model = PeftModel.from_pretrained(base_model, str(folder))
    reference_model.eval()
    eos = recipe.generation.eos_token_ids
    texts = golden_texts(recipe)
    reference, _ = torch_continuations(reference_model, tok, texts, eos)
    runner = lora_runner(graph, pairs, recipe.shapes.max_context, head_dim_of(hf_config))
    rows = []
    for c in reference:
        got = runner.greedy(c.prompt_ids, len(c.tokens), suppress=eos)
        upto = len(c.tokens) if c.near_tie is None else c.near_tie
        diff = next((i for i, (x, y) in enumerate(zip(got, c.tokens)) if x != y), None)
        rows.append({"prompt_tokens": len(c.prompt_ids), "near_tie": c.near_tie, "first_difference": diff,
                     "identical_up_to_near_tie": diff is None or diff >= upto})
    greedy_ok = all(r["identical_up_to_near_tie"] for r in rows)
    if not greedy_ok:
        bad = next(r for r in rows if not r["identical_up_to_near_tie"])
        raise FactoryError(f"the base graph with adapter {recipe.name} differs from transformers + peft's greedy "
                           f"tokens at step {bad['first_difference']} (before any near-tie): the conversion is wrong "
                           "for this adapter. Fix: report it with the adapter_config.json")
    merged = reference_model.merge_and_unload()
    merged.eval()
    gate = _gate(runner, merged, tok, _heldout(recipe, texts), recipe.quantization)
    progress(f"[adapter] greedy identical to transformers + peft on {len(rows)} prompts; held-out perplexity "
             f"{gate['perplexity']:.3f} vs merged FP32 {gate['perplexity_merged']:.3f} (ratio "
             f"{gate['perplexity_ratio']:.4f}), agreement {gate['agreement']:.4f}")
    if not gate["passed"]:
        raise FactoryError(f"adapter {recipe.name} missed its gate on the held-out text: perplexity ratio "
                           f"{gate['perplexity_ratio']:.4f} (at most {recipe.quantization.max_perplexity_ratio}), "
                           f"agreement {gate['agreement']:.4f} (at least {recipe.quantization.min_token_agreement}). "
                           "Fix: look at the conversion, or loosen quantization.max_perplexity_ratio / "
                           "min_token_agreement if the data calls for it")
    base_greedy = _base_differs(graph, reference, recipe, hf_config, eos)
    rank = max(a.shape[1] for a, _ in pairs.values())
    spec = AdapterSpec(recipe.name, recipe.version, base.name, base.version, base_digests(base.version_dir), rank,
                       tuple(sorted(pairs)), weights.stat().st_size,
                       {k: config.get(k) for k in ("r", "lora_alpha", "target_modules", "use_rslora",
                                                   "base_model_name_or_path", "peft_version") if k in config})
    report = {"check": {"prompts": rows, "greedy_identical": greedy_ok,
                        "tokens_differing_from_base": base_greedy}, "gate": gate,
              "source_scan": scan.to_dict() if hasattr(scan, "to_dict") else str(scan.verdict)}
    return AdapterCheck(spec, weights, report)


def _heldout(recipe: Any, fallback: Sequence[str]) -> list[str]:
    q = recipe.quantization
    if q.heldout_data is None and q.calibration_data is None:
        return list(fallback)
    from model_factory.build_engines.calibration import split_data

    held = split_data(q, need_calibration=False).heldout
    return [t for t in held.texts if isinstance(t, str) and t.strip()][:HELDOUT_SAMPLES] or list(fallback)


def _gate(runner: Any, merged: Any, tok: Any, texts: Sequence[str], q: Any) -> dict:
    """Perplexity (graph with the adapter, and merged FP32) and teacher-forced next-token agreement."""
    import torch

    nll_g = nll_m = 0.0
    count = same = 0
    with torch.no_grad():
        for text in texts:
            ids = tok(text, add_special_tokens=True)["input_ids"][:HELDOUT_TOKENS]
            if len(ids) < 2:
                continue
            g = runner.logits(ids)[:-1].astype(np.float64)
            m = merged(torch.tensor([ids])).logits[0, :-1].double().numpy()
            target = np.asarray(ids[1:])
            for logits, acc in ((g, "g"), (m, "m")):
                top = logits.max(axis=-1, keepdims=True)
                nll = float((np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
                             - logits[np.arange(len(target)), target]).sum())
                if acc == "g":
                    nll_g += nll
                else:
                    nll_m += nll
            same += int((g.argmax(-1) == m.argmax(-1)).sum())
            count += len(target)
    if not count:
        raise FactoryError("the held-out text gave no tokens to score. Fix: point quantization.heldout_data at a "
                           "local .txt of your text, one sample per line")
    ppl_g, ppl_m = math.exp(nll_g / count), math.exp(nll_m / count)
    ratio, agreement = ppl_g / ppl_m, same / count
    return {"perplexity": ppl_g, "perplexity_merged": ppl_m, "perplexity_ratio": ratio, "agreement": agreement,
            "tokens": count, "max_perplexity_ratio": q.max_perplexity_ratio,
            "min_token_agreement": q.min_token_agreement,
            "passed": ratio <= q.max_perplexity_ratio and agreement >= q.min_token_agreement}


def _base_differs(graph: Path, reference: Sequence[Any], recipe: Any, hf_config: dict, eos: Sequence[int]) -> int:
    """How many of the golden tokens the base alone would choose otherwise (the adapter visibly changes the model)."""
    from model_factory.build_engines.lm_graph import DecoderRunner, head_dim_of

    runner = DecoderRunner(graph, recipe.shapes.max_context, head_dim_of(hf_config))
    return sum(int(x != y) for c in reference
               for x, y in zip(runner.greedy(c.prompt_ids, len(c.tokens), eos), c.tokens))
