"""TOML → :class:`~model_factory.recipe.schema.RecipeFile` → the frozen :class:`Recipe` every stage reads.

The schema checks each value on its own (types, choices, ranges, unknown keys). Here come the checks that
need several values or the filesystem, the defaults that depend on other keys, and the inputs and outputs
derived from the model (Hugging Face config, ONNX graph). Relative paths are resolved against the
recipe's folder, so a recipe and its data travel together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError

from model_factory.fileio import read_toml
from model_factory.recipe.errors import field_error as _err
from model_factory.recipe.errors import from_validation_error
from model_factory.recipe.causal_lm import check_causal_lm, generate_tensor_specs
from model_factory.recipe.huggingface import _hf_io_from_folder, read_hf_config, resolve_package_model
from model_factory.recipe.onnx_io import onnx_tensor_specs
from model_factory.recipe.schema import (BatchingTable, RecipeFile, RepositoryTable, SourceTable, TensorTable)
from model_factory.recipe.specs import (AdapterBase, BatchingSpec, ExportSpec, QuantizationSpec, Recipe, RepositorySpec,
                                        ShapeSpec, SourceSpec, TensorRTSpec, TensorSpec)


def validate_recipe_data(data: Mapping[str, Any]) -> RecipeFile:
    """Check a recipe mapping against the schema; a mismatch is a FactoryError naming the field and the fix."""
    try:
        return RecipeFile.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _path(value: str, base: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p)


def _source(src: SourceTable, base_dir: Path) -> tuple[Path | None, str | None]:
    """The model's path (huggingface folder, ONNX file) or factory (torch), checked to exist."""
    if src.kind == "huggingface":
        if src.package is not None:
            path = resolve_package_model(src.package)
        elif src.path is not None:
            path = _path(src.path, base_dir)
        else:
            raise _err("source.path", "missing", "set path to a local Hugging Face model folder (or package = \"...\")")
        if not path.is_dir():
            raise _err("source.path", f"{path} is not a folder", "point it at a folder saved with save_pretrained()")
        return path, None
    if src.kind == "lora":
        path = _path(src.path, base_dir) if src.path is not None else None
        if path is None or not (path / "adapter_config.json").is_file():
            raise _err("source.path", f"{path} holds no adapter_config.json" if path else "missing",
                       "point it at a PEFT LoRA folder saved with save_pretrained() (adapter_config.json and "
                       "adapter_model.safetensors)")
        return path, None
    if src.kind in ("gguf", "onnx"):  # one file
        what = {"gguf": "a .gguf file", "onnx": "an .onnx file"}[src.kind]
        if src.path is None:
            raise _err("source.path", "missing", f"set path to {what}")
        path = _path(src.path, base_dir)
        if not path.is_file():
            raise _err("source.path", f"{path} does not exist", f"point it at an existing {what.split(' ', 1)[1]}")
        return path, None
    if src.factory is None:
        raise _err("source.factory", "missing" + (" (a torch source takes factory, not path)" if src.path else ""),
                   "set factory = \"module:function\", a function returning (torch.nn.Module, example_inputs); "
                   "its module may sit beside the recipe")
    return None, src.factory


INTEGER_DTYPES = ("INT64", "INT32", "INT16", "INT8", "UINT8")


def _tensor_specs(items: list[TensorTable] | None, section: str) -> tuple[TensorSpec, ...]:
    if items is None:
        raise _err(section, "expected a non-empty array of tables", f"add [[{section}]] entries with name, dtype, dims")
    for i, t in enumerate(items):
        bounds = t.range
        if bounds is not None and not (section == "inputs" and t.dtype.upper() in INTEGER_DTYPES
                                       and bounds[0] <= bounds[1]):
            raise _err(f"{section}[{i}].range", f"{bounds!r} is not a range of an integer input",
                       "give range = [low, high] (whole numbers, low <= high) on an integer [[inputs]] entry")
    specs = tuple(TensorSpec(t.name, t.dtype.upper(), tuple(t.dims), t.optional,
                             (int(t.range[0]), int(t.range[1])) if t.range is not None else None) for t in items)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise _err(section, f"duplicate tensor names {names}", "give every tensor a distinct name")
    return specs


