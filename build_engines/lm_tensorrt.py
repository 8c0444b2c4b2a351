"""TensorRT engines of a text-generation model: a standard-op ONNX export, checked, and a plan with two profiles.

The serving graph (``causal_lm``: onnxruntime-genai's builder) uses ONNX Runtime's ``GroupQueryAttention``, which
TensorRT's ONNX parser does not have (TensorRT-RTX 1.7 refuses it). For TensorRT the model is exported again with
``torch.onnx`` (the dynamo exporter, ``torch.export`` underneath) from ``transformers``' own modules: attention
as MatMul / Softmax, the KV cache as explicit tensors, the contract's ``KV_LAYOUT_CONCAT`` I/O
(``backend/contract.py``): the past ``[batch, kv_heads, past, head_dim]`` in, the past with the new tokens appended
out, and the LM head applied only at ``logits_positions`` (as in the serving graph). The export is checked before
any engine is built: the golden prompts are prefilled and decoded greedily through it (ONNX Runtime, the KV cache
carried from step to step) and must give the FP32 reference's tokens up to its first near-tie, and the prefill's
logits must be within ``export.tolerance`` of ``transformers``.

Plans: FP32, and FP16 / INT8 / INT4 where the recipe asks for them: the same graph in half precision (weights,
activations, KV cache and logits; normalisations and softmax in float32), or as weight-only Q/DQ
(``lm_weight_only``: FP32 activations, integer weights behind DequantizeLinear), each checked through ONNX Runtime
against the reference before its plan is built: below ``quantization.min_token_agreement`` (teacher-forced
agreement) that plan is not built, said in one line. Each plan is strongly typed (precision from the graph), with one optimization profile for prefill
(``new_tokens`` 1..max_context, no past) and one for decode (``new_tokens`` 1, past 1..max_context - 1), over
batch 1..``shapes.max_batch`` (prefill: up to 8 rows). The build goes through ``tensorrt.build_engine`` (the only
module that imports TensorRT); the plan's metadata names both profiles. No runner serves it yet: the backend's
generative path is ONNX Runtime's on the CPU, and TensorRT-RTX plans need an RTX GPU to run.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from model_factory.backend.contract import (ATTENTION_MASK, INPUT_IDS, LOGITS, LOGITS_POSITIONS, POSITION_IDS,
                                            plan_file, past_name, present_name)
from model_factory.build_engines.causal_lm import Continuation, load_torch_model, read_reference
from model_factory.errors import FactoryError
from model_factory.fileio import atomic_dir
from model_factory.recipe import Recipe

EXPORT_NAME = "model.tensorrt.onnx"  # the standard-op graph the plans are built from (in the engines folder)
PREFILL_MAX_BATCH = 8  # a prefill profile past this would size its activations for batch x max_context tokens
CHECK_TOKENS = 16  # greedy tokens per golden prompt checked through the exported graph


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of the TensorRT graph, in order."""
    pasts = [past_name(i, k) for i in range(num_layers) for k in ("key", "value")]
    presents = [present_name(i, k) for i in range(num_layers) for k in ("key", "value")]
    return [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS_POSITIONS, *pasts], [LOGITS, *presents]


