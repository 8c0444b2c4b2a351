"""The contract between packaging and the backend: the model parameters and the version folder's files.

Packaging (``model_factory.build.repository``) writes :class:`ModelParameters` into ``config.pbtxt``'s
``parameters`` with :func:`format_parameters`; the backend (``settings.py``) reads them back with
:func:`parse_parameters`; ``serve`` reads the deployment ones (the queue bound). One definition, so a
parameter cannot be written under one name and read under another, or written and never read.

To add a parameter: one field in :class:`ModelParameters` with ``_param(kind, default, ...)``. Its name
is the parameter's name, ``kind`` says how it is spelled as a string (one codec per kind, below).

The version folder's file names are here too (:class:`Files` and the functions beside it): the build
stages, packaging, the backend and acceptance all take them from this module.

Standard library only, and no import of the rest of the package: this file is copied into every model
version (``mf_backend/contract.py``) and runs inside Triton's stub.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")  # int4: weight-only, generative models only; gguf: a GGUF's blocks
ENGINES = ("auto", "onnxruntime", "tensorrt", "torch")
GROUPINGS = ("cost_model", "pad_to_longest", "none")
WARMUPS = ("short", "sweep")
QUEUE_BOUNDS = ("fixed", "auto")
# How an "auto" queue sheds: "count" (a request arriving behind the bound: 503 at once) or "age" (a request that
# has waited queue_budget_ms: 503 then; the bound a safety net SHED_AGE_BOUND_FACTOR times larger).
QUEUE_SHEDDING = ("count", "age")
# integer: ONNX Runtime's integer kernels (8-bit weights where the CPU has integer dot products, the 7-bit
# form elsewhere); integer-7bit: the 7-bit form on any CPU; simulated: Q/DQ as float arithmetic (cpu_features).
INT8_KERNELS = ("auto", "integer", "integer-7bit", "simulated")
# ONNX Runtime's intra-op spinning on the CPU (settings.cpu_spinning).
CPU_SPINNING = ("auto", "on", "off")
# Attention over an INT8 KV cache on the CPU (int8_attention.py): auto (the factory's kernel, compiled on the host,
# where it builds; else ONNX Runtime's, the reason logged), kernel (required: the load fails without it), onnxruntime.
INT8_ATTENTION = ("auto", "kernel", "onnxruntime")
# A graph's INT8 MatMuls on the CPU (generation/int8_matmul.py): auto (the factory's operators, compiled on the host,
# where they build; else the graph's standard ops, the reason logged), kernel (required), onnxruntime.
INT8_MATMUL = ("auto", "kernel", "onnxruntime")
PREFIX_CACHING = ("auto", "on", "off")  # generation/prefix_cache.py: auto is on where reuse is exact
KV_ADMISSION_PAGED, KV_ADMISSION_RESERVE = "paged", "reserve"  # generation/kv_blocks.py: what admission reserves
KV_ADMISSION = (KV_ADMISSION_PAGED, KV_ADMISSION_RESERVE)
# How the KV cache is laid out (generation/kv_pool.py): slots (a contiguous max_context slot per sequence, what every
# attention reads), blocks (a pool of blocks and a block table per sequence, shared prefixes held once: only the
# factory's INT8-cache kernel reads it, so elsewhere slots, the reason logged).
KV_LAYOUT_SLOTS, KV_LAYOUT_BLOCKS = "slots", "blocks"
KV_LAYOUT = (KV_LAYOUT_SLOTS, KV_LAYOUT_BLOCKS)
PREFILL_CHUNK_AUTO, PREFILL_CHUNK_OFF = "auto", "off"  # prefill_chunk_tokens' words ("off" is read as 0)
SPECULATIVE = ("off", "prompt_lookup", "draft")  # generation/speculative.py: prompt lookup (vLLM's "ngram"), or a
# cheaper precision's graph packaged beside the served one (generation/draft_model.py: speculative_draft)
# num_speculative_tokens where not given, by method (prompt lookup's drafts are its match's length plus one, this many
# at most; a draft graph pays for every token it drafts): docs/generation.md.
SPECULATIVE_TOKENS = {"prompt_lookup": 8, "draft": 4}
# A text longer than max_sequence_length (docs/inputs.md): refused (400), truncated (said in the response and
# counted), or cut into overlapping windows pooled into one vector (embeddings only).
LONG_INPUTS = ("refuse", "truncate", "chunk")
# How chunks are pooled: none (the model cannot chunk: not an embedding), mean (token-weighted mean of the
# windows' vectors), mean_normalized (that mean scaled back to unit length).
CHUNK_POOLINGS = ("none", "mean", "mean_normalized")
# The BYTES inputs the backend tokenizes: `text`, or a reranker's `query` + `passage`.
TEXT_INPUT_NAMES = ("text", "query", "passage")
# The output a text model declares beside its own: per text row, the tokens the model did not see.
TRUNCATED_TOKENS_OUTPUT = "truncated_tokens"
# The output a model that degrades under overload declares beside its own (degrade.py): per request, the
# precision that answered it ("fp32", or the degrade precision), one BYTES element. Declared only with
# ``degrade_to``; a request that names its outputs gets it only when it names it.
PRECISION_OUTPUT = "precision"
# The outputs the backend itself writes, never the engine's: what an engine's own outputs are checked without.
BACKEND_OUTPUTS = (TRUNCATED_TOKENS_OUTPUT, PRECISION_OUTPUT)
# With ``degrade_to`` Triton's queue bound is this many times the bound that sheds without degrading, so the
# backend sees the requests it can still answer on the cheaper engine (serving/queue_bound.py, packaging).
DEGRADE_QUEUE_FACTOR = 2
# With shed_by = "age" Triton's queue bound is this many times the "count" bound: requests are shed by their wait
# (Triton's queue timeout, derived by `serve`), the bound only caps the memory a flood of clients can hold queued.
SHED_AGE_BOUND_FACTOR = 8


# --------------------------------------------------------------------------- files of a version folder


class Files:
    """Names of the files in ``<repo>/<model>/<version>/`` (and beside it, in ``<repo>/<model>/``)."""

    CONFIG = "config.pbtxt"  # in the model folder
    LABELS = "labels.txt"  # in the model folder: Triton's label_filename of a classifier
    SHIM = "model.py"  # the entry point Triton loads
    BACKEND_PACKAGE = "mf_backend"  # this package, copied
    ONNX = "model.onnx"  # the FP32 ONNX; other precisions: onnx_file(p)
    DATA_SUFFIX = ".data"  # an ONNX file's external data: <file>.data
    PLAN_METADATA_SUFFIX = ".json"  # a plan's build metadata: model.<p>.plan.json
    TORCHSCRIPT = "model.torchscript.pt"  # the torch engine's trace (repositories built before torch.export)
    EXPORTED_PROGRAM = "model.pt2"  # the torch engine's ExportedProgram (torch.export)
    TORCHSCRIPT_IO = "model_factory_io.json"  # extra file inside the TorchScript archive: input/output names
    TOKENIZER_DIR = "tokenizer"
    TOKENIZER_JSON = "tokenizer.json"
    ACCEPTANCE_DIR = "acceptance"  # held-out inputs and FP32 outputs (build_engines/golden.py)
    ACCEPTANCE_SPEC = "acceptance.json"
    ACCEPTANCE_INPUTS = "inputs.json"
    ACCEPTANCE_OUTPUTS = "outputs.json"
    EXPORT_REPORT = "export.json"
    METADATA = "metadata.json"
    # text-generation models (GenerationSpec below): the engine's KV layout and the generation defaults, and the
    # golden continuations in ACCEPTANCE_DIR that `accept` replays (greedy tokens of the FP32 reference).
    GENERATION = "generation.json"
    # acceptance/continuations.json: {"max_tokens": N, "min_agreement": x, "prompts": [{"text": str|null,
    # "prompt_ids": [..], "tokens": [..] (FP32 greedy), "near_tie": k|null (first step whose top-two FP32 logits
    # differ by < 1e-3: tokens from there on may differ by float rounding alone)}]}
    CONTINUATIONS = "continuations.json"
    # The INT8 model with its weights re-quantized to 7 bits (|w| <= 63), written by the quantize stage when it
    # passes the gate: ONNX Runtime's integer kernels cannot saturate on it on CPUs without VNNI/AMX (AVX2's
    # u8 x s8 pair sums fit 16 bits). Packaged beside model.int8.onnx.
    INT8_7BIT = "model.int8.w7.onnx"
    # The quantize stage's gate report (build_engines/accuracy.py): each reduced precision's score and verdict.
    # A version that degrades carries it: the backend reads it and never degrades to a precision that failed.
    ACCURACY = "accuracy.json"
    # A prompt template (task "prompt", PROMPT below): its definition, signed with the version. The backend answers
    # it as it was verified; the OpenAI front renders it (model_factory/serving/openai_prompts.py).
    PROMPT = "prompt.json"


def onnx_file(precision: str) -> str:
    """The ONNX file of one precision: ``model.onnx`` (fp32), ``model.fp16.onnx``, ``model.int8.onnx``."""
    return Files.ONNX if precision == "fp32" else f"model.{precision}.onnx"


def plan_file(precision: str) -> str:
    """The TensorRT plan of one precision: ``model.<precision>.plan``."""
    return f"model.{precision}.plan"


def data_file(name: str) -> str:
    """The external-data file that goes with an ONNX file."""
    return name + Files.DATA_SUFFIX


def file_precision(name: str) -> str | None:
    """The precision a version-folder file belongs to (``model.int8.onnx`` -> int8), None for shared files."""
    if name in (Files.ONNX, data_file(Files.ONNX), Files.TORCHSCRIPT, Files.EXPORTED_PROGRAM):
        return "fp32"
    if name in (Files.INT8_7BIT, data_file(Files.INT8_7BIT)):
        return "int8"
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "model" and parts[1] in PRECISIONS and parts[2] in ("onnx", "plan"):
        return parts[1]
    return None


# --------------------------------------------------------------------------- parameters


class ParameterError(ValueError):
    """A parameter whose text does not parse or is out of range (the model cannot load with it)."""


def _param(kind: str, default: Any, *, choices: tuple[str, ...] = (), minimum: int | None = None,
           why: str = "") -> Any:
    return field(default=default, metadata={"kind": kind, "choices": choices, "minimum": minimum, "why": why})


@dataclass(frozen=True)
class ModelParameters:
    """The ``config.pbtxt`` parameters of a model packaged by model-factory, typed.

    ``None`` means "not given" (the parameter is not written, and the reader applies the documented
    default). Kinds: ``int``, ``int?`` (None when empty), ``bool``, ``bool?``, ``str``, ``str?``,
    ``choice`` (one of ``choices``), ``ints`` (comma-separated lengths), ``floats3?`` (``a,b,c``), ``auto-int``
    (``auto``, or a whole number >= 0: ``off`` is read as 0), ``ratio`` (a number: 0, or above 1).
    """

    max_sequence_length: int = _param("int", 128, minimum=1)
    # Sequence lengths of the engine's optimization profiles; None: one, max_sequence_length.
    sequence_buckets: tuple[int, ...] | None = _param("ints", None)
    grouping: str = _param("choice", "cost_model", choices=GROUPINGS)
    # Tokens one group may hold (0: no budget).
    max_group_tokens: int = _param("int", 0, minimum=0, why="0 (no budget) or positive")
    # Whether requests of different lengths may be padded into one launch; None: when an attention mask is input.
    pad_sequences: bool | None = _param("bool?", None)
    engine: str = _param("choice", "auto", choices=ENGINES)
    cpu_fallback: bool = _param("bool", False)
    pool_release_threshold_mib: int = _param("int", 256, minimum=0)
    pool_initial_mib: int = _param("int", 0, minimum=0)
    # ONNX Runtime threads per CPU instance (0: split the cores; spinning off when the threads outnumber them).
    cpu_threads: int = _param("int", 0, minimum=0, why="0 (split the cores) or positive")
    # Whether ONNX Runtime's idle intra-op threads spin: auto (every model: only while the instances' threads fit
    # the cores), on, off (idle threads sleep at once: for a host whose cores other work shares).
    cpu_spinning: str = _param("choice", "auto", choices=CPU_SPINNING)
    # With the cores split: a run takes every core while no other CPU instance computes (idle_cores.py).
    lend_idle_cores: bool = _param("bool", True)
    # INT8 on the ONNX Runtime CPU engine: auto (integer kernels where the CPU has VNNI/AMX/dot products),
    # integer, or simulated (Q/DQ as float arithmetic); see cpu_features.py.
    int8_kernels: str = _param("choice", "auto", choices=INT8_KERNELS)
    # The precision served and its files: the backend loads these and no other.
    precision: str = _param("choice", "fp32", choices=PRECISIONS)
    onnx_file: str = _param("str", Files.ONNX)
    plan_file: str | None = _param("str?", None)
    torchscript_file: str = _param("str", Files.TORCHSCRIPT)
    # The vocabulary size (token ids must be below it); None: unknown.
    vocab_size: int | None = _param("int?", None, minimum=1, why="greater than 0")
    # Fixed cost-model constants (a, b, c seconds); None: measured by the backend at load.
    cost_model: tuple[float, float, float] | None = _param("floats3?", None)
    cost_model_repeats: int = _param("int", 3, minimum=1)
    cost_model_warmup: str = _param("choice", "short", choices=WARMUPS)
    # Whether the cost model keeps learning from traffic; None: yes unless constants are given.
    cost_model_online: bool | None = _param("bool?", None)
    # Send responses after execute() returns; "auto": exactly when the configuration sets a queue policy.
    respond_after_return: str = _param("choice", "auto", choices=("auto", "true", "false"))
    # The queue bound: "fixed" (config.pbtxt's max_queue_size as is) or "auto": ``serve`` derives it on the
    # machine that serves, as queue_budget_ms of work by the cost model measured there (serving/queue_bound.py).
    queue_bound: str = _param("choice", "fixed", choices=QUEUE_BOUNDS)
    queue_budget_ms: int = _param("int", 0, minimum=0)
    # How that bound sheds (QUEUE_SHEDDING): "age" multiplies the derived bound by SHED_AGE_BOUND_FACTOR, and
    # ``serve`` adds the queue timeout it derives (queue_budget_ms, at least twice the longest launch there).
    queue_shed_by: str = _param("choice", "count", choices=QUEUE_SHEDDING)
    # The allowed [low, high] of each index-like input, as JSON {"name": [low, high]} (input_bounds.py parses it:
    # it needs numpy, which this file may not import); None: no bounds beyond input_ids < vocab_size.
    input_bounds: str | None = _param("str?", None)
    # The recipe's task; "text-generation" makes the backend a decoupled, continuously batching generator that
    # reads generation.json (GenerationSpec); anything else (or None) is the one-response-per-request path.
    task: str | None = _param("str?", None)
    # Texts over max_sequence_length (long_inputs.py): the model's default; a request may ask for another.
    long_inputs: str = _param("choice", "refuse", choices=LONG_INPUTS)
    # Tokens two neighbouring chunks share, and how chunk vectors are pooled ("none": chunking not offered).
    chunk_overlap: int = _param("int", 32, minimum=0)
    chunk_pooling: str = _param("choice", "none", choices=CHUNK_POOLINGS)
    # text-generation serving (generate_model.py). The memory the model may use, weights included: the KV cache
    # gets what the weights leave (admission: budget - weights >= kv bytes of every running sequence's prompt +
    # max_tokens); 0: half the memory available when the instance loads.
    memory_budget_mib: int = _param("int", 0, minimum=0, why="0 (half the available memory) or positive")
    # KV slots: the most sequences decoding together.
    max_active_sequences: int = _param("int", 32, minimum=1)
    # Requests that may wait for memory; past it a request is refused at once (503 + Retry-After).
    max_waiting_sequences: int = _param("int", 64, minimum=0)
    # LoRA adapters held in memory at once (slots of the adapter stacks; the least recently used idle one evicted).
    max_loras: int = _param("int", 4, minimum=1)
    # A request that waited this long for memory preempts the youngest running sequence (0: never).
    preemption_wait_ms: int = _param("int", 0, minimum=0)
    # Admission grouped by max_tokens (power-of-two buckets, the smallest first) until a request has waited this
    # long, which then goes first (0: arrival order).
    max_tokens_grouping_ms: int = _param("int", 0, minimum=0)
    # A CPU instance serving an INT8 KV cache: whose attention kernel reads it (INT8_ATTENTION).
    int8_attention: str = _param("choice", "auto", choices=INT8_ATTENTION)
    # A CPU instance serving a graph with INT8 MatMuls (MatMulInteger): whose kernels run them (INT8_MATMUL).
    int8_matmul: str = _param("choice", "auto", choices=INT8_MATMUL)
    # Prefix caching (generation/prefix_cache.py): auto (on where reuse is exact: not a batch-dependent precision),
    # on, off.
    prefix_caching: str = _param("choice", "auto", choices=PREFIX_CACHING)
    # What admission reserves (generation/kv_blocks.py): paged (the blocks a sequence holds and its next step writes,
    # growing a block at a time; the budget preempts when none is left), reserve (prompt + max_tokens up front).
    kv_admission: str = _param("choice", KV_ADMISSION_PAGED, choices=KV_ADMISSION)
    # The KV cache's layout (KV_LAYOUT): slots, or blocks (a CPU instance's INT8 cache on the factory's kernel).
    kv_layout: str = _param("choice", KV_LAYOUT_SLOTS, choices=KV_LAYOUT)
    # Padded tokens one prefill launch may hold (a longer prompt runs alone).
    max_prefill_tokens: int = _param("int", 2048, minimum=1)
    # Chunked prefill (generation/chunked_prefill.py): prompt tokens a step prefills; auto (cost model), 0/off: whole.
    prefill_chunk_tokens: int | str = _param("auto-int", PREFILL_CHUNK_AUTO)
    # Under prefill_chunk_tokens = auto, while sequences decode a step's chunk is sized so the step is predicted within
    # this multiple of the decode-only step (generation/itl_budget.py); 0 (the default): the cost model's fixed chunk
    # (the budget's small chunks cost the long prompts 3-5x their time to first token: docs/generation.md).
    max_itl_ratio: float = _param("ratio", 0.0, why="0 (off: the fixed auto chunk) or above 1")
    # Speculative decoding (generation/speculative.py): off, prompt_lookup (from the longest earlier match, of
    # prompt_lookup_min..max tokens, of the context's end) or draft, while at most speculative_max_sequences sequences
    # decode. vLLM's names. num_speculative_tokens None: SPECULATIVE_TOKENS of the method.
    speculative: str = _param("choice", "off", choices=SPECULATIVE)
    num_speculative_tokens: int | None = _param("int?", None, minimum=1)
    prompt_lookup_max: int = _param("int", 8, minimum=1)
    prompt_lookup_min: int = _param("int", 1, minimum=1)
    speculative_max_sequences: int = _param("int", 1, minimum=1)
    # speculative = "draft": the precision whose graph (packaged in the same version folder, signed with it) drafts
    # greedily what the served one verifies; none otherwise.
    speculative_draft: str = _param("choice", "none", choices=("none",) + PRECISIONS)
    # A GPU instance: device memory kept beside the KV cache (activations of the largest prefill launch, other
    # instances on the device); the cache gets what cudaMemGetInfo reports free at load less this (kv_device).
    device_reserve_mib: int = _param("int", 1024, minimum=0)
    # Degrade before shedding (degrade.py): a cheaper precision packaged beside the served one, that passed its
    # gate, answers the windows whose backlog reaches degrade_backlog requests (0: half of the largest preferred
    # batch size, else of max_batch_size);
    # None: never degrade (the default).
    degrade_to: str | None = _param("str?", None)
    degrade_backlog: int = _param("int", 0, minimum=0, why="0 (half the largest preferred batch) or positive")


# --------------------------------------------------------------------------- generative engines

TEXT_GENERATION = "text-generation"
# A prompt template on a served text-generation model (docs/generation.md, "Prompt templates"): its version folder
# holds Files.PROMPT; the model answers one request with it (prompt_model.py), the OpenAI front fills it in.
PROMPT = "prompt"
PROMPT_INPUT = "request_id"  # BYTES [1], optional: the caller's request id (logged), nothing else
PROMPT_OUTPUT = "prompt"  # BYTES [1]: the served version's prompt.json, as verified
PROMPT_BASE_PARAMETER = "base"  # config.pbtxt parameter: the text-generation model the prompt runs on
# The engine I/O of a text-generation ONNX graph (one graph for prefill and decode):
#   inputs  input_ids [batch, new_tokens] int64
#           attention_mask [batch, total_tokens] int64  -- row r: ones for its (cached + new) tokens, then zeros
#           past_key_values.<i>.key / .value [batch, kv_heads, max_context, head_dim] (kv_dtype)
#           logits_positions [batch, k] int64 -- which of each row's new tokens get logits (graphs packaged
#           before it lacked this input and returned every position: the backend serves both)
#   outputs logits [batch, k, vocab] float32 -- the LM head applied at logits_positions only
#           present.<i>.key / .value -- the SAME buffers as the past ones (bound to one preallocated KV slot
#           per sequence: the graph writes the new tokens' keys and values in place, at each row's own length)
# Each row keeps its own length (the mask's row sum), so sequences of different lengths decode in one batched
# step and a slot is never reallocated per token. Positions come from the mask (rotary inside attention).
# kv_dtype "int8" (build_engines/kv_int8.py): the cache holds int8 and the graph its float scales per channel
# (an attention node's k_scale / v_scale); the backend only sizes and binds int8 buffers.
KV_LAYOUT_SHARED_SLOTS = "shared-slots"
# The TensorRT graph of a text-generation model (build_engines/lm_tensorrt.py; TensorRT's ONNX parser has no
# GroupQueryAttention): standard ops, the same names, and
#   inputs  input_ids, attention_mask, logits_positions as above; position_ids [batch, new_tokens] int64
#           past_key_values.<i>.key / .value [batch, kv_heads, past_tokens, head_dim] float32 (float16 in the FP16
#           plan's graph, whose logits are float16 too)
#   outputs logits [batch, k, vocab]; present.<i>.key / .value [batch, kv_heads, past_tokens + new_tokens, head_dim]
#           -- the past with the new tokens' keys and values appended (rows padded to one past length)
# Its plan (``plan_file(precision)``) has two optimization profiles: prefill (past_tokens 0) and decode
# (new_tokens 1). Built and checked here; served by no runner yet (the backend's is ONNX Runtime's, on the CPU).
KV_LAYOUT_CONCAT = "concat"
POSITION_IDS = "position_ids"
TENSORRT_LM_PROFILES = ("prefill", "decode")
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
LOGITS = "logits"
LOGITS_POSITIONS = "logits_positions"
KV_DTYPES = {"float32": 4, "float16": 2, "int8": 1}
# The first ONNX Runtime whose CPU GroupQueryAttention was seen to keep an INT8 KV cache (quantization.kv_cache:
# build_engines/kv_int8.py refuses an older one at build, generate_model at load).
INT8_KV_ONNXRUNTIME = (1, 32)


def runs_int8_kv(version: str) -> bool:
    """Whether ONNX Runtime ``version`` (its ``__version__``) runs an INT8 KV cache on the CPU."""
    return tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) >= INT8_KV_ONNXRUNTIME


@dataclass(frozen=True)
class TritonTensor:
    """One input or output of a Triton model as ``config.pbtxt`` declares it (dims without a batch axis)."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False