def _buckets(declared: list[int] | None, max_len: int) -> tuple[int, ...]:
    buckets = tuple(declared) if declared is not None else ((min(32, max_len), max_len) if max_len > 32
                                                             else (max_len,))
    if list(buckets) != sorted(set(buckets)):
        raise _err("shapes.sequence_buckets", f"{list(buckets)} is not strictly increasing",
                   "list each length once, smallest first")
    if buckets[-1] != max_len:
        raise _err("shapes.sequence_buckets", f"the last bucket {buckets[-1]} differs from max_sequence_length "
                   f"{max_len}", "end the list with max_sequence_length")
    return buckets


def _batching(b: BatchingTable, max_batch: int, max_len: int, inputs: tuple[TensorSpec, ...]) -> BatchingSpec:
    pref = tuple(b.preferred_batch_sizes) if b.preferred_batch_sizes is not None else (
        tuple(s for s in (8, 16, 32) if s <= max_batch) or (max_batch,))
    if any(p > max_batch for p in pref):
        raise _err("batching.preferred_batch_sizes", f"{list(pref)} exceeds shapes.max_batch {max_batch}",
                   "keep every preferred size at or below max_batch")
    # A budget under the longest request would leave that request no group to run in.
    if b.max_group_tokens != 0 and b.max_group_tokens < max_len:
        raise _err("batching.max_group_tokens", f"{b.max_group_tokens} is below shapes.max_sequence_length "
                   f"{max_len}", f"use 0 (no budget) or at least {max_len}")
    # The default sheds by age where it can: an "auto" bound and no queue timeout of the recipe's own; a fixed
    # bound or a timeout given sheds as given (count). Asked for by name where it cannot, it is an error.
    shed_by = b.shed_by
    if shed_by == "age" and (b.max_queue_size != "auto" or b.queue_timeout_us):
        if "shed_by" not in b.model_fields_set:
            shed_by = "count"
        elif b.max_queue_size != "auto":
            raise _err("batching.shed_by", f'"age" needs max_queue_size = "auto" (it is {b.max_queue_size})',
                       'use max_queue_size = "auto" (the bound derived where the model serves), or keep your fixed '
                       "bound and set queue_timeout_us yourself")
        else:
            raise _err("batching.shed_by", f'"age" sheds at queue_budget_ms, and queue_timeout_us is also set '
                       f"({b.queue_timeout_us})", "give the wait as queue_budget_ms and remove queue_timeout_us")
    levels = b.priority_levels
    if not levels and b.default_priority is not None:
        raise _err("batching.default_priority", "is set without priority_levels",
                   "declare priority_levels too, or remove default_priority")
    default = b.default_priority if b.default_priority is not None else (levels + 1) // 2
    if levels and not 1 <= default <= levels:
        raise _err("batching.default_priority", f"{default} is outside 1..{levels}",
                   "give a level between 1 and priority_levels")
    pad = b.pad_sequences if b.pad_sequences is not None else any(s.name == "attention_mask" for s in inputs)
    return BatchingSpec(
        preferred_batch_sizes=pref, max_queue_delay_us=b.max_queue_delay_us, grouping=b.grouping,
        ragged=b.ragged, max_group_tokens=b.max_group_tokens, pad_sequences=pad,
        max_queue_size=None if b.max_queue_size == "auto" else b.max_queue_size,
        queue_budget_ms=b.queue_budget_ms, shed_by=shed_by, queue_timeout_us=b.queue_timeout_us,
        timeout_action=b.timeout_action, priority_levels=levels, default_priority=default if levels else 0)


