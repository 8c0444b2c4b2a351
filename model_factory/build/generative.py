"""Packaging a text-generation model: the decoupled ``config.pbtxt``, ``generation.json``, tokenizer, continuations.

The version folder of a text-generation model, besides what every model has (``model.py``, ``mf_backend/``,
``metadata.json``, ``export.json``, ``accuracy.json``, the signature beside it)::

    <repo>/<model>/config.pbtxt              decoupled, max_batch_size 0, the contract's GENERATE_INPUTS/OUTPUTS,
                                             one CPU instance (the backend batches continuously itself)
    <repo>/<model>/<v>/model.onnx (+ .data)  the served precision's graph (model.int4.onnx, ...), shared-slot KV
    <repo>/<model>/<v>/generation.json       GenerationSpec: KV layout, eos ids, defaults, weights' bytes
    <repo>/<model>/<v>/tokenizer/            tokenizer.json, tokenizer_config.json, the chat template
    <repo>/<model>/<v>/acceptance/continuations.json   FP32 torch greedy continuations that ``accept`` replays

:func:`layout_generative_version` is the one function that lays such a folder out from a recipe (the build's
package stage calls it; so may tests that need a real generative version).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from model_factory.backend.contract import (GENERATE_INPUTS, GENERATE_OUTPUTS, TEXT_GENERATION, Files,
                                            GenerationSpec, ModelParameters, SamplingDefaults, format_parameters,
                                            onnx_file, parse_parameters)
from model_factory.build.repository import (PackageResult, _stage_model, config_to_pbtxt, draft_precision,
                                            select_artifacts)
from model_factory.errors import FactoryError
from model_factory.fileio import atomic_dir, remove_stale_staging
from model_factory.locking import exclusive
from model_factory.recipe import Recipe, read_hf_config

_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "do_sample")


def _tensor(t: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": t.name, "data_type": t.data_type, "dims": list(t.dims)}
    if t.optional:
        d["optional"] = True
    return d


def generative_config_dict(recipe: Recipe, parameters: Mapping[str, str]) -> dict[str, Any]:
    """``config.pbtxt`` of a text-generation model in Triton's JSON form (as vLLM's backend writes its own)."""
    kind = {"auto": "KIND_CPU", "cpu": "KIND_CPU", "gpu": "KIND_GPU"}[recipe.repository.instance_kind]
    return {
        "name": recipe.name,
        "backend": "python",
        "max_batch_size": 0,  # Triton's batcher steps aside: the backend batches iteration by iteration
        "model_transaction_policy": {"decoupled": True},
        "input": [_tensor(t) for t in GENERATE_INPUTS],
        "output": [_tensor(t) for t in GENERATE_OUTPUTS],
        "instance_group": [{"count": 1, "kind": kind}],
        "parameters": {k: {"string_value": str(v)} for k, v in sorted(parameters.items())},
        "version_policy": {"specific": {"versions": [recipe.version]}},
    }


def generation_parameters(recipe: Recipe) -> ModelParameters:
    """The model parameters of a text-generation model (task, precision, its file, the vocabulary)."""
    r = recipe.repository
    cfg = read_hf_config(recipe.source.path) if recipe.source.path else {}
    return ModelParameters(
        max_sequence_length=recipe.shapes.max_context or recipe.shapes.max_sequence_length, sequence_buckets=None,
        engine="onnxruntime" if r.engine == "auto" else r.engine, cpu_threads=r.cpu_threads,
        precision=r.serve, onnx_file=onnx_file(r.serve), vocab_size=cfg.get("vocab_size"), task=TEXT_GENERATION)


def _generation_defaults(folder: Path, overrides: Mapping[str, Any]) -> SamplingDefaults:
    gen = {}
    if (folder / "generation_config.json").is_file():
        try:
            gen = json.loads((folder / "generation_config.json").read_text())
        except ValueError:
            gen = {}
    values: dict[str, Any] = {k: gen[k] for k in _SAMPLING_KEYS if k in gen and gen[k] is not None}
    if isinstance(gen.get("max_new_tokens"), int):
        values["max_tokens"] = gen["max_new_tokens"]
    values.update(overrides)
    return SamplingDefaults(**values)


def chat_template(tokenizer_dir: Path) -> str | None:
    """The tokenizer's chat template: ``chat_template.jinja`` or ``tokenizer_config.json``'s entry."""
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tc = tokenizer_dir / "tokenizer_config.json"
    if tc.is_file():
        template = json.loads(tc.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def generation_spec(recipe: Recipe, tokenizer_dir: Path, weights: Mapping[str, int],
                    batch_dependent: tuple[str, ...] = (),
                    kv_dtypes: Mapping[str, str] | None = None) -> GenerationSpec:
    """``generation.json`` from the Hugging Face config, the graph's weights and the recipe's defaults;
    ``kv_dtypes``: each packaged precision's KV element type (:func:`kv_dtype_of` its graph)."""
    from model_factory.build_engines.lm_graph import head_dim_of

    gen, src = recipe.generation, recipe.source.path
    assert gen is not None and src is not None
    cfg = read_hf_config(src)
    heads = int(cfg["num_attention_heads"])
    pad = cfg.get("pad_token_id")
    from model_factory.build_engines.attention_config import config_window

    window = config_window(src)  # as transformers attends (the graph's GroupQueryAttention has the same)
    return GenerationSpec(
        family=gen.family, num_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim_of(cfg),
        hidden_size=int(cfg["hidden_size"]), vocab_size=int(cfg["vocab_size"]),
        max_context=int(recipe.shapes.max_context or gen.max_positions), eos_token_ids=gen.eos_token_ids,
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        pad_token_id=pad if isinstance(pad, int) else None, kv_dtype="float32",
        kv_dtypes={p: d for p, d in sorted((kv_dtypes or {}).items()) if d != "float32"},
        sliding_window=window if isinstance(window, int) else None, weights_bytes=dict(weights),
        defaults=_generation_defaults(src, gen.defaults), chat_template=chat_template(tokenizer_dir),
        batch_dependent=tuple(batch_dependent))