# The Triton-facing I/O of a text-generation model: a decoupled model (``max_batch_size: 0``; the backend batches
# continuously itself), with the names Triton's vLLM and TensorRT-LLM backends use, so their clients work
# (generate / generate_stream, gRPC streaming). ``prompt_ids`` (token ids instead of text) and the token outputs
# are ours: exact-token checks and OpenAI usage counts. Packaging writes exactly these; the backend reads them.
GENERATE_INPUTS = (
    TritonTensor("text_input", "TYPE_STRING", (1,), optional=True),
    TritonTensor("prompt_ids", "TYPE_INT32", (-1,), optional=True),
    TritonTensor("stream", "TYPE_BOOL", (1,), optional=True),
    TritonTensor("max_tokens", "TYPE_INT32", (1,), optional=True),
    TritonTensor("min_tokens", "TYPE_INT32", (1,), optional=True),
    TritonTensor("ignore_eos", "TYPE_BOOL", (1,), optional=True),
    TritonTensor("temperature", "TYPE_FP32", (1,), optional=True),
    TritonTensor("top_k", "TYPE_INT32", (1,), optional=True),
    TritonTensor("top_p", "TYPE_FP32", (1,), optional=True),
    TritonTensor("repetition_penalty", "TYPE_FP32", (1,), optional=True),
    TritonTensor("seed", "TYPE_INT64", (1,), optional=True),
    TritonTensor("stop", "TYPE_STRING", (-1,), optional=True),
    TritonTensor("exclude_input_in_output", "TYPE_BOOL", (1,), optional=True),
    # vLLM backend style: the sampling parameters as one JSON object (explicit inputs win over it). Read from it
    # only: presence_penalty, frequency_penalty (-2..2), logit_bias ({"token id": -100..100}), stop_token_ids,
    # logprobs (0..20: the chosen token's log-probability and that many alternatives, from the raw logits) and
    # n (1..128 sequences of the prompt, prefilled once: generation/sampling.py, scheduler.py), and guided, the
    # grammar the output follows (structured outputs: one of {"json": schema}, {"json_object": true}, {"regex": ...},
    # {"choice": [...]}, {"grammar": Lark}; compiled against the tokenizer, each token outside it masked before
    # sampling; one it cannot compile is INVALID_ARG naming the construct: generation/structured/grammar.py).
    TritonTensor("sampling_parameters", "TYPE_STRING", (1,), optional=True),
)
# One entry a choice where a response holds several (n > 1, not streamed; streamed: one choice a response).
GENERATE_OUTPUTS = (
    TritonTensor("text_output", "TYPE_STRING", (-1,)),
    TritonTensor("output_ids", "TYPE_INT32", (-1,)),  # not streamed with n > 1: the choices' ids one after another
    TritonTensor("finish_reason", "TYPE_STRING", (-1,)),  # "" while streaming; then stop | length | cancelled
    TritonTensor("num_input_tokens", "TYPE_INT32", (1,)),
    TritonTensor("num_output_tokens", "TYPE_INT32", (-1,)),
    TritonTensor("index", "TYPE_INT32", (-1,)),  # the choice each entry is (sent when n > 1)
    TritonTensor("logprobs", "TYPE_STRING", (-1,)),  # a JSON list per choice (sent when logprobs is asked)
)


