"""Quantize stage of a text-generation model: FP16 / INT8 / INT4 graphs, gated on the customer's text.

FP16 is the model builder's FP16 graph (weights, activations and the KV cache in half precision; the builder's
CUDA graph, the one with the shared-slot KV I/O: :func:`build_engines.causal_lm.run_builder`), scored on this CPU
like the others; it has no wider step to climb (the GPU's precision: on the CPU, ONNX Runtime runs it slower than
FP32).

INT8 has two methods (``quantization.int8_method``). ``weight_only``, the default, is the model builder's
``MatMulNBits`` with 8-bit weights, its activations quantized to int8 per block of each row inside the kernel
(``ACCURACY_LEVEL``): every sequence's output independent of the others in its batch, and faster than FP32 (with
float activations its CPU kernel dequantized every weight on every call: 0.3 tokens/s on Gemma 3 270M). ``dynamic`` is ONNX
Runtime's dynamic quantization of the FP32 graph's MatMuls (``DynamicQuantizeLinear`` + ``MatMulInteger``, fused
into ``MatMulIntegerToFloat`` when the session loads): weights int8 per output channel, activations quantized per
tensor as each step runs, products in the integer kernels (VNNI where the CPU has it). About twice FP32's speed,
but one activation scale covers all the rows of a step, so a sequence's output depends on what it is batched
with: measured on a trained Llama, 15 and 16 of 16 greedy continuations batched differed from the same prompts
alone in two runs (FP32, FP16, weight-only INT8 and INT4: none). It is opt-in for that reason
(benchmarks/RESULTS.md: bench_generative_quant, bench_generate_graphs). INT4 is ``MatMulNBits``, block-wise; its
kernel quantizes the activations to int8 per block of each row (``ACCURACY_LEVEL``), so no row touches another's.
Its weights are the Hugging Face ones (``rtn``) or scaled first (``awq``, :mod:`build_engines.awq`), then written by
the factory (:mod:`build_engines.lm_blockwise`: zero points, scales searched on the calibration activations, GPTQ,
the embedding at 8 bits; ``int4_symmetric = false``, the default) or rounded to nearest symmetrically by the builder
(``int4_symmetric = true``); or ONNX Runtime's ``k_quant`` through the builder.

The gate, on the held-out text (never the calibration text): the perplexity under the precision divided by
FP32's (at most ``max_perplexity_ratio``) and the teacher-forced greedy agreement with the FP32 reference
continuations up to their first near-tie (at least ``min_token_agreement``). A precision that misses it is
built again with its most sensitive MatMuls wider, as the encoders keep their most harmful nodes in float: INT4's
at INT8 (the LM head, then llama.cpp's Q4_K_M layers: the builder's ``matmul_mixed_precision`` selectors, which
:func:`lm_blockwise.wide_nodes` reads the same way; with the factory's writer a step refits the blocks only); dynamic INT8's in
float (``DYNAMIC_STEPS``), then weight-only INT8. One that still misses fails the build, and ``accuracy.json``
says by how much.
"""

from __future__ import annotations

import io
import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from model_factory.backend.contract import Files, onnx_file
from model_factory.build_engines.causal_lm import Continuation, prompt_ids, read_reference, run_builder
from model_factory.build_engines.lm_blockwise import BlockwiseInput
from model_factory.build_engines.lm_graph import DecoderRunner, head_dim_of, teacher_forced_agreement
from model_factory.build_engines.row_int8 import ROW_DOWN, ROW_GROUP
from model_factory.build_engines.smooth import SMOOTH_DOWN
from model_factory.fileio import atomic_dir, atomic_file
from model_factory.recipe import Recipe, read_hf_config

REPORT_NAME = "accuracy.json"
CARRY_REPORT = "gguf_carry.json"  # precision gguf: each MatMul's GGUF parts, form and error (gguf_carry.py)
PPL_TOKENS = 128  # tokens per held-out sample scored for perplexity
CALIBRATION_TOKENS = 128
# Families whose INT4 is rounded to nearest even when awq is asked: the scaling folds into modules they lay out
# otherwise (GPT-2's fused Conv1D c_attn / c_fc behind LayerNorms with a bias).
AWQ_UNSUPPORTED = frozenset({"gpt2"})
# The ladder a precision that misses the gate climbs: each step keeps more MatMuls at INT8.
MIXED_STEPS = ((), ("last_matmul:int8",), ("last_matmul:int8", "mixed_layers:int8"))
# The precisions whose graphs keep their KV cache in INT8 when the recipe asks (quantization.kv_cache = "int8"):
# FP32 stays the reference, FP16 the GPU's graph.
KV_INT8_PRECISIONS = ("int8", "int4", "gguf")