def _kv_geometry(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head size) of a transformers config (the head size as the serving graph's export reads
    it: ``lm_graph.head_dim_of``)."""
    from model_factory.build_engines.lm_graph import head_dim_of

    from model_factory.recipe.huggingface import _OWN_NAMES

    d = config.to_dict()
    for standard, own in _OWN_NAMES:  # GPT-2's own names, as read_hf_config adds them
        if standard not in d and own in d:
            d[standard] = d[own]
    return int(d["num_hidden_layers"]), int(d.get("num_key_value_heads") or d["num_attention_heads"]), head_dim_of(d)


def _wrapper(model: Any, num_layers: int) -> Any:
    import torch
    from transformers import DynamicCache

    softcap = getattr(model.config, "final_logit_softcapping", None)

    class Decoder(torch.nn.Module):
        """The causal LM with its KV cache as tensors: (logits at the asked positions, presents)."""

        def __init__(self) -> None:
            super().__init__()
            self.base, self.head = model.base_model, model.get_output_embeddings()

        def forward(self, input_ids, attention_mask, position_ids, logits_positions, *past):
            cache = DynamicCache()
            for i in range(num_layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=cache, use_cache=True)
            hidden = out.last_hidden_state
            picked = torch.gather(hidden, 1, logits_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            logits = self.head(picked)
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            presents = []
            for layer in out.past_key_values.layers[:num_layers]:
                presents += [layer.keys, layer.values]
            return (logits, *presents)

    return Decoder().eval()


def export_for_tensorrt(folder: Path, out: Path, max_context: int, max_batch: int,
                        say: Callable[[str], None] = lambda _m: None) -> tuple[Path, Any]:
    """``out`` (+ ``.data``): the standard-op graph of the HF causal-LM ``folder``; returns (path, torch model)."""
    import torch

    model, _tok = load_torch_model(folder)
    layers, kv, head_dim = _kv_geometry(model.config)
    b, s, p = 2, 3, 4  # example shapes: every axis that varies must differ here (torch.export specializes 1s)
    args = (torch.ones(b, s, dtype=torch.long), torch.ones(b, p + s, dtype=torch.long),
            torch.arange(p, p + s).expand(b, s).contiguous(), torch.tensor([[s - 2, s - 1]] * b),
            *[torch.zeros(b, kv, p, head_dim) for _ in range(2 * layers)])
    dim = torch.export.Dim
    batch, new = dim("batch", max=max(max_batch, 2)), dim("new_tokens", max=max_context)
    past, total = dim("past_tokens", max=max_context), dim("total_tokens", max=2 * max_context)
    asked = dim("positions", max=max_context)
    shapes = ({0: batch, 1: new}, {0: batch, 1: total}, {0: batch, 1: new}, {0: batch, 1: asked},
              tuple({0: batch, 2: past} for _ in range(2 * layers)))
    inputs, outputs = io_names(layers)
    say(f"[build-engine] exporting a standard-op graph for TensorRT (torch.onnx, {layers} layers)")
    t0 = time.perf_counter()
    quiet = [logging.getLogger(n) for n in ("onnxscript", "torch.onnx", "torch.export", "torch._dynamo")]
    levels = [q.level for q in quiet]
    try:
        for q in quiet:  # their INFO lines (one per rewrite) would bury the build's own
            q.setLevel(logging.WARNING)
        torch.onnx.export(_wrapper(model, layers), args, str(out), input_names=inputs, output_names=outputs,
                          dynamo=True, dynamic_shapes=shapes, external_data=True, optimize=True, verbose=False)
    except Exception as exc:  # noqa: BLE001 - torch.export's errors are long; the first line names the cause
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FactoryError(f"torch.onnx could not export {folder} for TensorRT: {first}. Fix: set [tensorrt] "
                           "enabled = false for this model (its ONNX Runtime graphs still serve)") from None
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    say(f"[build-engine] exported in {time.perf_counter() - t0:.0f} s")
    return out, model


class ConcatRunner:
    """Runs the TensorRT graph with ONNX Runtime, one sequence, its KV cache carried from step to step."""

    def __init__(self, graph: Path) -> None:
        from model_factory.build_engines.ort_session import onnxruntime_session

        self.session = onnxruntime_session(graph)
        pasts = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values")]
        self.kv = {i.name: i.shape for i in pasts}
        self.kv_dtype = np.float16 if pasts and "float16" in pasts[0].type else np.float32  # FP16 graph: FP16 cache

    def start(self) -> list[np.ndarray]:
        return [np.zeros((1, int(shape[1]), 0, int(shape[3])), self.kv_dtype) for shape in self.kv.values()]

    def step(self, ids: Sequence[int], past: list[np.ndarray], all_positions: bool = False
             ) -> tuple[np.ndarray, list[np.ndarray]]:
        n, seen = len(ids), past[0].shape[2]
        positions = np.arange(n) if all_positions else np.array([n - 1])
        feeds = {INPUT_IDS: np.array([ids], np.int64), ATTENTION_MASK: np.ones((1, seen + n), np.int64),
                 POSITION_IDS: np.arange(seen, seen + n, dtype=np.int64)[None],
                 LOGITS_POSITIONS: positions.astype(np.int64)[None]}
        feeds.update(zip(self.kv, past))
        out = self.session.run(None, feeds)
        return np.asarray(out[0][0], np.float32), list(out[1:])


def check_export(graph: Path, model: Any, reference: Sequence[Continuation], tolerance: float,
                 tokens: int = CHECK_TOKENS) -> dict[str, Any]:
    """The exported graph against ``transformers`` (prefill logits) and the reference's greedy tokens."""
    import torch

    runner = ConcatRunner(graph)
    worst, prompts = 0.0, []
    for ref in reference:
        ids = list(ref.prompt_ids)
        logits, past = runner.step(ids, runner.start(), all_positions=True)
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
        worst = max(worst, float(np.abs(logits - want).max()))
        got: list[int] = []
        limit = min(tokens, len(ref.tokens), ref.near_tie if ref.near_tie is not None else len(ref.tokens))
        nxt = int(logits[-1].argmax())
        while len(got) < limit:
            got.append(nxt)
            step_logits, past = runner.step([nxt], past)
            nxt = int(step_logits[-1].argmax())
        same = got == list(ref.tokens[:limit])
        prompts.append({"prompt_tokens": len(ids), "checked_tokens": limit, "identical": same})
        if not same:
            first = next(i for i, (a, b) in enumerate(zip(got, ref.tokens)) if a != b)
            raise FactoryError(f"the TensorRT graph's greedy tokens differ from transformers at step {first} "
                               "(before any near-tie). Fix: set [tensorrt] enabled = false for this model and "
                               "report its family to the factory's maintainers")
    if not np.isfinite(worst) or worst > tolerance:
        raise FactoryError(f"the TensorRT graph's logits differ from transformers by {worst:.3g} (max abs), over the "
                           f"tolerance {tolerance:g}. Fix: raise export.tolerance if this is acceptable, or set "
                           "[tensorrt] enabled = false for this model")
    return {"max_abs_logits_error": worst, "tolerance": tolerance, "prompts": prompts}