def past_name(layer: int, kind: str) -> str:
    """``past_key_values.<layer>.key`` / ``.value`` (kind: ``key`` or ``value``)."""
    if kind not in ("key", "value"):
        raise ValueError(f"kind={kind!r}: use key or value")
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    """``present.<layer>.key`` / ``.value``: the output that shares its buffer with :func:`past_name`."""
    if kind not in ("key", "value"):
        raise ValueError(f"kind={kind!r}: use key or value")
    return f"present.{layer}.{kind}"


@dataclass(frozen=True)
class SamplingDefaults:
    """The model's generation defaults (its ``generation_config.json``), applied when a request omits them."""

    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_tokens: int = 128
    do_sample: bool = False


@dataclass(frozen=True)
class GenerationSpec:
    """``generation.json`` of a text-generation version: what the backend needs to run the graph and size its cache.

    Packaging writes it (from the Hugging Face config and the exported graph); the backend and ``accept`` read it.
    ``max_context`` is the most tokens (prompt + generated) one sequence may hold: the model's positions, or less.
    ``weights_bytes`` maps each packaged precision to the bytes of its graph's weights; admission sizes the cache
    as ``max_sequences = (budget - weights) / (kv_bytes_per_token * max_context)`` (the seed formula).
    ``kv_dtype`` is the KV cache's element type of the FP32 and quantized graphs; ``kv_dtypes`` names each packaged
    precision whose graph keeps another (FP16: ``float16``; an INT8 cache, ``quantization.kv_cache``: ``int8``).
    Whoever runs one precision reads
    :meth:`for_precision`'s spec.
    """

    family: str  # Hugging Face model_type (llama, mistral, qwen2, qwen3, phi3, gemma, ...)
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    kv_dtype: str = "float32"
    kv_layout: str = KV_LAYOUT_SHARED_SLOTS
    sliding_window: int | None = None  # the largest sliding window of any layer (None: every layer sees all)
    weights_bytes: Mapping[str, int] = field(default_factory=dict)
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # The tokenizer's chat template (Jinja), if it has one: applied by the OpenAI chat endpoint.
    chat_template: str | None = None
    # Packaged precisions whose outputs depend on what a sequence is batched with (dynamic INT8: one activation
    # scale per step, shared by every row): said in the load log of a stub that serves one.
    batch_dependent: tuple[str, ...] = ()
    kv_dtypes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for where, dtype in (("kv_dtype", self.kv_dtype), *((f"kv_dtypes.{p}", d) for p, d in self.kv_dtypes.items())):
            if dtype not in KV_DTYPES:
                raise ParameterError(f"generation.json {where}={dtype!r}: use {', '.join(KV_DTYPES)}")
        if self.kv_layout != KV_LAYOUT_SHARED_SLOTS:
            raise ParameterError(f"generation.json kv_layout={self.kv_layout!r}: this backend reads "
                                 f"{KV_LAYOUT_SHARED_SLOTS!r} (rebuild the model with this model-factory)")
        if not self.eos_token_ids:
            raise ParameterError("generation.json names no eos token: generation could never stop")
        for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size", "max_context"):
            if int(getattr(self, name)) < 1:
                raise ParameterError(f"generation.json {name}={getattr(self, name)} must be at least 1")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token holds across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * KV_DTYPES[self.kv_dtype]

    def for_precision(self, precision: str) -> "GenerationSpec":
        """The spec as the graph of ``precision`` runs: its KV cache's element type (and bytes per token)."""
        dtype = self.kv_dtypes.get(precision, self.kv_dtype)
        return self if dtype == self.kv_dtype else dataclasses.replace(self, kv_dtype=dtype)

    def kv_shape(self, slots: int, max_context: int | None = None) -> tuple[int, int, int, int]:
        """The shape of one layer's key (or value) buffer for ``slots`` sequences."""
        return (int(slots), self.num_kv_heads, int(max_context or self.max_context), self.head_dim)

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["eos_token_ids"] = list(self.eos_token_ids)
        data["weights_bytes"] = dict(sorted(self.weights_bytes.items()))
        data["batch_dependent"] = sorted(self.batch_dependent)
        data["kv_dtypes"] = dict(sorted(self.kv_dtypes.items()))
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "GenerationSpec":
        try:
            data = json.loads(text)
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(data) - known)
            if unknown:
                raise ParameterError(f"generation.json has unknown fields {unknown} (written by a newer "
                                     "model-factory?)")
            data["eos_token_ids"] = tuple(int(x) for x in data["eos_token_ids"])
            data["defaults"] = SamplingDefaults(**(data.get("defaults") or {}))
            data["weights_bytes"] = {str(k): int(v) for k, v in (data.get("weights_bytes") or {}).items()}
            data["batch_dependent"] = tuple(str(p) for p in data.get("batch_dependent") or ())
            data["kv_dtypes"] = {str(k): str(v) for k, v in (data.get("kv_dtypes") or {}).items()}
            return cls(**data)
        except ParameterError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise ParameterError(f"generation.json does not parse: {exc}") from None