@dataclass(frozen=True)
class GenerativeResult:
    """One precision against FP32 on the held-out text."""

    precision: str
    method: str
    score: float  # greedy token agreement (the report's main figure)
    perplexity: float
    perplexity_fp32: float
    perplexity_ratio: float
    max_abs_error: float  # prefill logits vs FP32 on the golden prompts
    samples: int
    compared_tokens: int
    passed: bool
    int8_matmuls: tuple[str, ...] = ()  # INT4: matmul_mixed_precision selectors kept at INT8
    weights_bytes: int = 0
    metric: str = "token_agreement"
    float_matmuls: tuple[str, ...] = ()  # dynamic INT8: the parts (down_proj, o_proj) kept in float
    kv_cache: str = "float"  # "int8": the graph keeps its KV cache in INT8 (kv_int8.py), scored so
    # One stream's greedy decode on this build machine (SPEED_TOKENS after a golden prompt, best of two), and FP32's
    # timed beside it, in the gate's table (not in accuracy.json: timings are not reproducible): a precision slower
    # than FP32 is visible before it is served (INT8 with float activations
    # decoded Gemma 3 270M 20x slower than FP32 and nothing said so).
    tokens_per_s: float = 0.0
    tokens_per_s_fp32: float = 0.0
    # The same at SPEED_ROWS streams (one decode launch of that many rows): where a precision's kernel does not scale
    # with the batch (8-bit MatMulNBits on a CPU without VNNI: 1.5x FP32's time at 32 rows, faster at one) the one
    # stream figure alone would not show it.
    tokens_per_s_rows: float = 0.0
    tokens_per_s_rows_fp32: float = 0.0
    weights: str = ""  # INT4 written by lm_blockwise: how its blocks were fitted (zero points, the search)
    smoothed: tuple[str, ...] = ()  # dynamic INT8: the MatMuls whose input was smoothed first (build_engines/smooth.py)
    per_row: tuple[str, ...] = ()  # dynamic INT8: the MatMuls whose activations have a scale per row (row_int8.py)

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        # The speeds are this build machine's timings: said in the gate's table, kept out of the signed accuracy.json
        # (and metadata.json), whose bytes ``rebuild --check`` compares.
        for timed in ("tokens_per_s", "tokens_per_s_fp32", "tokens_per_s_rows", "tokens_per_s_rows_fp32"):
            d.pop(timed)
        d["extra"] = {"perplexity_ratio": self.perplexity_ratio}
        d["float_nodes"] = list(self.int8_matmuls or self.float_matmuls)
        return d


@dataclass(frozen=True)
class GenerativeAccuracy:
    """``accuracy.json`` of a text-generation model (read by the report's accuracy section)."""

    model: str
    heldout_source: str
    heldout_samples: int
    heldout_note: str
    calibration_source: str | None
    calibration_samples: int
    min_accuracy: float  # the agreement gate
    max_perplexity_ratio: float
    results: tuple[GenerativeResult, ...] = ()
    search: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)
    task: str = "text-generation"
    output: str = "logits"
    calibration_method: str | None = None
    scoring: str = ("ONNX Runtime CPU (MatMulNBits, MatMulIntegerToFloat: the kernels that serve); agreement "
                    "teacher-forced on the FP32 greedy continuations up to their first near-tie")

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("results", "search")}
        d["results"] = [r.row() for r in self.results]
        d["search"] = [dict(s) for s in self.search]
        d["passed"] = self.passed
        return d

    def write(self, path: Path) -> Path:
        with atomic_file(path) as f:
            json.dump(self.to_dict(), f, indent=2, allow_nan=False)
            f.write("\n")
        return path

    def render(self, width: int = 110) -> str:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"Accuracy of {self.model} vs FP32 ({self.heldout_samples} held-out samples)",
                      title_justify="left")
        for col in ("precision", "method", "agreement", "perplexity", "ppl ratio", "max abs err", "kept wider",
                    "tokens/s", "gate"):
            table.add_column(col)
        for r in self.results:
            table.add_row(r.precision, r.method + (" + kv int8" if r.kv_cache == "int8" else ""), f"{r.score:.4f}", f"{r.perplexity:.3f}", f"{r.perplexity_ratio:.4f}",
                          f"{r.max_abs_error:.3g}", _wider(r), _speed(r), "pass" if r.passed else "FAIL")
        console = Console(file=io.StringIO(), width=width, record=True, color_system=None, force_terminal=False)
        console.print(table)
        console.print(f"held-out: {self.heldout_note}; gate: agreement >= {self.min_accuracy:g} and perplexity ratio "
                      f"<= {self.max_perplexity_ratio:g} -> {'passed' if self.passed else 'FAILED'}",
                      highlight=False, markup=False, soft_wrap=True)
        return "\n".join(line.rstrip() for line in console.export_text().rstrip().splitlines())