def kv_dtype_of(graph: Path) -> str:
    """The element type of a text-generation graph's KV cache (``float32``, ``float16`` or ``int8``: contract.KV_DTYPES),
    read from its first ``past_key_values`` input."""
    import onnx

    from model_factory.backend.contract import KV_DTYPES

    names = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.INT8: "int8"}
    for i in onnx.load(str(graph), load_external_data=False).graph.input:
        if i.name.startswith("past_key_values."):
            dtype = names.get(i.type.tensor_type.elem_type)
            if dtype not in KV_DTYPES:
                raise FactoryError(f"{Path(graph).name}: its KV cache's element type {i.type.tensor_type.elem_type} "
                                   f"is none of {', '.join(KV_DTYPES)}. Fix: rebuild with this model-factory")
            return dtype
    raise FactoryError(f"{Path(graph).name} has no past_key_values input: not a text-generation graph. Fix: rebuild "
                       "with this model-factory")


def batch_dependent(graph: Path) -> bool:
    """Whether ``graph`` quantizes its activations per tensor as it runs (``DynamicQuantizeLinear``, dynamic INT8):
    one scale for every row of a step, so a sequence's output depends on what it is batched with."""
    import onnx

    return any(n.op_type == "DynamicQuantizeLinear"
               for n in onnx.load(str(graph), load_external_data=False).graph.node)


def write_continuations(export_dir: Path, out_dir: Path, min_agreement: float) -> Path:
    """``acceptance/continuations.json`` (contract format) from the export's torch reference."""
    from model_factory.build_engines.causal_lm import GOLDEN_TOKENS, read_reference

    with atomic_dir(out_dir) as tmp:
        (tmp / Files.CONTINUATIONS).write_text(json.dumps({
            "max_tokens": GOLDEN_TOKENS, "min_agreement": min_agreement,
            # Generated with min_new_tokens = max_tokens (eos never chosen before max_tokens): replay with min_tokens
            # (or ignore_eos) = max_tokens and greedy sampling.
            "prompts": [c.to_dict() for c in read_reference(export_dir)]}, indent=2) + "\n")
    return out_dir


