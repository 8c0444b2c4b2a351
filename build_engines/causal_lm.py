"""Export stage of a text-generation model: one ONNX graph for prefill and decode, checked against transformers.

The exporter is onnxruntime-genai's model builder (``onnxruntime_genai.models.builder``), run in this process
(the pipeline runs each stage in a child: ``model_factory.isolation``). It writes the graph the contract agrees
(GroupQueryAttention with rotary inside, past and present sharing one buffer, MatMulNBits for INT4/INT8). Why
it and not optimum's ``text-generation-with-past`` (same greedy tokens, but a cache that grows by concatenation
each step, FP32 batch-8 generate 53.6 tokens/s against the builder graph's 83.6 on one 116M Llama, and no INT4 of
its own) or torch's dynamo export (no fused attention, no in-place cache): measured on these machines
(docs/environment.md, "Exporters for decoders"), and the builder's graph is token-identical to transformers on all six
families here (tests/build/test_generative.py); its decode speed: benchmarks/RESULTS.md, "Text-generation graphs".

The check: on the golden prompts (held-out text, else fixed samples) the prefill logits' max abs error against
``transformers`` FP32 relative to the largest FP32 logit (at most ``export.tolerance``: :func:`relative_error`), and ``GOLDEN_TOKENS`` greedy tokens identical to ``generate(do_sample=False)`` up to the
first near-tie (top-two FP32 logit margin < 1e-3). Both go to ``export.json``; the torch continuations go to
``reference.json`` (the golden continuations packaging ships and the quantize gate compares with).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from model_factory.backend.contract import Files
from model_factory.build_engines.lm_graph import DecoderRunner, first_near_tie, head_dim_of, top_two_margin
from model_factory.errors import FactoryError, require
from model_factory.fileio import atomic_dir, digest_path
from model_factory.recipe import Recipe, read_hf_config

GOLDEN_TOKENS = 64
GOLDEN_PROMPTS = 4
PROMPT_TOKENS = 32
REFERENCE_FILE = "reference.json"
BUILDER_FILES = ("genai_config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
SAMPLE_PROMPTS = ("The license grants you the right to", "Permission is hereby granted, free of charge, to",
                  "This program is distributed in the hope that it will be useful,", "Copyright")


@dataclass(frozen=True)
class Continuation:
    """One golden prompt and the FP32 reference's greedy tokens (``near_tie``: first step of a near-tie)."""

    text: str | None
    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    near_tie: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "prompt_ids": list(self.prompt_ids), "tokens": list(self.tokens),
                "near_tie": self.near_tie}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Continuation":
        return cls(d.get("text"), tuple(d["prompt_ids"]), tuple(d["tokens"]), d.get("near_tie"))


def read_reference(export_dir: Path) -> tuple[Continuation, ...]:
    """The torch reference continuations the export stage wrote."""
    data = json.loads((Path(export_dir) / REFERENCE_FILE).read_text())
    return tuple(Continuation.from_dict(d) for d in data["prompts"])


def source_digest(folder: Path) -> str:
    """One sha256 over the folder's files (name and content), as the encoders' export records it."""
    import hashlib

    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + digest_path(p).encode())
    return h.hexdigest()


def builder_input(folder: Path, staging: Path) -> Path:
    """The folder the builder reads: ``folder``, or a staged view of it whose config the builder reads right.

    Phi-3 without ``rope_scaling`` but with ``original_max_position_embeddings`` different from
    ``max_position_embeddings`` is plain RoPE to transformers, but the builder then picks its LongRoPE
    variant and fails; the staged config sets both equal (the weights are links, not copies).
    """
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "phi3" or cfg.get("rope_scaling") or \
            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")) == \
            cfg.get("max_position_embeddings"):
        return folder
    staging.mkdir(parents=True, exist_ok=True)
    for p in folder.iterdir():
        if p.is_file() and p.name != "config.json":
            (staging / p.name).symlink_to(p.resolve())
    cfg["original_max_position_embeddings"] = cfg["max_position_embeddings"]
    (staging / "config.json").write_text(json.dumps(cfg, indent=2))
    return staging