# The allowed values of index-like inputs (requests/input_bounds.py checks requests against them): both halves of
# the parameter are here, the writer's (format_bounds) and the reader's (parse_bounds), standard library only.
BOUNDS_PARAMETER = "input_bounds"


class BoundsError(ValueError):
    """The ``input_bounds`` parameter cannot be read (the model is refused at load)."""


def format_bounds(bounds: Mapping[str, tuple[int, int]]) -> str:
    """The ``input_bounds`` parameter's text: ``{"name": [low, high]}``, sorted, compact (:func:`parse_bounds` reads it)."""
    return json.dumps({k: [int(lo), int(hi)] for k, (lo, hi) in sorted(bounds.items())}, separators=(",", ":"))


def parse_bounds(text: str) -> dict[str, tuple[int, int]]:
    """Parse the parameter's text ('' means no bounds); a malformed one raises :class:`BoundsError`."""
    if not text.strip():
        return {}
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise BoundsError(f"parameter {BOUNDS_PARAMETER} is not JSON ({exc}): repackage the model") from None
    if not isinstance(raw, dict):
        raise BoundsError(f"parameter {BOUNDS_PARAMETER} must be a JSON object of input -> [low, high]: "
                          "repackage the model")
    out = {}
    for name, pair in raw.items():
        ok = (isinstance(pair, list) and len(pair) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in pair) and pair[0] <= pair[1])
        if not ok:
            raise BoundsError(f"parameter {BOUNDS_PARAMETER}: {name!r} has {pair!r}, expected [low, high] with "
                              "whole numbers low <= high: repackage the model")
        out[str(name)] = (int(pair[0]), int(pair[1]))
    return out


