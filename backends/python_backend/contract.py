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
from dataclasses import dataclass, field
from typing import Any, Mapping

PRECISIONS = ("fp32", "fp16", "int8")
ENGINES = ("auto", "onnxruntime", "tensorrt", "torch")
GROUPINGS = ("cost_model", "pad_to_longest", "none")
WARMUPS = ("short", "sweep")
QUEUE_BOUNDS = ("fixed", "auto")
INT8_KERNELS = ("auto", "integer", "simulated")
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
    ``choice`` (one of ``choices``), ``ints`` (comma-separated lengths), ``floats3?`` (``a,b,c``).
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
    # The allowed [low, high] of each index-like input, as JSON {"name": [low, high]} (input_bounds.py parses it:
    # it needs numpy, which this file may not import); None: no bounds beyond input_ids < vocab_size.
    input_bounds: str | None = _param("str?", None)
    # Texts over max_sequence_length (long_inputs.py): the model's default; a request may ask for another.
    long_inputs: str = _param("choice", "refuse", choices=LONG_INPUTS)
    # Tokens two neighbouring chunks share, and how chunk vectors are pooled ("none": chunking not offered).
    chunk_overlap: int = _param("int", 32, minimum=0)
    chunk_pooling: str = _param("choice", "none", choices=CHUNK_POOLINGS)


def format_bounds(bounds: Mapping[str, tuple[int, int]]) -> str:
    """The ``input_bounds`` parameter's text: ``{"name": [low, high]}``, sorted, compact (input_bounds.py reads it)."""
    import json

    return json.dumps({k: [int(lo), int(hi)] for k, (lo, hi) in sorted(bounds.items())}, separators=(",", ":"))


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
