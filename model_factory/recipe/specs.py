"""The recipe's values: frozen dataclasses every stage receives (parsed from TOML by ``loading``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

@dataclass(frozen=True)
class TensorSpec:
    """One model input or output as Triton sees it (dims exclude the batch axis)."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    # The allowed values [low, high] of an integer input (an index); requests outside are refused (400).
    range: tuple[int, int] | None = None


@dataclass(frozen=True)
class SourceSpec:
    """Where the model comes from.

    ``path`` is a local folder (huggingface), an ONNX file (onnx) or unused (torch);
    ``factory`` is ``module:function`` returning ``(torch.nn.Module, example_inputs)``, its module
    found in ``base_dir`` (the recipe's folder) first, then on the import path.
    """

    kind: str
    path: Path | None = None
    factory: str | None = None
    package: str | None = None  # a Python package that ships the model folder
    base_dir: Path | None = None
    allow_pickle: bool = False  # clean pickle-based weights admitted (build_engines/source_scan.py)
    # A gguf source after its source stage (recipe.gguf.converted): kind "huggingface", path the folder written from
    # the GGUF, this the .gguf file itself (its digest is the build's source digest; precision "gguf" reads it).
    gguf: Path | None = None


@dataclass(frozen=True)
class ShapeSpec:
    """Shape ranges: the batch limit and the sequence-length buckets (one TRT profile each)."""

    max_batch: int = 32
    max_sequence_length: int = 128
    sequence_buckets: tuple[int, ...] = (32, 128)
    long_inputs: str = "refuse"  # a text over max_sequence_length: refuse | truncate | chunk (docs/inputs.md)
    chunk_overlap: int = 32  # tokens neighbouring chunks share
    # text-generation: the tokens one sequence may hold (prompt + generated), one KV-cache slot's length.
    max_context: int | None = None


@dataclass(frozen=True)
class ExportSpec:
    """ONNX export settings and the check against the source framework."""

    opset: int = 17
    tolerance: float = 1e-3
    # torch's exporter: True the dynamo one, False the TorchScript one; None (unset) picks by size: the dynamo
    # exporter for models of DYNAMO_MIN_PARAMETERS or more (it streams weights; the other holds ~3 copies).
    dynamo: bool | None = None
    torchscript: bool = False  # also save model.torchscript.pt (a torch.jit.trace) for the torch engine


@dataclass(frozen=True)
class QuantizationSpec:
    """FP16/INT8 settings: calibration and held-out data, method and accuracy gate."""

    calibration_data: Path | None = None
    heldout_data: Path | None = None
    method: str = "minmax"
    max_calibration_samples: int = 128
    max_heldout_samples: int = 64
    min_accuracy: float | None = None
    mixed_precision: bool = True
    # text-generation: INT8 and INT4 methods, INT4's block, and the gate on the held-out text (perplexity ratio, agreement).
    int8_method: str = "weight_only"
    int4_method: str = "awq"
    int4_block_size: int = 32
    int4_symmetric: bool = False  # True: the builder's symmetric round to nearest; False: zero points, searched scales
    max_perplexity_ratio: float = 1.1
    min_token_agreement: float = 0.8
    kv_cache: str = "float"  # text-generation: "int8" keeps the INT8 / INT4 graphs' KV cache in INT8


@dataclass(frozen=True)
class TensorRTSpec:
    """Engine-build settings shared by datacenter TensorRT and TensorRT-RTX."""

    enabled: bool = False
    workspace_mib: int = 1024
    optimization_level: int = 3
    timing_cache: Path | None = None
    hardware_compatibility: str = "none"
    version_compatible: bool = False


@dataclass(frozen=True)
class BatchingSpec:
    """Triton dynamic batching plus our grouped split inside ``execute()``."""

    preferred_batch_sizes: tuple[int, ...] = (8, 16, 32)
    max_queue_delay_us: int = 0  # as Triton: what queues while the instance is busy batches anyway
    grouping: str = "cost_model"
    ragged: bool = True
    # Padded tokens (sequences x padded length) one launch may hold: the memory budget a group splits at.
    # 0: no budget beyond max_batch (the engine's profiles bound the shapes anyway).
    max_group_tokens: int = 0
    # May requests of different lengths be padded into one launch? Only for a model that ignores padding
    # (it reads an attention mask); the default is true exactly when an input is called attention_mask.
    pad_sequences: bool = True
    # Triton's queue policy (dynamic_batching.default_queue_policy): an overloaded replica answers
    # UNAVAILABLE / 503 at once instead of queueing without bound. None ("auto", the default): sized by
    # `serve` on the serving machine from the engine's measured cost to about queue_budget_ms of work
    # (serving/queue_bound.py; the signed config.pbtxt keeps a fallback) on a model with two or more instances; unbounded on a one-instance model, where Triton's batcher with
    # any queue policy can lose wake-ups and sleep up to its 500 ms idle wait (benchmarks/RESULTS.md,
    # "Overload"; docs/operations.md, "Overload shedding"). 0: unbounded; N: N requests.
    max_queue_size: int | None = None
    queue_budget_ms: int = 300
    shed_by: str = "age"  # age | count: how the "auto" bound sheds (recipe schema, docs/operations.md)
    queue_timeout_us: int = 0  # 0: a queued request waits as long as it takes
    timeout_action: str = "reject"  # reject | delay (what happens to a request past queue_timeout_us)
    priority_levels: int = 0  # 0: one priority; else requests carry a priority 1..levels
    default_priority: int = 0  # the level of a request that names none (with priority_levels)