def bounds_from_parameters(params: Mapping[str, str], vocab_size: int | None = None) -> dict[str, tuple[int, int]]:
    """The bounds of a model's string parameters: ``input_bounds``, and ``input_ids`` below ``vocab_size``."""
    bounds = parse_bounds(params.get(BOUNDS_PARAMETER, ""))
    if vocab_size is not None:
        bounds.setdefault("input_ids", (0, vocab_size - 1))
    return bounds


def _names(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]


def _parse(name: str, raw: str, meta: Mapping[str, Any], default: Any) -> Any:
    kind = meta["kind"]
    text = raw.strip()
    if kind in ("int", "int?"):
        if text == "":
            return default
        try:
            value = int(text)
        except ValueError:
            raise ParameterError(f"parameter {name}={raw!r} is not a whole number") from None
        if meta["minimum"] is not None and value < meta["minimum"]:
            raise ParameterError(f"parameter {name}={value} must be {meta['why'] or 'at least ' + str(meta['minimum'])}")
        return value
    if kind in ("bool", "bool?"):
        if text == "":
            return default
        if text.lower() not in ("true", "false"):
            raise ParameterError(f"parameter {name}={raw!r}: use true or false")
        return text.lower() == "true"
    if kind == "choice":
        value = text.lower() or default
        if value not in meta["choices"]:
            raise ParameterError(f"parameter {name}={raw!r}: use {_names(meta['choices'])}")
        return value
    if kind in ("str", "str?"):
        return raw if raw != "" else default
    if kind == "auto-int":
        value = {PREFILL_CHUNK_OFF: "0"}.get(text.lower(), text.lower() or str(default))
        if value != PREFILL_CHUNK_AUTO and not value.isdigit():
            raise ParameterError(f"parameter {name}={raw!r}: use auto, off, or a whole number of tokens (0: off)")
        return value if value == PREFILL_CHUNK_AUTO else int(value)
    if kind == "ratio":
        if text == "":
            return default
        try:
            value = float(text)
        except ValueError:
            raise ParameterError(f"parameter {name}={raw!r} is not a number: use {meta['why']}") from None
        if not math.isfinite(value) or value < 0 or 0 < value <= 1:
            raise ParameterError(f"parameter {name}={value:g} must be {meta['why']}")
        return value
    if kind == "ints":
        if text == "":
            return default
        try:
            return tuple(int(x) for x in text.split(","))
        except ValueError:
            raise ParameterError(f"parameter {name}={raw!r} is not a list of lengths") from None
    if kind == "floats3?":
        if text == "":
            return default
        try:
            a, b, c = (float(x) for x in text.split(","))
        except ValueError:
            raise ParameterError(f"parameter {name} must be 'a,b,c' (seconds)") from None
        return (a, b, c)
    raise AssertionError(f"unknown parameter kind {kind!r}")  # a field declared with a kind not handled here