class _PrefillLogits:
    """``lm_graph.teacher_forced_agreement``'s runner: the logits at every position of one prefill."""

    def __init__(self, runner: ConcatRunner) -> None:
        self.runner = runner

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        return self.runner.step(list(ids), self.runner.start(), all_positions=True)[0]


def half_precision(graph: Path, out: Path) -> dict[str, Any]:
    """Write ``out`` (+ ``.data``): ``graph`` in FP16 (:func:`fp16.convert_fp16_graph`: weights, activations, the KV
    cache and the logits in half precision; normalisations, softmax and reductions kept in float32 behind casts), the
    weights converted as they are streamed out. Returns what was done."""
    import onnx

    from model_factory.build_engines import onnx_files
    from model_factory.build_engines.fp16 import FP16_FLOAT_OPS, convert_fp16_graph

    model = onnx.load(str(graph), load_external_data=False)
    converted, convert = convert_fp16_graph(model, keep_io_types=False)
    onnx_files.save(converted, out, base_dir=Path(graph).parent, external=True, convert=convert)
    kept = sum(1 for n in converted.graph.node if n.op_type in FP16_FLOAT_OPS)
    return {"form": "fp16", "io": "float16 (KV cache and logits)", "float32_ops": kept}


def check_weight_only(graph: Path, fp32_graph: Path, reference: Sequence[Continuation], gate: float,
                      precision: str) -> dict[str, Any]:
    """A weight-only (or FP16) graph against the FP32 reference: teacher-forced greedy agreement on the golden prompts
    (the build's gate metric, up to each reference's first near-tie), ``passed`` when at least ``gate``, and its
    prefill logits' distance from the FP32 graph's."""
    from model_factory.build_engines.lm_graph import teacher_forced_agreement

    runner, fp32 = _PrefillLogits(ConcatRunner(graph)), _PrefillLogits(ConcatRunner(fp32_graph))
    agree = compared = 0
    worst = 0.0
    for ref in reference:
        a, n = teacher_forced_agreement(runner, ref.prompt_ids, ref.tokens, ref.near_tie)
        agree, compared = agree + a, compared + n
        worst = max(worst, float(np.abs(runner.logits(ref.prompt_ids) - fp32.logits(ref.prompt_ids)).max()))
    score = agree / max(compared, 1)
    return {"agreement": score, "compared_tokens": compared, "gate": gate, "passed": bool(score >= gate),
            "max_abs_logits_error_vs_fp32": worst}