def _repository(r: RepositoryTable, precisions: tuple[str, ...], export: ExportSpec, trt: TensorRTSpec,
                base_dir: Path) -> RepositorySpec:
    # An engine the package will not have files for would leave the model unavailable at load: say so now.
    if r.engine == "torch" and not export.torchscript:
        raise _err("repository.engine", "torch serves model.torchscript.pt, which this recipe does not make",
                   "set export.torchscript = true, or engine = \"auto\"")
    if r.engine == "tensorrt" and not trt.enabled:
        raise _err("repository.engine", "tensorrt serves a TensorRT plan, which this recipe does not build",
                   "set tensorrt.enabled = true, or engine = \"auto\"")
    if r.serve not in precisions:
        raise _err("repository.serve", f"{r.serve!r} is not among precisions {list(precisions)}",
                   f"add \"{r.serve}\" to precisions, or serve one of {', '.join(precisions)}")
    if r.engine == "torch" and r.serve != "fp32":
        raise _err("repository.serve", f"engine = \"torch\" serves the FP32 torch program (model.pt2), not {r.serve}",
                   "set serve = \"fp32\", or engine = \"auto\" (TensorRT plan on a GPU, ONNX Runtime on a CPU)")
    if r.degrade_to is not None:
        if r.degrade_to not in precisions:
            raise _err("repository.degrade_to", f"{r.degrade_to!r} is not among precisions {list(precisions)}, so it "
                       "is not built", f"add \"{r.degrade_to}\" to precisions, or remove degrade_to")
        if r.degrade_to == r.serve:
            raise _err("repository.degrade_to", f"{r.degrade_to!r} is the precision served: nothing cheaper to "
                       "degrade to", "degrade to a cheaper precision than serve, or remove degrade_to")
    return RepositorySpec(
        path=_path(r.path, base_dir), instance_count=r.instance_count, instance_kind=r.instance_kind,
        engine=r.engine, memory_pool_release_threshold_mib=r.memory_pool_release_threshold_mib,
        memory_pool_initial_mib=r.memory_pool_initial_mib, allow_cpu_fallback=r.allow_cpu_fallback,
        serve=r.serve, keep_all_precisions=r.keep_all_precisions, cpu_threads=r.cpu_threads,
        lend_idle_cores=r.lend_idle_cores, int8_kernels=r.int8_kernels, degrade_to=r.degrade_to,
        degrade_backlog=r.degrade_backlog)


def _check_generative_precisions(precisions: tuple[str, ...], calib: Path | None, heldout: Path | None) -> None:
    if set(precisions) & {"fp16", "int8", "int4", "gguf"} and calib is None and heldout is None:
        wanted = [p for p in ("fp16", "int8", "int4", "gguf") if p in precisions]
        raise _err("quantization.heldout_data", f"{'/'.join(wanted)} {'is' if len(wanted) == 1 else 'are'} gated on "
                   "held-out text and none is set",
                   "point heldout_data (or calibration_data) at a local .txt of your text, one sample per line")


def _adapter_base(table: Any, base_dir: Path) -> AdapterBase:
    """[adapter]: the base's model folder (its newest version unless named) and Hugging Face folder, checked."""
    for key in ("base", "base_source"):
        if getattr(table, key) is None:
            raise _err(f"adapter.{key}", "missing", "set base to <repository>/<model> of the packaged base and "
                       "base_source to its Hugging Face folder")
    model_dir, source = _path(table.base, base_dir), _path(table.base_source, base_dir)
    versions = sorted(int(p.name) for p in model_dir.iterdir() if p.name.isdigit()) if model_dir.is_dir() else []
    version = table.base_version or (versions[-1] if versions else None)
    if version is None or version not in versions:
        raise _err("adapter.base", f"{model_dir} has no version {version or ''} folder".replace("  ", " "),
                   "build the base first (model-factory build its recipe) and point base at <repository>/<model>")
    if not (source / "config.json").is_file():
        raise _err("adapter.base_source", f"{source} holds no config.json",
                   "point it at the base's Hugging Face folder (the one its recipe's source.path names)")
    return AdapterBase(model_dir, int(version), source)