def _speed(r: GenerativeResult) -> str:
    if not r.tokens_per_s:
        return "-"
    one = f"{r.tokens_per_s:.1f} (fp32 {r.tokens_per_s_fp32:.1f})"
    return one + (f"; {SPEED_ROWS} streams {r.tokens_per_s_rows:.0f} (fp32 {r.tokens_per_s_rows_fp32:.0f})"
                  if r.tokens_per_s_rows else "")


def _wider(r: GenerativeResult) -> str:
    if r.smoothed or r.per_row:
        parts = [("smoothed", r.smoothed), ("per row", r.per_row), ("float", r.float_matmuls)]
        return ", ".join(f"{k}: " + ",".join(v) for k, v in parts if v)
    if r.int8_matmuls:
        return "int8: " + ",".join(r.int8_matmuls)
    return "float: " + ",".join(r.float_matmuls) if r.float_matmuls else "-"


@dataclass(frozen=True)
class GenerativeQuantizeResult:
    """What the quantize stage produced (the pipeline reads it as the encoders' QuantizeResult)."""

    models: dict[str, Path]  # precision -> ONNX file ("fp32" is the export's own file)
    report: GenerativeAccuracy
    report_path: Path
    float_nodes: tuple[str, ...]  # INT4's matmul_mixed_precision selectors kept at INT8, dynamic INT8's kept in float
    calibration_digest: str | None


SPEED_TOKENS = 16
SPEED_ROWS = 32  # the batched figure: a decode launch of this many streams (bench_generate's highest level)


def decode_tokens_per_s(runner: DecoderRunner, prompt: Sequence[int], tokens: int = SPEED_TOKENS) -> float:
    """One stream's greedy tokens per second after ``prompt`` (prefill excluded: timed from the first decode step),
    best of two runs."""
    import time

    best = float("inf")
    for _ in range(2):
        runner.greedy(prompt, 1)
        start = time.perf_counter()
        runner.greedy(prompt, tokens + 1)
        best = min(best, time.perf_counter() - start)
    prefill = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        runner.greedy(prompt, 1)
        prefill = min(prefill, time.perf_counter() - start)
    return tokens / max(best - prefill, 1e-9)


class Scorer:
    """FP32's perplexity and logits on the held-out text, kept to score each candidate against."""

    def __init__(self, fp32: Path, head_dim: int, heldout: Sequence[Sequence[int]],
                 reference: Sequence[Continuation]) -> None:
        self.head_dim, self.heldout, self.reference = head_dim, heldout, reference
        self.context = max([len(c.prompt_ids) + len(c.tokens) for c in reference] + [len(h) for h in heldout])
        runner = DecoderRunner(fp32, self.context, head_dim)
        self.ppl_fp32 = self._perplexity(runner)
        self.prompt_logits = [runner.logits(c.prompt_ids) for c in reference]
        self.fp32 = Path(fp32)
        self.last_tokens_per_s = 0.0

    def speed(self, path: Path, rows: int = SPEED_ROWS) -> tuple[float, float, float, float]:
        """Tokens/s of ``path`` and FP32's (timed one after the other on this machine) decoding one stream, then in one
        decode launch of ``rows`` streams after a golden prompt's length of context: (one, FP32's, rows', FP32's)."""
        prompt = self.reference[0].prompt_ids if self.reference else (0,)
        cached = min(len(prompt), self.context - 1)
        out = []
        for graph in (path, self.fp32):
            runner = DecoderRunner(graph, self.context, self.head_dim)
            out.append((decode_tokens_per_s(runner, prompt), rows / runner.decode_launch(rows, cached)[0]))
        (one, one_fp32), (many, many_fp32) = zip(*out)
        return one, one_fp32, many, many_fp32

    def _perplexity(self, runner: DecoderRunner) -> float:
        total = count = 0.0
        for ids in self.heldout:
            nll, n = runner.token_nll(ids)
            total, count = total + nll, count + n
        return math.exp(total / max(count, 1))

    def score(self, path: Path) -> tuple[float, float, float, int]:
        """(agreement, perplexity, max abs logits error, compared tokens) of one candidate graph."""
        import numpy as np

        runner = DecoderRunner(path, self.context, self.head_dim)
        agree = compared = 0
        err = 0.0
        for c, ref in zip(self.reference, self.prompt_logits):
            a, n = teacher_forced_agreement(runner, c.prompt_ids, c.tokens, c.near_tie)
            agree, compared = agree + a, compared + n
            err = max(err, float(np.max(np.abs(runner.logits(c.prompt_ids) - ref))))
        return agree / max(compared, 1), self._perplexity(runner), err, compared