def profiles(num_layers: int, kv_heads: int, head_dim: int, max_context: int, max_batch: int
             ) -> list[dict[str, Any]]:
    """The prefill and the decode optimization profiles of the TensorRT graph (``build_engine``'s form)."""
    def shapes(batch: int, new: int, past: int) -> dict[str, list[int]]:
        out = {INPUT_IDS: [batch, new], ATTENTION_MASK: [batch, past + new], POSITION_IDS: [batch, new],
               LOGITS_POSITIONS: [batch, 1]}
        for i in range(num_layers):
            for k in ("key", "value"):
                out[past_name(i, k)] = [batch, kv_heads, past, head_dim]
        return out

    prefill_batch = max(1, min(PREFILL_MAX_BATCH, max_batch))
    decode_opt = max(1, min(8, max_batch))
    plans = {"prefill": ((1, 1, 0), (1, min(128, max_context), 0), (prefill_batch, max_context, 0)),
             "decode": ((1, 1, 1), (decode_opt, 1, max_context // 2), (max_batch, 1, max_context - 1))}
    out = []
    for name, (lo, opt, hi) in plans.items():
        a, o, c = shapes(*lo), shapes(*opt), shapes(*hi)
        out.append({"name": name, "batch": [lo[0], hi[0]], "new_tokens": [lo[1], hi[1]], "past_tokens": [lo[2], hi[2]],
                    "inputs": {n: {"min": a[n], "opt": o[n], "max": c[n]} for n in a}})
    return out


def skipped_plan_line(precision: str, gate: Mapping[str, Any]) -> str:
    """The build's line for a weight-only or FP16 plan whose graph missed the gate (not built)."""
    form = "FP16 graph" if precision == "fp16" else "weight-only graph (round to nearest)"
    return (f"[build-engine] skipped: the {precision} TensorRT plan: its {form} agrees "
            f"with the FP32 reference on {gate['agreement']:.3f} of {gate['compared_tokens']} teacher-forced tokens, "
            f"below the gate {gate['gate']:g}; the {precision} ONNX Runtime graph keeps its own gate. Fix: lower "
            "quantization.min_token_agreement if this is acceptable")


def plan_precisions(precisions: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the plans built, the recipe's precisions that get none): FP32 always (the checked graph), FP16 (the graph in
    half precision), INT8 and INT4 (weight-only Q/DQ) where the recipe asks for them."""
    built = ["fp32"] + [p for p in ("fp16", "int8", "int4") if p in precisions]
    return built, [p for p in precisions if p not in built]


def build_lm_engines(recipe: Recipe, export_dir: Path, out_dir: Path | None = None,
                     progress: Callable[[str], None] | None = None) -> list[Any]:
    """The build-engine stage of ``task = "text-generation"``: ``engines/model.<precision>.plan`` (+ ``.json``) for
    FP32 and the recipe's FP16 (:func:`half_precision`) and INT8 / INT4 (weight-only, ``lm_weight_only``), each graph
    checked before its plan.

    ``export_dir`` is the export stage's folder (its reference continuations are what the graph is checked
    against). Written atomically: a failed export, check or build leaves no folder behind.
    """
    from model_factory.build_engines.lm_weight_only import weight_only_qdq
    from model_factory.build_engines.tensorrt import EngineResult, _trt, build_engine, visible_device

    say = progress or (lambda _m: None)
    _trt()  # no TensorRT: fail before the (slow) export
    from model_factory.recipe.gguf import converted

    recipe = converted(recipe)
    src, gen = recipe.source.path, recipe.generation
    assert src is not None and gen is not None
    out_dir = Path(out_dir or recipe.work_dir / "engines")
    max_context, max_batch = int(recipe.shapes.max_context or gen.max_positions), int(recipe.shapes.max_batch)
    cache = Path(recipe.tensorrt.timing_cache or recipe.work_dir / "timing.cache")
    wanted, without = plan_precisions(recipe.precisions)
    if without:
        say(f"[build-engine] no TensorRT plan for {', '.join(without)} (text generation: FP32, FP16, and INT8 / "
            "INT4 weight-only); its ONNX Runtime graph still serves")
    reference = read_reference(Path(export_dir))
    results = []
    with atomic_dir(out_dir) as tmp:
        graph, model = export_for_tensorrt(Path(src), tmp / EXPORT_NAME, max_context, max_batch, say)
        check = check_export(graph, model, reference, recipe.export.tolerance)
        say(f"[build-engine] TensorRT graph: max abs logits error vs transformers {check['max_abs_logits_error']:.3g}; "
            f"greedy tokens identical on {len(check['prompts'])} prompts")
        layers, kv, head_dim = _kv_geometry(model.config)
        del model
        shapes = profiles(layers, kv, head_dim, max_context, max_batch)
        for precision in wanted:
            source, extra = graph, {"export_check": check}
            if precision != "fp32":
                source = tmp / f"model.tensorrt.{precision}.onnx"
                if precision == "fp16":
                    form, label = half_precision(graph, source), "half_precision"
                else:
                    form = weight_only_qdq(graph, source, precision, recipe.quantization.int4_block_size)
                    label = "weight_only"
                gate = check_weight_only(source, graph, reference, recipe.quantization.min_token_agreement, precision)
                extra = {"export_check": check, label: {**form, **gate}}
                say(f"[build-engine] {precision} {'FP16' if precision == 'fp16' else 'weight-only'} graph: agreement "
                    f"{gate['agreement']:.3f} over {gate['compared_tokens']} tokens (gate {gate['gate']:g})")
                if not gate["passed"]:  # never a plan below the gate; the other plans and the ONNX graphs go on
                    say(skipped_plan_line(precision, gate))
                    for leftover in (source, source.with_name(source.name + ".data")):
                        leftover.unlink(missing_ok=True)
                    continue
            result = build_engine(precision, source, tmp / plan_file(precision), recipe, cache, visible_device(), say,
                                  profiles=shapes)
            meta = json.loads(result.metadata_path.read_text())
            meta.update({"task": "text-generation", "kv_layout": "concat", "exporter": "torch.onnx (dynamo)", **extra})
            result.metadata_path.write_text(json.dumps(meta, indent=2) + "\n")
            say(f"[build-engine] {precision}: {result.size_bytes / 2**20:.1f} MiB in {result.build_seconds:.1f} s "
                "(profiles: prefill, decode)")
            results.append(result)
            if source != graph:
                for leftover in (source, source.with_name(source.name + ".data")):
                    leftover.unlink(missing_ok=True)
        for leftover in (tmp / EXPORT_NAME, tmp / (EXPORT_NAME + ".data")):
            leftover.unlink(missing_ok=True)  # the plan holds the weights; the graph is rebuilt from the source
    return [EngineResult(r.precision, out_dir / r.plan_path.name, out_dir / r.metadata_path.name, r.build_seconds,
                         r.size_bytes) for r in results]


def build_lm_engines_existing(recipe: Recipe, progress: Callable[[str], None] | None = None) -> list[Any]:
    """``model-factory build-engine`` on a text-generation recipe: the plan from its folder, checked against the
    reference continuations the export stage left in the work dir."""
    from model_factory.build_engines.causal_lm import REFERENCE_FILE

    export_dir = Path(recipe.work_dir) / "export"
    if not (export_dir / REFERENCE_FILE).is_file():
        raise FactoryError(f"{export_dir / REFERENCE_FILE} is missing: the TensorRT graph is checked against the "
                           "export stage's reference continuations. Fix: run model-factory export RECIPE first")
    return build_lm_engines(recipe, export_dir, progress=progress)