def _serving(table: Any, task: str, kind: str, precisions: tuple[str, ...],
             serve: str) -> tuple[tuple[str, str], ...]:
    """[serving]'s keys set, as the ``config.pbtxt`` parameters the backend reads (``(name, text)`` in
    ``SERVING_PARAMETERS``' order); checked as the backend checks them."""
    from model_factory.backend.contract import ParameterError, parse_parameters

    given = {k: v for k, v in table.model_dump().items() if v is not None}
    if not given:
        return ()
    if task != "text-generation":
        raise _err(f"serving.{next(iter(given))}", f"[serving] schedules a text-generation model, not task {task!r}",
                   "remove the [serving] table")
    if kind == "lora":
        raise _err(f"serving.{next(iter(given))}", "a LoRA adapter is served by its base's instances, which its base's "
                   "recipe schedules", "set [serving] in the base's recipe and remove it here")
    params = {k: str(v) for k, v in given.items()}
    try:
        typed = parse_parameters(params)
    except ParameterError as exc:  # the schema's types are the contract's: a value past them is named here too
        raise _err("serving", str(exc), "correct the value") from None
    if typed.prompt_lookup_min > typed.prompt_lookup_max:
        raise _err("serving.prompt_lookup_min", f"{typed.prompt_lookup_min} is above prompt_lookup_max "
                   f"{typed.prompt_lookup_max}", "the shortest n-gram looked up must be at most the longest")
    draft = typed.speculative_draft
    if typed.speculative == "draft" and draft == "none":
        raise _err("serving.speculative", "draft takes the precision whose graph drafts, and none is named",
                   f"set speculative_draft to one of the precisions built other than {serve!r}")
    if draft != "none":
        if typed.speculative != "draft":
            raise _err("serving.speculative_draft", f"a draft precision ({draft}) is for speculative = \"draft\"",
                       "set speculative = \"draft\", or remove speculative_draft")
        if draft not in precisions or draft == serve:
            raise _err("serving.speculative_draft", f"{draft!r} is " + ("the precision served" if draft == serve
                                                                         else "not among the precisions built"),
                       f"name a precision of precisions other than the one served ({serve})")
    return tuple(params.items())