def flatten_rope_for_builder(config: Any) -> Any:
    """The builder's copy of the config (the object it read, never the user's file) in the form it reads.

    transformers 5 nests ``rope_parameters`` by layer type (``{"full_attention": {...}, "sliding_attention":
    {...}}``) for models whose sliding and global layers have their own RoPE (Gemma 2/3); the builder reads one flat
    ``rope_parameters`` with a ``rope_type`` (``KeyError: 'rope_type'`` otherwise), ``rope_theta`` and, for Gemma 3,
    ``rope_local_base_freq``. Flattened here: the full-attention entry as ``rope_parameters`` / ``rope_theta``
    (``rope_scaling`` too), the sliding entry's base as ``rope_local_base_freq``. A 4.x-form config (flat already)
    is left as it is. Returns ``config``.
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_type" in params or not any(isinstance(v, dict) for v in params.values()):
        return config
    full = dict(params.get("full_attention") or next(v for v in params.values() if isinstance(v, dict)))
    local = params.get("sliding_attention")
    full.setdefault("rope_type", "default")
    config.rope_parameters = full
    if "rope_theta" in full:
        config.rope_theta = full["rope_theta"]
    if isinstance(local, dict) and "rope_theta" in local:
        config.rope_local_base_freq = local["rope_theta"]
    if hasattr(config, "rope_scaling"):
        try:
            config.rope_scaling = full
        except Exception:  # a config class whose rope_scaling is a read-only alias of rope_parameters
            pass
    return config


# The builder's execution provider for FP16 graphs (run_builder): the one whose graph has the shared-slot KV I/O.
FP16_EXECUTION_PROVIDER = "cuda"


def run_builder(folder: Path, out: Path, precision: str, options: Mapping[str, Any] | None = None,
                say: Callable[[str], None] = lambda _m: None, select_positions: bool = True) -> Path:
    """onnxruntime-genai's builder: ``folder`` → ``out/model.onnx`` (+ ``.data``) at ``precision`` (a GPT-2, which the
    builder does not know, through :func:`build_engines.gpt2_graph.build_gpt2`, with the same I/O and node names).

    FP32, INT8 and INT4 are the builder's CPU graphs. FP16 is its CUDA graph (``FP16_EXECUTION_PROVIDER``): its CPU
    FP16 graph takes position ids and grows its cache by concatenation, not the shared-slot I/O the backend runs,
    while the CUDA one has that I/O with FP16 weights and caches, and ONNX Runtime's CPU provider runs it too (the
    gate scores it there). Its Q/K norms (Qwen3) are left as their own nodes: the fused form runs on CUDA only.
    ``options`` are the builder's extra options (``block_size``, ``algo_config``, ``nodes_to_exclude``, ...).
    Its chatter goes to ``out/builder.log``; a failure is a FactoryError with the log's tail. The graph then
    computes logits only where ``logits_positions`` asks (:mod:`build_engines.logits_positions`;
    ``select_positions=False`` leaves the builder's graph as it wrote it).
    """
    if read_hf_config(Path(folder)).get("model_type") == "gpt2":  # the builder has no GPT-2: written here
        from model_factory.build_engines.gpt2_graph import build_gpt2

        build_gpt2(Path(folder), out, precision, options)
        (out / "builder.log").write_text(f"GPT-2: build_engines.gpt2_graph, {precision}\n")
    else:
        from model_factory.build_engines.attention_config import align_attention

        _model_builder(Path(folder), out, precision, options)
        align_attention(Path(folder), out / Files.ONNX, say)
    if select_positions:
        from model_factory.build_engines.logits_positions import select_logits_positions

        select_logits_positions(out / Files.ONNX)
    say(f"[export] builder wrote {precision} graph ({_size_mib(out):.1f} MiB)")
    return out / Files.ONNX


def _model_builder(folder: Path, out: Path, precision: str, options: Mapping[str, Any] | None) -> None:
    """onnxruntime-genai's model builder on ``folder`` (run_builder's every family but GPT-2)."""
    require("onnxruntime_genai", "export")
    from onnxruntime_genai.models import builder

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out.mkdir(parents=True, exist_ok=True)
    cache = out.parent / f".{out.name}.cache"
    src = builder_input(Path(folder), out.parent / f".{out.name}.input")
    provider = FP16_EXECUTION_PROVIDER if precision == "fp16" else "cpu"
    # windowed_kv_cache off: a sliding-window layer keeps its cache in the shared max-length slots as every other
    # layer does (the builder's default gives it a window-sized ring of its own, another I/O than the contract's).
    defaults = {"hf_token": "false", "windowed_kv_cache": "false",
                **({"fuse_qk_norm_gqa": "false"} if provider != "cpu" else {})}
    extra = [f"{k}={v}" for k, v in {**defaults, **(options or {})}.items()]
    log = io.StringIO()
    import logging

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # one INFO line per node otherwise
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            opts = builder.parse_extra_options(None, str(src), str(out), precision, provider, str(cache), extra)
            flatten_rope_for_builder(opts["hf_details"]["hf_config"])
            builder.create_model(None, str(src), str(out), precision, provider, str(cache), **opts)
    except Exception as exc:  # the builder raises bare Exceptions; its log says why
        (out / "builder.log").write_text(log.getvalue())
        tail = " | ".join(log.getvalue().strip().splitlines()[-3:])
        raise FactoryError(f"onnxruntime-genai's model builder failed on {folder} ({precision}): {exc} {tail}. "
                           "Fix: check that the folder loads with transformers' AutoModelForCausalLM") from None
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(out.parent / f".{out.name}.input", ignore_errors=True)
        # The builder leaves its model in reference cycles: the source's weights (mapped) and its working copies
        # stay until Python's collector runs, which a few huge tensors never trigger. Measured on a 1.04B Llama:
        # a second INT4 build (the gate's ladder) started with the first's 6 GiB still held; collected here, each
        # run starts from what the stage holds (benchmarks/RESULTS.md, bench_generative_large).
        gc.collect()
    (out / "builder.log").write_text(log.getvalue())


def _size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.glob("model.onnx*")) / 2**20


def golden_texts(recipe: Recipe) -> tuple[str, ...]:
    """The golden prompts' texts: the first held-out lines, else fixed samples (an FP32-only recipe has no data)."""
    q = recipe.quantization
    if q.heldout_data is None and q.calibration_data is None:
        return SAMPLE_PROMPTS
    from model_factory.build_engines.calibration import split_data

    held = split_data(q, need_calibration=False).heldout
    texts = [t for t in held.texts if isinstance(t, str) and t.strip()]
    return tuple(texts[:GOLDEN_PROMPTS]) or SAMPLE_PROMPTS