def weights_bytes(graph: Path) -> int:
    """Bytes of a graph's weights: its initializers (external data and inline)."""
    import onnx

    m = onnx.load(str(graph), load_external_data=False)
    total = 0
    for t in m.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        total += int(ext["length"]) if "length" in ext else len(t.raw_data)
    return total


# Dynamic INT8's ladder: the MatMuls each step keeps in float (by the builder's node names, /model/layers.N/<part>/...).
# The down and o projections' inputs are the widest-ranging activations: keeping them in float raised agreement most
# (a trained Llama 0.941 -> 0.961 -> 0.965 in one run of bench_generative_quant, 0.945 -> 0.971 -> 0.969 in another;
# a random Qwen2 0.72 -> 0.77 -> 0.78); the LM
# head changed nothing.
# Before down_proj goes to float, all INT8 with its activations scaled per row and per ``ROW_GROUP`` inputs
# (``ROW_DOWN``, :mod:`build_engines.row_int8`), then the same with its input smoothed first (``SMOOTH_DOWN``,
# :mod:`build_engines.smooth`: SmoothQuant's per-channel scales folded into up_proj and down_proj; where the MLP is
# gated and calibration text was given, else that step is left out). On Gemma 3 270M (bench_gemma_accuracy): all
# INT8 ratio 1.288, smoothed 1.215, per row 1.121, smoothed and per row 1.118, per row and per 256 inputs 1.081 (the
# first of the two steps, which passes; per 128 1.089), down_proj in float 1.0998 (the gate 1.10).
DYNAMIC_STEPS: tuple[tuple[str, ...], ...] = ((), (ROW_DOWN,), (SMOOTH_DOWN, ROW_DOWN), ("down_proj",),
                                              ("down_proj", "o_proj"))