def _format(value: Any, kind: str) -> str:
    if kind in ("bool", "bool?"):
        return "true" if value else "false"
    if kind in ("ints", "floats3?"):
        return ",".join(str(v) for v in value)
    return str(value)


def parse_parameters(params: Mapping[str, str]) -> ModelParameters:
    """Typed parameters from ``config.pbtxt``'s string parameters (unknown names are left to their readers).

    Raises :class:`ParameterError` naming the parameter, its text and what it accepts.
    """
    values = {}
    for f in dataclasses.fields(ModelParameters):
        if f.name in params:
            values[f.name] = _parse(f.name, str(params[f.name]), f.metadata, f.default)
    return ModelParameters(**values)


def format_parameters(parameters: ModelParameters) -> dict[str, str]:
    """``name -> text`` for ``config.pbtxt``: every parameter that is not None."""
    out = {}
    for f in dataclasses.fields(ModelParameters):
        value = getattr(parameters, f.name)
        if value is not None:
            out[f.name] = _format(value, f.metadata["kind"])
    return out


def parameter_names() -> frozenset[str]:
    """The names this contract defines (a writer may add others only for readers outside the backend)."""
    return frozenset(f.name for f in dataclasses.fields(ModelParameters))


def string_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """The string parameters of Triton's JSON model configuration (``parameters.<k>.string_value``)."""
    return {k: (v or {}).get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