def load_torch_model(folder: Path) -> tuple[Any, Any]:
    """transformers' FP32 model and tokenizer from the folder (never its own code: trust_remote_code off)."""
    require("torch", "export")
    transformers = require("transformers", "export")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32", trust_remote_code=False)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    return model, tok


def prompt_ids(tok: Any, text: str, limit: int = PROMPT_TOKENS) -> tuple[int, ...]:
    ids = tok(text, add_special_tokens=True)["input_ids"][:limit]
    return tuple(int(i) for i in ids) or (int(tok.bos_token_id or 0),)


def torch_continuations(model: Any, tok: Any, texts: Sequence[str], eos: Sequence[int],
                        new_tokens: int = GOLDEN_TOKENS) -> tuple[tuple[Continuation, ...], list[np.ndarray]]:
    """``generate(do_sample=False, min_new_tokens=new_tokens)`` per prompt, and each prompt's prefill logits."""
    import torch

    out, prefill = [], []
    with torch.no_grad():
        for text in texts:
            ids = prompt_ids(tok, text)
            x = torch.tensor([ids])
            prefill.append(model(x).logits[0].float().numpy())
            g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                               eos_token_id=list(eos), pad_token_id=int(eos[0]))
            tokens = tuple(int(t) for t in g.sequences[0, len(ids):])
            margins = [top_two_margin(step[0].float().numpy()) for step in g.logits]
            out.append(Continuation(text, ids, tokens, first_near_tie(margins)))
    return tuple(out), prefill


def check_graph(onnx_path: Path, head_dim: int, reference: Sequence[Continuation], prefill: Sequence[np.ndarray],
                eos: Sequence[int]) -> dict[str, Any]:
    """The graph vs the torch reference: prefill logits' max abs error, greedy tokens up to the first near-tie."""
    runner = DecoderRunner(onnx_path, max(len(c.prompt_ids) + len(c.tokens) for c in reference), head_dim)
    err, scale, rows = 0.0, 0.0, []
    for c, ref_logits in zip(reference, prefill):
        err = max(err, float(np.max(np.abs(runner.logits(c.prompt_ids) - ref_logits))))
        scale = max(scale, float(np.max(np.abs(ref_logits))))
        got = runner.greedy(c.prompt_ids, len(c.tokens), suppress=eos)
        upto = len(c.tokens) if c.near_tie is None else c.near_tie
        first_diff = next((i for i, (a, b) in enumerate(zip(got, c.tokens)) if a != b), None)
        rows.append({"prompt_tokens": len(c.prompt_ids), "near_tie": c.near_tie, "first_difference": first_diff,
                     "identical_up_to_near_tie": first_diff is None or first_diff >= upto})
    return {"max_abs_logits_error": err, "max_abs_logit": scale, "relative_logits_error": relative_error(err, scale),
            "greedy_tokens": len(reference[0].tokens) if reference else 0,
            "prompts": rows, "greedy_identical": all(r["identical_up_to_near_tie"] for r in rows)}


def relative_error(err: float, scale: float) -> float:
    """The logits' max abs error over their largest magnitude (what ``export.tolerance`` bounds for text generation).

    Logits are unnormalised scores whose scale is the model's: a tiny random model's stay below 1, a real one's reach
    tens (Gemma 3 270M: about 30 on these prompts), and float32's rounding over 18 layers grows with them. An
    absolute bound of 1e-3 refused a correct Gemma 3 graph (0.00182 off, every greedy token identical) that this
    bound passes by a wide margin; a wrong graph (a missed window, unscaled RoPE) is off by whole units, and the
    greedy-token check judges it anyway."""
    return err / scale if scale > 0 else err