def dynamic_int8(fp32: Path, out: Path, keep_float: Sequence[str] = (), seven_bit: bool = True) -> Path:
    """Write ``out/model.onnx`` (+ ``.data``): ``fp32``'s MatMuls quantized dynamically, ``keep_float`` parts left.

    Weights are 7-bit (ONNX Runtime's ``reduce_range``: symmetric, in [-64, 64]): on a CPU without VNNI, MLAS
    multiplies u8 activations by s8 weights with ``vpmaddubsw``, which sums each pair into a saturating int16.
    8-bit weights could reach 2·255·127 = 64770 there, these at most 2·255·64 = 32640 < 32767: the one signed graph
    is right on every x86 CPU (the encoders' 7-bit form, :mod:`build_engines.int8_7bit`, for the same reason).
    ``seven_bit=False`` (8-bit weights, wrong on such CPUs) is for the benchmark that measures what 7 bits cost.
    """
    import logging

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    names = [n.name for n in onnx.load(str(fp32), load_external_data=False).graph.node if n.op_type == "MatMul"]
    exclude = [n for n in names if any(f"/{part}/" in n for part in keep_float)]
    out.mkdir(parents=True, exist_ok=True)
    graph = out / Files.ONNX
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer logs a line per tensor, and advises pre-processing we do not need
    try:
        quantize_dynamic(fp32, graph, weight_type=QuantType.QInt8, per_channel=True, reduce_range=seven_bit,
                         op_types_to_quantize=["MatMul"], nodes_to_exclude=exclude, use_external_data_format=True,
                         extra_options={"MatMulConstBOnly": True,
                                        # a tensor after a contrib op (GroupQueryAttention) that shape inference
                                        # cannot type (the GPT-2 graph has no value_info): float
                                        "DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        root.setLevel(level)
    for f in (graph, out / data_name(graph)):
        if f.exists():
            f.chmod(0o644)  # the quantizer's temporary file is 0600
    return graph


# MatMulNBits' accuracy_level: 4 quantizes the activations to int8 per block inside the kernel. On a CPU without
# VNNI (AVX2 only) MLAS multiplies with vpmaddubsw (u8 x s8 pairs summed in int16, saturating): INT4 weights are
# u4 (0..15), so a pair sums at most 2*15*128 = 3840 (7680 after its hadd): no saturation, level 4 is exact enough
# everywhere. INT8 is level 4 too: at level 1 (float activations) ONNX Runtime 1.32's CPU kernel for 8-bit weights
# dequantizes each weight matrix to float on every call, the 262k x 640 LM head of Gemma 3 270M included: 48
# tokens took 147 s (0.3 tokens/s) where FP32 took 3.4 s, while level 4's integer kernel
# (SQ8BitGemmKernel_BlkSum_CompInt8, MLAS's VNNI kernels on x86) decodes faster than FP32 within the gate
# (docs/generation.md, "Gemma 3 270M, measured"). Its per-block int8 activations are per row: a sequence's output
# does not depend on its batch, unlike the dynamic method. Not measured on a CPU without VNNI.
ACCURACY_LEVEL = {"int4": 4, "int8": 4}


# Above this vocabulary INT4 keeps its LM head at 8 bits from the first build, as llama.cpp's K-quant recipes keep
# token_embd / output at Q8_0 or Q6_K: the head is then the largest matrix (Gemma 3 270M's 262k x 640 is 63 % of its
# weights) and the one whose rounding every token's choice goes through. Its embedding is a table of its own, at
# 4 bits (GatherBlockQuantized has no 8 bits), no longer the head's (the builder ties them only at one width).
WIDE_HEAD_VOCAB = 65536
WIDE_HEAD = "last_matmul:int8"


def wide_head(precision: str, hf_config: Mapping[str, Any]) -> bool:
    """Whether ``precision``'s LM head is built at 8 bits from the start (INT4 of a vocabulary over 64k)."""
    vocab = hf_config.get("vocab_size")
    return precision == "int4" and isinstance(vocab, int) and vocab > WIDE_HEAD_VOCAB and \
        hf_config.get("model_type") != "gpt2"


def _ladder(precision: str, method: str, mixed: bool, tied: bool,
            head8: bool = False, smooth: bool = True) -> list[tuple[str, tuple[str, ...]]]:
    """The builds a precision tries in turn until one passes the gate: (method, the MatMuls kept wider).
    ``head8``: the LM head is at 8 bits in every step (:func:`wide_head`); ``smooth``: dynamic INT8 has its
    smoothed step (``SMOOTH_DOWN`` in the step: a gated MLP and calibration text)."""
    if head8:
        steps = MIXED_STEPS if mixed else MIXED_STEPS[:1]
        return [(method, w) for w in dict.fromkeys(tuple(dict.fromkeys((WIDE_HEAD,) + s)) for s in steps)]
    if precision == "fp16":
        return [("fp16", ())]
    if precision == "gguf":  # the GGUF's own blocks: nothing to widen (it is what the user chose)
        return [("gguf", ())]
    if precision == "int8" and method == "dynamic":
        steps = [("dynamic", keep) for keep in dict.fromkeys(
            tuple(k for k in step if smooth or k != SMOOTH_DOWN) for step in (DYNAMIC_STEPS if mixed else
                                                                            DYNAMIC_STEPS[:1]))]
        return (steps + [("weight_only", ())]) if mixed else steps
    if precision == "int8":
        return [(method, ())]
    steps = MIXED_STEPS if mixed else MIXED_STEPS[:1]
    if tied:  # the LM head shares the embedding's quantized table (4 bits only): it cannot go to INT8 alone
        steps = tuple(dict.fromkeys(tuple(m for m in step if not m.startswith("last_matmul")) for step in steps))
    return [(method, step) for step in steps]


def uses_blockwise(precision: str, method: str, symmetric: bool, family: str) -> bool:
    """Whether ``precision`` is written by :mod:`build_engines.lm_blockwise` (zero points, searched scales): INT4
    rounded or AWQ-scaled, not asked symmetric, of a family whose builder graph has plain MatMuls (GPT-2's
    Conv1D are Gemms)."""
    return precision == "int4" and method in ("rtn", "awq") and not symmetric and family not in AWQ_UNSUPPORTED


def _builder_options(precision: str, method: str, block: int, mixed: Sequence[str],
                     tied: bool = False) -> dict[str, Any]:
    if precision == "fp16":
        return {}
    opts: dict[str, Any] = {"block_size": block if precision == "int4" else 32,
                            "accuracy_level": ACCURACY_LEVEL[precision]}
    if precision == "int8":
        # The weight-only pass quantizes MatMuls alone: ONNX Runtime's quantizer can quantize a Gather (the
        # embedding) at 4 bits only, and the builder, on a tied model (shared_embeddings follows
        # tie_word_embeddings), asks it for the Gather too, which it refuses with an "[ERROR]" line in a build that
        # succeeds. At 8 bits the embedding and the LM head are never shared anyway (only both at 4 bits, or
        # both in float), so the graph is the same.
        opts.update({"op_types_to_quantize": "MatMul", "shared_embeddings": "false"})
    if precision == "int4" and method == "k_quant":
        opts["algo_config"] = "k_quant"
    if mixed:
        opts["matmul_mixed_precision"] = ",".join(mixed)
    if precision == "int4" and WIDE_HEAD in mixed and tied:  # the tied head alone at 8 bits: the embedding a 4-bit
        opts.update(shared_embeddings="false", op_types_to_quantize="MatMul/Gather")  # table of its own
    return opts


def quantize_causal_lm(recipe: Recipe, export: Any, out_dir: Path | None = None,
                       progress: Callable[[str], None] | None = None, min_accuracy: float | None = None) -> GenerativeQuantizeResult:
    """Build and gate the recipe's FP16/INT8/INT4 graphs; ``accuracy.json`` beside them."""
    from model_factory.build_engines.accuracy import AccuracyGateError
    from model_factory.build_engines.calibration import split_data

    from model_factory.recipe.gguf import converted

    say = progress or (lambda _m: None)
    recipe = converted(recipe)  # a gguf source: the folder its source stage wrote (source.gguf the file)
    out_dir = Path(out_dir or recipe.work_dir / "quantize")
    q, gen, src = recipe.quantization, recipe.generation, recipe.source.path
    assert gen is not None and src is not None
    agreement_gate = min_accuracy if min_accuracy is not None else q.min_token_agreement
    split = split_data(q, need_calibration=False)
    export_dir = Path(export.onnx_path).parent
    reference = read_reference(export_dir)
    tok = _tokenizer(export_dir)
    heldout = [prompt_ids(tok, t, PPL_TOKENS) for t in split.heldout.texts if isinstance(t, str) and t.strip()]
    calib_texts = [t for t in (split.calibration.texts if split.calibration else ()) if isinstance(t, str)]
    hf_config = read_hf_config(src)
    head_dim = head_dim_of(hf_config)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    scorer = Scorer(export.onnx_path, head_dim, heldout, reference)
    say(f"[quantize] FP32 perplexity {scorer.ppl_fp32:.3f} on {len(heldout)} held-out samples")
    kv_scales = None
    if q.kv_cache == "int8":  # the INT8 and INT4 graphs keep their KV cache in INT8, scales fitted on FP32's cache
        from model_factory.build_engines.kv_int8 import check_runtime, fit_kv_scales

        check_runtime()
        kv_scales = fit_kv_scales(Path(export.onnx_path), head_dim,
                                  [prompt_ids(tok, t, CALIBRATION_TOKENS) for t in calib_texts])
        say(f"[quantize] KV cache INT8: a scale per channel of {len(kv_scales)} layers fitted on "
            f"{len(calib_texts)} calibration samples")
    results, search, models = [], [], {"fp32": Path(export.onnx_path)}
    with atomic_dir(out_dir) as tmp:
        for precision in [p for p in ("fp16", "int8", "int4", "gguf") if p in recipe.precisions]:
            method = {"int4": q.int4_method, "int8": q.int8_method, "gguf": "gguf"}.get(precision, "fp16")
            if method == "awq" and not calib_texts:
                say("[quantize] awq needs calibration_data: int4 rounded to nearest (rtn)")
                method = "rtn"
            if method == "awq" and gen.family in AWQ_UNSUPPORTED:
                say(f"[quantize] awq has no {gen.family} layout (its fused Conv1D projections): int4 rounded to "
                    "nearest (rtn)")
                method = "rtn"
            source = src
            batches = [prompt_ids(tok, t, CALIBRATION_TOKENS) for t in calib_texts]
            if method == "awq":
                from model_factory.build_engines.awq import write_scaled_model

                source, scales = write_scaled_model(src, tmp / ".awq-model", gen.family, batches,
                                                    q.int4_block_size, say)
                search.append({"step": "awq", "groups": [asdict(s) for s in scales]})
            work = tmp / f".{precision}"
            kv = "int8" if kv_scales is not None and precision in KV_INT8_PRECISIONS else "float"
            blocks = None
            if uses_blockwise(precision, method, q.int4_symmetric, gen.family):
                blocks = BlockwiseInput.prepare(source, src, Path(export.onnx_path), tmp / ".int4-fp32", batches,
                                                head_dim, say)
            head8 = wide_head(precision, hf_config)
            if head8:
                say(f"[quantize] {precision}: LM head at 8 bits (a vocabulary of {hf_config['vocab_size']:,})")
            layout = None
            no_smooth = ""
            if precision == "int8" and method == "dynamic" and q.mixed_precision:
                from model_factory.build_engines.smooth import smoothable

                no_smooth = "no calibration_data" if not batches else smoothable(Path(export.onnx_path))
                if no_smooth:
                    say(f"[quantize] int8 (dynamic): no smoothed step ({no_smooth})")
            for method, step in _ladder(precision, method, q.mixed_precision, tied and blocks is None, head8,
                                        smooth=not no_smooth):
                shutil.rmtree(work, ignore_errors=True)
                wider = tuple(w for w in step if w not in (SMOOTH_DOWN, ROW_DOWN))
                smoothed = ("down_proj",) if SMOOTH_DOWN in step else ()
                per_row = ("down_proj",) if ROW_DOWN in step else ()
                if method == "dynamic":
                    base = Path(export.onnx_path)
                    if smoothed:
                        from model_factory.build_engines.smooth import smoothed_fp32

                        base, chosen = smoothed_fp32(source, base, tmp / ".smooth-fp32", batches, head_dim,
                                                     progress=say)
                        search.append({"step": "smooth", "matmuls": list(smoothed),
                                       "layers": [asdict(c) for c in chosen]})
                    graph = dynamic_int8(base, work, wider + per_row)
                    shutil.rmtree(tmp / ".smooth-fp32", ignore_errors=True)
                    if per_row:
                        from model_factory.build_engines.row_int8 import per_row_matmuls

                        per_row_matmuls(graph, per_row, ROW_GROUP)
                elif method == "gguf":  # the GGUF's own blocks in MatMulNBits (build_engines/gguf_carry.py)
                    from model_factory.build_engines.gguf_carry import carry_gguf

                    assert recipe.source.gguf is not None
                    graph, carry = carry_gguf(Path(export.onnx_path), recipe.source.gguf, work, hf_config,
                                              progress=say)
                    (tmp / CARRY_REPORT).write_text(json.dumps(carry.to_dict(), indent=2) + "\n")
                    search.append({"step": "gguf", "by_type": dict(carry.by_type)})
                elif blocks is not None:
                    graph, layout = blocks.write(work, q.int4_block_size, wider, say)
                else:
                    graph = run_builder(source, work, precision,
                                        _builder_options(precision, method, q.int4_block_size, wider, tied), say)
                if kv == "int8":
                    from model_factory.build_engines.kv_int8 import quantize_kv_cache

                    quantize_kv_cache(graph, kv_scales)
                agree, ppl, err, compared = scorer.score(graph)
                ratio = ppl / scorer.ppl_fp32
                ok = agree >= agreement_gate and ratio <= q.max_perplexity_ratio
                kept = "float" if method == "dynamic" else "int8"
                search.append({"step": "gate", "precision": precision, "method": method, kept: list(wider),
                               "kv_cache": kv, "agreement": agree, "perplexity_ratio": ratio, "passed": ok,
                               **({"blocks": layout} if layout else {}),
                               **({"smoothed": list(smoothed)} if smoothed else {}),
                               **({"per_row": list(per_row), "row_group": ROW_GROUP} if per_row else {})})
                say(f"[quantize] {precision} ({method}{', smoothed: ' + ','.join(smoothed) if smoothed else ''}"
                    f"{', per row: ' + ','.join(per_row) if per_row else ''}"
                    f"{f', {kept}: ' + ','.join(wider) if wider else ''}"
                    f"{', kv int8' if kv == 'int8' else ''}): agreement "
                    f"{agree:.4f}, perplexity ratio {ratio:.4f} -> {'pass' if ok else 'below the gate'}")
                if ok:
                    break
            timed = scorer.reference and SPEED_TOKENS < scorer.context
            speed, speed_fp32, many, many_fp32 = scorer.speed(graph) if timed else (0.0, 0.0, 0.0, 0.0)
            slower = [f"at {n}" for n, (a, b) in (("one stream", (speed, speed_fp32)),
                                                  (f"{SPEED_ROWS} streams", (many, many_fp32))) if a < b]
            say(f"[quantize] {precision}: {speed:.1f} tokens/s decoding one stream here, FP32 {speed_fp32:.1f}; "
                f"{many:.0f} at {SPEED_ROWS} streams, FP32 {many_fp32:.0f}"
                + (f" (slower than FP32 {' and '.join(slower)})" if slower else ""))
            name = onnx_file(precision)
            shutil.move(str(graph), tmp / name)
            shutil.move(str(work / data_name(graph)), tmp / data_name(tmp / name))
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(tmp / ".awq-model", ignore_errors=True)
            shutil.rmtree(tmp / ".int4-fp32", ignore_errors=True)
            _point_at_data(tmp / name)
            results.append(GenerativeResult(
                precision, method, agree, ppl, scorer.ppl_fp32, ratio, err, len(heldout), compared, ok,
                tuple(wider) if method != "dynamic" else (), weights_bytes(tmp / name),
                float_matmuls=tuple(wider) if method == "dynamic" else (), kv_cache=kv, tokens_per_s=speed,
                tokens_per_s_fp32=speed_fp32, tokens_per_s_rows=many, tokens_per_s_rows_fp32=many_fp32,
                weights=layout["method"] if layout else "", smoothed=smoothed, per_row=per_row))
            models[precision] = out_dir / name
        report = GenerativeAccuracy(
            model=recipe.name, heldout_source=str(split.heldout.source.name), heldout_samples=len(heldout),
            heldout_note=split.note, calibration_source=split.calibration.source.name if split.calibration else None,
            calibration_samples=len(calib_texts), min_accuracy=agreement_gate,
            max_perplexity_ratio=q.max_perplexity_ratio, results=tuple(results), search=tuple(search),
            calibration_method="awq" if q.int4_method == "awq" and "int4" in recipe.precisions else None)
        report.write(tmp / REPORT_NAME)
        if not report.passed:
            failed = ", ".join(r.precision for r in report.results if not r.passed)
            raise AccuracyGateError(
                f"{failed} missed the accuracy gate on the held-out text (agreement >= {agreement_gate:g}, "
                f"perplexity ratio <= {q.max_perplexity_ratio:g}), even with its most sensitive MatMuls wider (INT4's "
                f"at INT8, dynamic INT8's in float; FP16 has no wider step):\n"
                f"{report.render()}\nFix: leave the failing precision out of precisions, give calibration_data "
                "for awq, or relax quantization.min_token_agreement / max_perplexity_ratio if this is acceptable",
                report, out_dir / REPORT_NAME)  # type: ignore[arg-type]
    return GenerativeQuantizeResult(models=models, report=report, report_path=out_dir / REPORT_NAME,
                                    float_nodes=tuple(s for r in results for s in r.int8_matmuls + r.float_matmuls),
                                    calibration_digest=split.calibration.digest if split.calibration else None)


def data_name(graph: Path) -> str:
    return Path(graph).name + Files.DATA_SUFFIX


def _point_at_data(graph: Path) -> None:
    """Rename the graph's external-data reference to ``<graph>.data`` (the builder names it after model.onnx)."""
    import onnx

    m = onnx.load(str(graph), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = data_name(graph)
    onnx.save(m, str(graph))


def _tokenizer(export_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(export_dir / Files.TOKENIZER_DIR))