def parse_recipe(data: Mapping[str, Any], base_dir: Path, recipe_path: Path | None = None) -> Recipe:
    """Validate a recipe mapping (as read from TOML) and return a :class:`Recipe`."""
    doc = validate_recipe_data(data)
    name, version, task, kind = doc.model.name, doc.model.version, doc.model.task, doc.source.kind
    path, factory = _source(doc.source, base_dir)

    text_input = doc.embedding.text_input if doc.embedding.text_input is not None else kind == "huggingface"
    probabilities = doc.classification.probabilities
    if probabilities and task not in ("classification", "token-classification"):
        raise _err("classification.probabilities", f"task {task!r} has no class logits to turn into probabilities",
                   "remove it, or set model.task = \"classification\" or \"token-classification\"")

    generation, max_context, adapter = None, None, None
    if kind == "gguf" and task != "text-generation":
        raise _err("model.task", f"a gguf source is a language model, not a {task!r} model",
                   "set task = \"text-generation\"")
    if "gguf" in doc.precisions and kind != "gguf":
        raise _err("precisions", f"gguf carries a GGUF's own quantized blocks, and this source is {kind}",
                   "remove \"gguf\" from precisions, or build from the .gguf file (kind = \"gguf\")")
    if (kind == "lora") != (doc.adapter is not None):
        raise _err("adapter", "[adapter] names a LoRA adapter's base and goes with source.kind = \"lora\"",
                   "set both (kind = \"lora\" and [adapter] base, base_source), or neither")
    if kind == "lora":
        if task != "text-generation":
            raise _err("model.task", f"a LoRA adapter applies to a text-generation base, not task {task!r}",
                       "set task = \"text-generation\"")
        adapter = _adapter_base(doc.adapter, base_dir)
        generation, max_context = check_causal_lm(adapter.source, read_hf_config(adapter.source),
                                                  doc.shapes.max_context, {})
        inputs, outputs = generate_tensor_specs()
    elif task == "text-generation":
        if kind not in ("huggingface", "gguf") or path is None:
            raise _err("source.kind", f"text-generation builds Hugging Face causal-LM folders, not a {kind} source",
                       "set kind = \"huggingface\" and path to a folder saved with save_pretrained() (or kind = "
                       "\"gguf\" and path to a .gguf file)")
        if doc.inputs is not None or doc.outputs is not None:
            raise _err("inputs", "a text-generation model's inputs and outputs are the generate API's (text_input, "
                       "max_tokens, ... -> text_output), not declared", "remove [[inputs]] and [[outputs]]")
        if doc.repository.degrade_to is not None:
            raise _err("repository.degrade_to", "a text-generation model does not degrade (its scheduler admits by "
                       "memory and answers 503 + Retry-After past max_waiting_sequences)", "remove degrade_to")
        if doc.repository.instance_kind == "gpu" and doc.repository.serve != "fp16":
            raise _err("repository.serve", f"a text-generation model on a GPU instance serves the fp16 graph (ONNX "
                       f"Runtime's CUDA attention computes in float16 only), not {doc.repository.serve}",
                       "set serve = \"fp16\" (with fp16 among precisions), or instance_kind = \"cpu\"")
        defaults = {k: v for k, v in doc.generation.model_dump().items() if v is not None}
        if kind == "gguf":
            from model_factory.recipe.gguf import check_gguf

            generation, max_context, _header = check_gguf(path, doc.shapes.max_context, defaults)
        else:
            generation, max_context = check_causal_lm(path, read_hf_config(path), doc.shapes.max_context, defaults)
        inputs, outputs = generate_tensor_specs()
    elif doc.inputs is not None or doc.outputs is not None:
        inputs = _tensor_specs(doc.inputs, "inputs")
        outputs = _tensor_specs(doc.outputs, "outputs")
        text_input = text_input and any(s.dtype == "BYTES" for s in inputs)
    elif kind == "huggingface":
        assert path is not None
        inputs, outputs = _hf_io_from_folder(path, text_input, task, probabilities)
    elif kind == "onnx":
        assert path is not None
        inputs, outputs = onnx_tensor_specs(path)
    else:
        raise _err("inputs", f"a {kind} source needs its inputs and outputs declared",
                   "add [[inputs]] and [[outputs]] tables with name, dtype and dims")

    sh = doc.shapes
    overlap = sh.chunk_overlap if sh.chunk_overlap is not None else min(32, sh.max_sequence_length // 4)
    shapes = ShapeSpec(sh.max_batch, sh.max_sequence_length, _buckets(sh.sequence_buckets, sh.max_sequence_length),
                       sh.long_inputs, overlap, max_context)
    if sh.long_inputs == "chunk" and task != "embedding":
        raise _err("shapes.long_inputs", f"chunk pools windows into one vector, which a {task} model does not return",
                   "use refuse or truncate")
    if overlap and overlap >= sh.max_sequence_length // 2:
        raise _err("shapes.chunk_overlap", f"{sh.chunk_overlap} tokens is half max_sequence_length "
                   f"{sh.max_sequence_length} or more", f"use fewer than {sh.max_sequence_length // 2} tokens")
    if task != "text-generation" and sh.max_context is not None:
        raise _err("shapes.max_context", f"is for text-generation models, not task {task!r}",
                   "remove it (max_sequence_length bounds an encoder's input)")
    if task != "text-generation" and any(v is not None for v in doc.generation.model_dump().values()):
        raise _err("generation", f"[generation] sets sampling defaults of a text-generation model, not task {task!r}",
                   "remove the [generation] table")

    ex = doc.export
    if ex.torchscript and kind == "onnx":
        raise _err("export.torchscript", "an onnx source has no torch module to trace",
                   "set export.torchscript = false, or build from the huggingface folder or torch factory "
                   "the ONNX file came from")
    export = ExportSpec(ex.opset, float(ex.tolerance), ex.dynamo, ex.torchscript)

    precisions = tuple(doc.precisions)
    if "fp32" not in precisions:
        raise _err("precisions", "fp32 is missing",
                   "keep \"fp32\": it is the reference the accuracy gate compares against")

    q = doc.quantization
    calib = _path(q.calibration_data, base_dir) if q.calibration_data is not None else None
    heldout = _path(q.heldout_data, base_dir) if q.heldout_data is not None else None
    if task == "text-generation":
        _check_generative_precisions(precisions, calib, heldout)
    elif "int4" in precisions:
        raise _err("precisions", f"int4 (weight-only) is built for text-generation models, not task {task!r}",
                   "use fp32, fp16 or int8")
    elif "int8" in precisions and calib is None:
        raise _err("quantization.calibration_data", "int8 needs calibration data and none is set",
                   "point calibration_data at a local .txt/.jsonl of your inputs or an .npz of tensors")
    if doc.embedding.matryoshka_dimensions and task != "embedding":
        raise _err("embedding.matryoshka_dimensions", f"it is an embedding model's, not task {task!r}'s",
                   "remove embedding.matryoshka_dimensions")
    if q.kv_cache == "int8":
        if task != "text-generation":
            raise _err("quantization.kv_cache", f"a KV cache is a text-generation model's, not task {task!r}'s",
                       "remove quantization.kv_cache")
        if not {"int8", "int4"} & set(precisions):
            raise _err("quantization.kv_cache", "int8 applies to the int8 and int4 graphs and precisions lists "
                       "neither", "add \"int8\" or \"int4\" to precisions, or remove quantization.kv_cache")
        if calib is None:
            raise _err("quantization.calibration_data", "kv_cache = \"int8\" fits its scales on calibration text "
                       "and none is set", "point calibration_data at a local .txt/.jsonl of your text")
    if "fp16" in precisions and calib is None and heldout is None:
        raise _err("quantization.heldout_data", "fp16 is scored against fp32 on held-out data and none is set",
                   "point heldout_data (or calibration_data) at a local .txt/.jsonl/.npz of your inputs")
    for where, p in (("quantization.calibration_data", calib), ("quantization.heldout_data", heldout)):
        if p is not None and not p.is_file():
            raise _err(where, f"{p} does not exist", "point it at an existing local file")
    quant = QuantizationSpec(
        calibration_data=calib, heldout_data=heldout, method=q.method,
        max_calibration_samples=q.max_calibration_samples, max_heldout_samples=q.max_heldout_samples,
        min_accuracy=None if q.min_accuracy is None else float(q.min_accuracy), mixed_precision=q.mixed_precision,
        int8_method=q.int8_method, int4_method=q.int4_method, int4_block_size=q.int4_block_size,
        int4_symmetric=q.int4_symmetric,
        max_perplexity_ratio=1.1 if q.max_perplexity_ratio is None else float(q.max_perplexity_ratio),
        min_token_agreement=0.8 if q.min_token_agreement is None else float(q.min_token_agreement),
        kv_cache=q.kv_cache)

    t = doc.tensorrt
    trt = TensorRTSpec(
        enabled=t.enabled, workspace_mib=t.workspace_mib, optimization_level=t.optimization_level,
        timing_cache=_path(t.timing_cache, base_dir) if t.timing_cache is not None else None,
        hardware_compatibility=t.hardware_compatibility, version_compatible=t.version_compatible)

    batching = _batching(doc.batching, shapes.max_batch, shapes.max_sequence_length, inputs)
    repo = _repository(doc.repository, precisions, export, trt, base_dir)
    serving = _serving(doc.serving, task, kind, precisions, repo.serve)

    return Recipe(
        name=name, version=version, task=task,
        source=SourceSpec(kind, path, factory, doc.source.package, base_dir, doc.source.allow_pickle),
        inputs=inputs, outputs=outputs, shapes=shapes,
        export=export, precisions=precisions, quantization=quant, tensorrt=trt,
        batching=batching, repository=repo, pooling=doc.embedding.pooling, normalize=doc.embedding.normalize,
        matryoshka_dimensions=tuple(sorted(set(doc.embedding.matryoshka_dimensions or ()))),
        text_input=text_input, probabilities=probabilities, recipe_path=recipe_path, generation=generation,
        adapter=adapter, serving=serving,
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
        if isinstance(target, dict):  # a section that is not a table is refused by the schema below
            target[key] = value
    return parse_recipe(data, path.resolve().parent, path.resolve())