def check_generative_packaged(version_dir: Path) -> None:
    """The staged version's own graph, read through generation.json, replays its first golden continuation."""
    from model_factory.build_engines.lm_graph import DecoderRunner

    version_dir = Path(version_dir)
    spec = GenerationSpec.from_json((version_dir / Files.GENERATION).read_text())
    from model_factory.build.repository import config_parameters, read_config

    params = parse_parameters(config_parameters(read_config(version_dir.parent)))
    golden = json.loads((version_dir / Files.ACCEPTANCE_DIR / Files.CONTINUATIONS).read_text())["prompts"][0]
    steps = 4
    runner = DecoderRunner(version_dir / params.onnx_file, len(golden["prompt_ids"]) + steps, spec.head_dim)
    got = runner.greedy(golden["prompt_ids"], steps, suppress=spec.eos_token_ids)
    if params.precision == "fp32" and golden["near_tie"] is None and got != golden["tokens"][:steps]:
        raise FactoryError(f"the packaged {params.onnx_file} does not replay its golden continuation ({got} vs "
                           f"{golden['tokens'][:steps]}). Fix: rebuild; report it if it persists")


def layout_generative_version(recipe: Recipe, artifacts: Mapping[str, Path], *, export_dir: Path,
                              extra_files: tuple[Path, ...] = (), build_info: Mapping[str, Any] | None = None,
                              sign: Callable[[Path], Any] | None = None, check: bool = True,
                              parameters: Mapping[str, str] | None = None) -> PackageResult:
    """Lay out ``<repo>/<model>/`` of a text-generation recipe from its exported (and quantized) graphs.

    ``artifacts`` maps version-folder names (``model.onnx``, ``model.int4.onnx``) to built graphs; ``export_dir``
    is the export stage's folder (tokenizer, reference continuations). Atomic like every package: the model folder
    is swapped in with one rename, signed while staged when ``sign`` is given.
    """
    from model_factory.build_engines.lm_quantize import weights_bytes
    from model_factory.recipe.gguf import converted

    recipe = converted(recipe)  # a gguf source: the folder its source stage wrote
    serve = recipe.repository.serve
    if onnx_file(serve) not in artifacts:
        raise FactoryError(f"repository.serve = \"{serve}\" but {onnx_file(serve)} was not built. Fix: add "
                           f"\"{serve}\" to precisions, or serve one that is built")
    files = select_artifacts(recipe, artifacts, draft_precision(recipe, artifacts, parameters))
    graphs = {(n.split(".")[1] if n != Files.ONNX else "fp32"): Path(path) for n, path in files.items()
              if n.endswith(".onnx")}  # precision -> its graph, as packaged
    tokenizer_dir = Path(export_dir) / Files.TOKENIZER_DIR
    spec = generation_spec(recipe, tokenizer_dir, {p: weights_bytes(g) for p, g in graphs.items()},
                           tuple(sorted(p for p, g in graphs.items() if p != "fp32" and batch_dependent(g))),
                           {p: kv_dtype_of(g) for p, g in graphs.items()})
    params = format_parameters(generation_parameters(recipe))
    params.update(dict(recipe.serving))  # [serving]: checked against the contract when the recipe was read
    params.update(parameters or {})
    pbtxt = config_to_pbtxt(generative_config_dict(recipe, params))
    work = recipe.work_dir / "package"
    work.mkdir(parents=True, exist_ok=True)
    gen_file = work / Files.GENERATION
    gen_file.write_text(spec.to_json())
    acceptance = write_continuations(Path(export_dir), recipe.work_dir / "acceptance",
                                     recipe.quantization.min_token_agreement)
    model_dir = recipe.repository.path / recipe.name
    with exclusive(model_dir, f"packaging or signing of {recipe.name}"):
        remove_stale_staging(model_dir.parent, model_dir.name)
        metadata = _stage_model(recipe, model_dir, str(recipe.version), pbtxt, files, tokenizer_dir,
                                (gen_file, *extra_files), build_info, sign, (), acceptance,
                                check_generative_packaged if check else None,
                                acceptance_file=f"{Files.ACCEPTANCE_DIR}/{Files.CONTINUATIONS}",
                                generation=json.loads(spec.to_json()))
    return PackageResult(model_dir, model_dir / str(recipe.version), model_dir / Files.CONFIG, metadata)