@dataclass(frozen=True)
class RepositorySpec:
    """Where and how the Triton model repository is written."""

    path: Path
    # Two, as Triton's own default for CPU models: on a CPU they split the cores (ONNX Runtime threads,
    # RESULTS.md, "INT8 on the CPU"); two served 1.44x one instance's requests on 2 cores
    # (RESULTS.md, "Instances"), and a second instance is what lets the default queue bound work (max_queue_size above).
    # A large model on a small GPU: 1.
    instance_count: int = 2
    instance_kind: str = "auto"
    engine: str = "auto"  # which engine the backend serves with (docs/deployment.md, "Which engine")
    memory_pool_release_threshold_mib: int = 256
    memory_pool_initial_mib: int = 0
    # A GPU instance with no GPU engine that loads is refused, unless this allows ONNX Runtime on the CPU.
    allow_cpu_fallback: bool = False
    # The precision this deployment serves: its ONNX file (CPU) and its plan (GPU TensorRT), nothing else.
    serve: str = "fp32"
    # False: the version folder holds only the served precision's files; True: every built precision.
    keep_all_precisions: bool = False
    # ONNX Runtime threads per CPU instance; 0: the cores (affinity and cgroup quota) split between them.
    cpu_threads: int = 0
    # With the cores split: a run borrows every core while no other CPU instance computes (backend idle_cores).
    lend_idle_cores: bool = True
    # INT8 on ONNX Runtime CPU: auto (integer kernels where the CPU has VNNI/AMX/dot products), integer, simulated.
    int8_kernels: str = "auto"
    # Degrade before shedding (backend degrade.py): the cheaper precision a backlogged window runs on (None: off),
    # and the window size in requests from which it does (0: half of the largest preferred batch size, else of max_batch).
    degrade_to: str | None = None
    degrade_backlog: int = 0


@dataclass(frozen=True)
class GenerationSettings:
    """A text-generation model: what the Hugging Face folder says (checked) and the recipe's defaults.

    ``family`` is the config's ``model_type``; ``defaults`` holds only the sampling defaults the recipe's
    ``[generation]`` table sets (the rest come from ``generation_config.json`` at packaging).
    """

    family: str
    architecture: str
    max_positions: int
    eos_token_ids: tuple[int, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AdapterBase:
    """A LoRA adapter's base: its packaged version folder and its Hugging Face folder (``[adapter]``)."""

    model_dir: Path  # <repository>/<base model>
    version: int
    source: Path  # the base's Hugging Face folder

    @property
    def name(self) -> str:
        return self.model_dir.name

    @property
    def version_dir(self) -> Path:
        return self.model_dir / str(self.version)


@dataclass(frozen=True)
class Recipe:
    """One model build, end to end."""

    name: str
    version: int
    task: str
    source: SourceSpec
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    shapes: ShapeSpec
    export: ExportSpec
    precisions: tuple[str, ...]
    quantization: QuantizationSpec
    tensorrt: TensorRTSpec
    batching: BatchingSpec
    repository: RepositorySpec
    pooling: str = "mean"
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] = ()  # embedding sizes /v1/embeddings may cut to (and renormalize)
    text_input: bool = True
    probabilities: bool = False  # classification heads: also return softmax probabilities
    recipe_path: Path | None = None
    generation: GenerationSettings | None = None  # text-generation only
    adapter: AdapterBase | None = None  # a LoRA adapter's base (source.kind = "lora")
    # [serving]: the backend parameters that schedule a text-generation model, (name, text) as config.pbtxt holds them
    serving: tuple[tuple[str, str], ...] = ()
    work_dir: Path = field(default_factory=lambda: Path("build"))
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_generative(self) -> bool:
        """True for a text-generation model (a decoder with its KV cache; packaged by build/generative.py)."""
        return self.task == "text-generation"

    @property
    def is_adapter(self) -> bool:
        """True for a LoRA adapter on a packaged base (built by build/adapter.py)."""
        return self.source.kind == "lora"

    @property
    def is_text_model(self) -> bool:
        """True when the model reads token ids and ships a tokenizer (HF encoders)."""
        return self.source.kind == "huggingface"