def export_causal_lm(recipe: Recipe, out_dir: Path | None = None,
                     progress: Callable[[str], None] | None = None) -> Any:
    """The export stage for ``task = "text-generation"``: ``export/model.onnx`` (+ data), tokenizer, checks."""
    from model_factory.build_engines.export_result import ExportResult

    from model_factory.recipe.gguf import converted

    say = progress or (lambda _m: None)
    recipe = converted(recipe)
    out_dir = Path(out_dir or recipe.work_dir / "export")
    src = recipe.source.path
    gen = recipe.generation
    assert src is not None and gen is not None
    with atomic_dir(out_dir) as tmp:
        onnx_path = run_builder(src, tmp / "graph", "fp32", say=say)
        for p in (tmp / "graph").iterdir():
            shutil.move(str(p), tmp / p.name)
        (tmp / "graph").rmdir()
        tok_dir = tmp / Files.TOKENIZER_DIR
        tok_dir.mkdir()
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tok_dir / name)
        for name in TOKENIZER_FILES:
            if (tmp / name).is_file():
                (tmp / name).unlink()  # the builder's copies: the tokenizer folder holds the model's own
        say(f"[export] reference: transformers greedy {GOLDEN_TOKENS} tokens on {len(golden_texts(recipe))} prompts")
        model, tok = load_torch_model(src)
        reference, prefill = torch_continuations(model, tok, golden_texts(recipe), gen.eos_token_ids)
        del model
        check = check_graph(tmp / Files.ONNX, head_dim_of(read_hf_config(src)), reference, prefill, gen.eos_token_ids)
        err, rel = check["max_abs_logits_error"], check["relative_logits_error"]
        if not np.isfinite(err) or rel > recipe.export.tolerance:
            raise FactoryError(f"the exported graph's logits differ from transformers by {err:.3g} (max abs), "
                               f"{rel:.3g} of the largest logit {check['max_abs_logit']:.3g}, over the tolerance "
                               f"{recipe.export.tolerance:g} (relative for text generation). Fix: raise "
                               "export.tolerance if this is acceptable, or report the family to the factory's "
                               "maintainers")
        if not check["greedy_identical"]:
            bad = next(r for r in check["prompts"] if not r["identical_up_to_near_tie"])
            raise FactoryError(f"the exported graph's greedy tokens differ from transformers at step "
                               f"{bad['first_difference']} (before any near-tie). Fix: report the family "
                               f"({gen.family}) to the factory's maintainers; it cannot be served as is")
        # A gguf source's digest is the GGUF file's sha256 (the folder is only its reading).
        digest = digest_path(recipe.source.gguf) if recipe.source.gguf is not None else source_digest(src)
        names = _io_names(tmp / Files.ONNX)
        (tmp / REFERENCE_FILE).write_text(json.dumps({"source": "transformers generate(do_sample=False)",
                                                      "max_tokens": GOLDEN_TOKENS,
                                                      "prompts": [c.to_dict() for c in reference]}, indent=2))
        (tmp / Files.EXPORT_REPORT).write_text(json.dumps({
            **({"exporter": "model-factory gpt2_graph", "exporter_version": _version("model-factory")}
               if gen.family == "gpt2" else
               {"exporter": "onnxruntime-genai model builder", "exporter_version": _version("onnxruntime-genai")}),
            "family": gen.family, "max_abs_error": err, "relative_error": rel, "tolerance": recipe.export.tolerance,
            "tolerance_kind": "relative: max abs logits error / max abs FP32 logit",
            "source_digest": digest, "opset": _opset(tmp / Files.ONNX), "inputs": names[0], "outputs": names[1],
            "check": check}, indent=2))
        say(f"[export] max abs logits error vs transformers {err:.3g} ({rel:.3g} of the largest logit); greedy {GOLDEN_TOKENS} tokens identical up to "
            "the first near-tie on every prompt")
    return ExportResult(onnx_path=out_dir / Files.ONNX, max_abs_error=err, tolerance=recipe.export.tolerance,
                        tokenizer_dir=out_dir / Files.TOKENIZER_DIR, source_digest=digest,
                        opset=_opset(out_dir / Files.ONNX), input_names=tuple(names[0]), output_names=tuple(names[1]))


def _io_names(path: Path) -> tuple[list[str], list[str]]:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return [i.name for i in m.graph.input], [o.name for o in m.graph.output]


def _opset(path: Path) -> int:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=0)


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
