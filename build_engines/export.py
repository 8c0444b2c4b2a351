"""Export stage: a Hugging Face folder, a torch module or an ONNX file becomes ``model.onnx``.

The exported graph has dynamic batch and sequence axes and is checked against
the source framework on sample inputs (max abs error reported; over the
recipe's tolerance the stage fails). Everything is written to a temporary
folder first and renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from model_factory.backend.contract import Files
from model_factory.build_engines import onnx_files
from model_factory.build_engines.hf_modules import (AUTO_CLASSES, SAMPLE_PAIRS, SAMPLE_TEXTS,  # noqa: F401
                                                    _embedding_module, _encoder_inputs, _head_module, _hf_samples,
                                                    _load_hf)
from model_factory.build_engines.torch_factory import call_factory, factory_import_path, load_factory  # noqa: F401
from model_factory.build_engines.reproducible import normalize_torchscript
from model_factory.errors import FactoryError, require
from model_factory.fileio import atomic_dir, digest_path
from model_factory.memory import release_memory
from model_factory.progress import heartbeat
from model_factory.recipe import Recipe, TensorSpec, graph_tensor_specs

# From this many parameters on, a recipe that does not choose gets torch's dynamo exporter (see _torch_export).
DYNAMO_MIN_PARAMETERS = 32_000_000

# Tokenizer files copied next to the model so the backend tokenizes with the model's own vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "merges.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model", "added_tokens.json")


from model_factory.build_engines.export_result import ExportResult  # noqa: E402,F401  (re-exported)
from model_factory.build_engines.ort_session import onnxruntime_session  # noqa: E402,F401  (re-exported)


def export_model(recipe: Recipe, out_dir: Path | None = None, progress: Callable[[str], None] | None = None) -> ExportResult:
    """Run the export stage for ``recipe`` into ``out_dir`` (default: the recipe's work dir)."""
    say = progress or (lambda _msg: None)
    if recipe.export.torchscript and recipe.source.kind == "onnx":
        raise FactoryError("export.torchscript = true, but an onnx source has no torch module to trace. Fix: set "
                           "export.torchscript = false, or build from the huggingface folder or torch factory")
    from model_factory.build_engines.source_scan import scan_source, scan_summary

    if recipe.source.kind == "gguf":  # the source stage first (model-factory export alone): GGUF -> HF folder
        from model_factory.build_engines.gguf_source import convert_gguf
        from model_factory.recipe.gguf import converted

        convert_gguf(recipe, progress=progress)
        recipe = converted(recipe)
    # Before any library opens a source file: classified, its pickles scanned; a refused one stops here.
    scan = scan_source(recipe).to_dict()
    say(f"[scan] {scan_summary(scan)}")
    if recipe.is_generative:  # a decoder with its KV cache: the model builder, checked against transformers
        import dataclasses

        from model_factory.build_engines.causal_lm import export_causal_lm

        return dataclasses.replace(export_causal_lm(recipe, out_dir, progress), source_scan=scan)
    out_dir = Path(out_dir or recipe.work_dir / "export")
    with atomic_dir(out_dir) as tmp:
        if recipe.source.kind == "huggingface":
            result = _export_huggingface(recipe, tmp, say)
        elif recipe.source.kind == "torch":
            result = _export_torch_factory(recipe, tmp, say)
        else:
            result = _import_onnx(recipe, tmp, say)
        (tmp / Files.EXPORT_REPORT).write_text(json.dumps({
            "max_abs_error": result.max_abs_error, "tolerance": result.tolerance,
            "source_digest": result.source_digest, "opset": result.opset, "source_scan": scan,
            "inputs": list(result.input_names), "outputs": list(result.output_names),
            "torchscript": None if result.torchscript_path is None else {
                "file": result.torchscript_path.name, "max_abs_error": result.torchscript_max_abs_error,
                "torch": _torch_version()},
        }, indent=2))
    # Paths inside the result pointed into the temporary folder; re-base them.
    return ExportResult(
        onnx_path=out_dir / result.onnx_path.name,
        max_abs_error=result.max_abs_error, tolerance=result.tolerance,
        tokenizer_dir=(out_dir / Files.TOKENIZER_DIR) if result.tokenizer_dir else None,
        source_digest=result.source_digest, opset=result.opset,
        input_names=result.input_names, output_names=result.output_names,
        torchscript_path=(out_dir / result.torchscript_path.name) if result.torchscript_path else None,
        torchscript_max_abs_error=result.torchscript_max_abs_error, source_scan=scan,
    )


def _torch_version() -> str | None:
    import sys

    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", None)


def _check_tolerance(err: float, recipe: Recipe) -> None:
    if not np.isfinite(err) or err > recipe.export.tolerance:
        raise FactoryError(
            f"the exported ONNX differs from the source model by {err:.3g} (max abs), over the "
            f"tolerance {recipe.export.tolerance:g}. Fix: check the model for ops that export badly, "
            "or raise export.tolerance if this difference is acceptable")


def _export_huggingface(recipe: Recipe, tmp: Path, say: Callable[[str], None]) -> ExportResult:
    torch = require("torch", "export")
    transformers = require("transformers", "export")
    src = recipe.source.path
    assert src is not None
    # Air-gapped: never let transformers look for a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    say(f"loading {src}")
    transformers.utils.logging.disable_progress_bar()
    task = recipe.task
    tok, hf = _load_hf(transformers, src, task)
    names = [s.name for s in recipe.inputs if s.dtype != "BYTES"]
    use_tti = "token_type_ids" in names
    if task in AUTO_CLASSES:
        wrapper = _head_module(hf, task, recipe.probabilities)
        out_names = [s.name for s in recipe.outputs]
    else:
        wrapper = _embedding_module(hf, recipe.pooling, recipe.normalize)
        out_names = ["last_hidden_state", "embedding"]
    samples = SAMPLE_PAIRS if task == "reranker" else SAMPLE_TEXTS
    max_len = recipe.shapes.max_sequence_length
    batch = _hf_samples(tok, task, samples, max_len)
    args = [batch["input_ids"], batch["attention_mask"]]
    if use_tti:
        args.append(batch.get("token_type_ids", torch.zeros_like(batch["input_ids"])))
    in_names = ["input_ids", "attention_mask"] + (["token_type_ids"] if use_tti else [])
    onnx_path = tmp / Files.ONNX
    # The check runs at the traced shape and at another batch size and length: dynamic axes must hold.
    # The source's outputs are computed first, so the torch model can go before ONNX Runtime loads its copy.
    single = _hf_samples(tok, task, samples[2:3], max_len)
    single_args = [single["input_ids"], single["attention_mask"]]
    if use_tti:
        single_args.append(single.get("token_type_ids", torch.zeros_like(single["input_ids"])))
    checks = [(dict(zip(in_names, (a.numpy() for a in sample))), _reference(torch, wrapper, sample))
              for sample in (args, single_args)]
    say(f"exporting to ONNX ({task}: {', '.join(out_names)})")
    dyn = {n: {0: "batch", 1: "sequence"} for n in in_names}
    for spec in recipe.outputs:
        if spec.name in out_names:
            dyn[spec.name] = {0: "batch", 1: "sequence"} if spec.dims and spec.dims[0] == -1 else {0: "batch"}
    with heartbeat(say, "exporting to ONNX", every=15.0):  # minutes for a large model: say it is alive
        opset = _torch_export(torch, wrapper, tuple(args), onnx_path, in_names, out_names, dyn, recipe, say)
    if not recipe.export.torchscript:
        # The torch model is done with: free it before ONNX Runtime loads its own copy of the weights.
        del wrapper, hf
        release_memory()
    onnx_files.normalize(onnx_path)
    err = max(_compare_with_ort(onnx_path, checks, out_names))
    say(f"max abs error vs torch: {err:.3g}")
    _check_tolerance(err, recipe)
    ts_path, ts_err = None, None
    if recipe.export.torchscript:
        ts_path, ts_err = save_exported_program(torch, wrapper, [tuple(args), tuple(single_args)], tmp, in_names,
                                                out_names, recipe, say, dynamic={n: (0, 1) for n in in_names})
    tok_dir = tmp / Files.TOKENIZER_DIR
    tok.save_pretrained(str(tok_dir))
    return ExportResult(onnx_path, err, recipe.export.tolerance, tok_dir, digest_path(src), opset,
                        tuple(in_names), tuple(out_names), ts_path, ts_err)


def use_dynamo(recipe: Recipe, parameters: int) -> bool:
    """The exporter for a model of ``parameters`` parameters: the recipe's choice, else by size."""
    if recipe.export.dynamo is not None:
        return recipe.export.dynamo
    return parameters >= DYNAMO_MIN_PARAMETERS


def _torch_export(torch: Any, module: Any, args: tuple, path: Path, in_names: list[str], out_names: list[str],
                  dynamic_axes: dict[str, dict[int, str]], recipe: Recipe, say: Callable[[str], None] = lambda _m: None
                  ) -> int:
    """Export ``module`` to ``path``; returns the opset written.

    The TorchScript exporter holds the model, its constant-folded weights and the serialized proto at
    once (about four copies of the weights at its peak); the dynamo exporter references the module's
    tensors and streams them into the external-data file (measured: 3.2 vs 0.5 copies beyond the model,
    BERT 53M). A recipe that leaves ``export.dynamo`` unset gets the dynamo exporter from
    :data:`DYNAMO_MIN_PARAMETERS` parameters on (at opset 18 at least, which it needs).
    """
    parameters = sum(p.numel() for p in module.parameters())
    dynamo = use_dynamo(recipe, parameters)
    opset = max(recipe.export.opset, 18) if dynamo and recipe.export.dynamo is None else recipe.export.opset
    if dynamo and recipe.export.dynamo is None:
        say(f"{parameters / 1e6:.0f}M parameters: exporting with torch's dynamo exporter (opset {opset}), which "
            "streams the weights")
    try:
        # The tracer warns about every Python-level branch in transformers' code; the exported
        # graph is checked numerically against the source below, which is what decides. The dynamo
        # exporter prints its progress on stdout: kept out of the build's output.
        with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            if dynamo:
                # Its registry warns about torchvision ops it cannot find (torchvision is not a dependency).
                logging.getLogger("torch.onnx").setLevel(logging.ERROR)
                # Output names are set afterwards: given to the dynamo exporter, a name that is also an
                # internal value's ("embedding") is defined twice and ONNX Runtime refuses the model.
                torch.onnx.export(module, args, str(path), input_names=in_names, opset_version=opset, dynamo=True,
                                  external_data=True,
                                  dynamic_axes={k: v for k, v in dynamic_axes.items() if k in in_names})
            else:
                torch.onnx.export(module, args, str(path), input_names=in_names, output_names=out_names,
                                  dynamic_axes=dynamic_axes, opset_version=opset, dynamo=False,
                                  do_constant_folding=True)
    except Exception as exc:  # torch raises many types here; all mean "this model did not export"
        other = "false" if dynamo else "true"
        raise FactoryError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}. Fix: check the model's "
                           f"forward() runs on the example inputs, or try export.dynamo = {other}") from exc
    if dynamo:
        _name_outputs(path, out_names)
    return opset


def _name_outputs(path: Path, out_names: list[str]) -> None:
    """Give the graph's outputs ``out_names`` (in order), renaming any internal value that holds one first."""
    model = onnx_files.load_graph(path)
    graph = model.graph
    current = [o.name for o in graph.output]
    if len(current) != len(out_names):
        raise FactoryError(f"the exported graph has {len(current)} outputs but the recipe declares {len(out_names)} "
                           f"{out_names}. Fix: make forward() return one tensor per [[outputs]] entry")
    renames = {}
    taken = ({x for n in graph.node for x in (*n.input, *n.output)} | {i.name for i in graph.initializer}
             | {i.name for i in graph.input} | {v.name for v in graph.value_info})
    for old, new in zip(current, out_names):
        if old != new and new in taken:
            renames[new] = f"{new}__internal"
    renames.update({old: new for old, new in zip(current, out_names) if old != new})
    if not renames:
        return

    def fix(names: Any) -> None:
        for i, name in enumerate(names):
            if name in renames:
                names[i] = renames[name]

    for node in graph.node:
        fix(node.input)
        fix(node.output)
    for value in (*graph.output, *graph.value_info, *graph.initializer):
        value.name = renames.get(value.name, value.name)
    path.write_bytes(model.SerializeToString())  # the graph only: its weights stay in the data file


def _as_outputs(torch: Any, value: Any) -> list[Any]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def save_exported_program(torch: Any, module: Any, samples: list[tuple], tmp: Path, in_names: list[str],
                          out_names: list[str], recipe: Recipe, say: Callable[[str], None],
                          dynamic: dict[str, tuple[int, ...]]) -> tuple[Path, float]:
    """Export ``module`` (the one the ONNX export used) with ``torch.export`` into ``model.pt2``.

    ``dynamic`` names, per input, its dynamic axes (the batch axis, a sequence axis): each becomes a
    ``torch.export.Dim`` shared by every input that has it at that position, so one program serves every
    (batch, length). The input and output names travel inside the archive (an extra file), in the
    order of ``forward``'s positional arguments and returned tuple. The saved program is loaded back
    and checked against the eager module at every sample shape.
    """
    path = tmp / Files.EXPORTED_PROGRAM
    fix = "set export.torchscript = false (the ONNX model still serves), or remove data-dependent Python " \
          "control flow from the model's forward()"
    say("exporting the torch engine's program (torch.export)")
    dims: dict[int, Any] = {}
    shapes = []
    for name in in_names:
        axes = dynamic.get(name, ())
        # One Dim per axis position: the batch (and the sequence) of every input must agree. The sequence
        # axis is bounded as the repository bounds it (position embeddings end somewhere).
        shapes.append({k: dims.setdefault(k, torch.export.Dim(f"axis{k}", max=recipe.shapes.max_sequence_length)
                                          if k == 1 else torch.export.Dim(f"axis{k}")) for k in axes} or None)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.export(module, tuple(samples[0]), dynamic_shapes=tuple(shapes))
    except Exception as exc:  # torch.export raises many types; all mean "this model did not export"
        raise FactoryError(f"torch.export failed: {type(exc).__name__}: {str(exc)[:400]}. Fix: {fix}") from exc
    io_names = {"format": 1, "inputs": list(in_names), "outputs": list(out_names), "torch": torch.__version__}
    torch.export.save(program, str(path), extra_files={Files.TORCHSCRIPT_IO: json.dumps(io_names)})
    normalize_torchscript(path)  # a PyTorch zip archive: same program, same bytes (loaded back below)
    loaded = torch.export.load(str(path)).module()
    err = 0.0
    for sample in samples:
        with torch.no_grad():
            ref = _as_outputs(torch, module(*sample))
            got = _as_outputs(torch, loaded(*sample))
        if len(got) != len(out_names):
            raise FactoryError(f"the exported program returns {len(got)} tensors but the recipe declares "
                               f"{len(out_names)} outputs {out_names}. Fix: make forward() return one tensor per "
                               "[[outputs]] entry, in order, or set export.torchscript = false")
        for g, r in zip(got, ref):
            if tuple(g.shape) != tuple(r.shape):
                raise FactoryError(f"the exported program gives shape {tuple(g.shape)} where the source model "
                                   f"gives {tuple(r.shape)}. Fix: {fix}")
            err = max(err, float((g.double() - r.double()).abs().max()) if r.numel() else 0.0)
    say(f"exported program max abs error vs torch: {err:.3g}")
    if not np.isfinite(err) or err > recipe.export.tolerance:
        raise FactoryError(f"the exported program differs from the source model by {err:.3g} (max abs), over the "
                           f"tolerance {recipe.export.tolerance:g}. Fix: {fix}")
    return path, err


def _reference(torch: Any, module: Any, sample: Any) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*sample)
    return [t.numpy() for t in _as_outputs(torch, out)]


def _compare_with_ort(onnx_path: Path, checks: list[tuple[dict[str, np.ndarray], list[np.ndarray]]],
                      out_names: list[str]) -> list[float]:
    """Per ``(feeds, reference)`` check, the max abs difference of ONNX Runtime's outputs from the reference;
    inf where a shape differs or the graph cannot run. One session serves every check."""
    sess = onnxruntime_session(onnx_path)
    errors = []
    for feeds, reference in checks:
        try:
            got = sess.run(out_names, feeds)
        except Exception:  # ORT raises its own types; a graph that cannot run these shapes differs without bound
            errors.append(float("inf"))
            continue
        errors.append(float(max(np.max(np.abs(g.astype(np.float64) - r.astype(np.float64))) if g.shape == r.shape
                                else np.inf for g, r in zip(got, reference))))
    del sess
    return errors


def _dynamic_axes(specs: tuple[TensorSpec, ...]) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for s in specs:
        ax = {0: "batch"}
        for i, d in enumerate(s.dims, start=1):
            if d == -1:
                ax[i] = f"{s.name}_dim{i}"
        axes[s.name] = ax
    return axes


def _export_torch_factory(recipe: Recipe, tmp: Path, say: Callable[[str], None]) -> ExportResult:
    assert recipe.source.factory is not None
    with factory_import_path(recipe.source.base_dir, recipe.source.factory.partition(":")[0]):
        return _export_torch_module(recipe, tmp, say)


def _export_torch_module(recipe: Recipe, tmp: Path, say: Callable[[str], None]) -> ExportResult:
    torch = require("torch", "export")
    factory = recipe.source.factory
    fn, mod_file = load_factory(factory, recipe.source.base_dir)
    module, example = call_factory(fn, factory)
    if not isinstance(module, torch.nn.Module):
        raise FactoryError(f"source.factory: {factory}() returned a {type(module).__name__} as the model. Fix: "
                           "return (torch.nn.Module, example_inputs)")
    in_names = [s.name for s in recipe.inputs]
    if isinstance(example, dict):
        missing = [n for n in in_names if n not in example]
        if missing:
            raise FactoryError(f"the factory's example inputs lack {missing}. Fix: return a dict with every "
                               "[[inputs]] name of the recipe")
        args = tuple(example[n] for n in in_names)
    else:
        args = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    if len(args) != len(in_names) or not all(isinstance(a, torch.Tensor) for a in args):
        raise FactoryError(f"the factory's example inputs are not {len(in_names)} tensors (one per [[inputs]] entry "
                           f"{in_names}). Fix: return a dict of input name to tensor")
    _check_example_inputs(recipe, dict(zip(in_names, args)))
    out_names = [s.name for s in recipe.outputs]
    module = module.eval()
    onnx_path = tmp / Files.ONNX
    say("exporting to ONNX")
    dyn = _dynamic_axes(recipe.inputs) | _dynamic_axes(recipe.outputs)
    opset = _torch_export(torch, module, args, onnx_path, in_names, out_names, dyn, recipe, say)
    samples = [args]
    # A second batch size, as the HF export checks a second shape: the dynamic batch axis must hold.
    if all(a.dim() > 0 and a.shape[0] > 1 for a in args):
        samples.append(tuple(a[:1] for a in args))
    checks = []
    for sample in samples:
        ref = _reference(torch, module, sample)
        if len(ref) != len(out_names):
            raise FactoryError(f"the model returns {len(ref)} tensors but the recipe declares {len(out_names)} "
                               f"outputs {out_names}. Fix: make forward() return one tensor per [[outputs]] entry")
        checks.append(({n: a.numpy() for n, a in zip(in_names, sample)}, ref))
    if not recipe.export.torchscript:
        # The torch model is done with: free it before ONNX Runtime loads its own copy of the weights.
        del module, example
        release_memory()
    onnx_files.normalize(onnx_path)
    err = 0.0
    for k, sample_err in enumerate(_compare_with_ort(onnx_path, checks, out_names)):
        sample = samples[k]
        # Right at the example's batch size, wrong at another: a shape was baked in (not an op that exports badly).
        if k and err <= recipe.export.tolerance and not (sample_err <= recipe.export.tolerance):
            raise FactoryError(
                f"the exported ONNX matches the source at the example's batch size {args[0].shape[0]} but differs by "
                f"{sample_err:.3g} (max abs) at batch size {sample[0].shape[0]}: the export baked the batch size in "
                "(Python control flow on a tensor's shape in forward()). Fix: remove that control flow, or try "
                "export.dynamo = true")
        err = max(err, sample_err)
    say(f"max abs error vs torch: {err:.3g}")
    _check_tolerance(err, recipe)
    ts_path, ts_err = None, None
    if recipe.export.torchscript:
        dynamic = {s.name: tuple(k for k, d in enumerate((-1,) + tuple(s.dims)) if d == -1) for s in recipe.inputs}
        ts_path, ts_err = save_exported_program(torch, module, samples, tmp, in_names, out_names, recipe, say,
                                                dynamic=dynamic)
    digest = digest_path(mod_file) if mod_file else hashlib.sha256(factory.encode()).hexdigest()
    return ExportResult(onnx_path, err, recipe.export.tolerance, None, digest, opset,
                        tuple(in_names), tuple(out_names), ts_path, ts_err)


def _check_example_inputs(recipe: Recipe, example: dict[str, Any]) -> None:
    """The factory's example tensors must have the declared dtypes and dims (batch axis first)."""
    for spec in recipe.inputs:
        t = example[spec.name]
        want = _TORCH_DTYPES.get(spec.dtype)
        if want is not None and str(t.dtype) != want:
            raise FactoryError(f"the factory's example input {spec.name!r} is {t.dtype}, the recipe declares "
                               f"{spec.dtype}. Fix: make them agree ([[inputs]] dtype, or the example tensor)")
        shape = tuple(t.shape)
        if len(shape) != len(spec.dims) + 1 or any(d not in (-1, g) for d, g in zip(spec.dims, shape[1:])):
            raise FactoryError(f"the factory's example input {spec.name!r} has shape {list(shape)}, the recipe "
                               f"declares [batch] + {list(spec.dims)}. Fix: make them agree (-1 for a dynamic axis)")


def check_onnx_file(path: Path) -> Any:
    """Check an ONNX file (and its external data); return its graph, weights left in their data file.

    A broken file is a FactoryError naming the problem. The returned model is graph-only where the
    file has external data (see :mod:`~model_factory.build_engines.onnx_files`).
    """
    return onnx_files.check(path)


def check_declared_specs(recipe: Recipe, model: Any) -> None:
    """Declared [[inputs]]/[[outputs]] must agree with the ONNX graph (``model``, a loaded proto): dtype, rank,
    and every fixed size.

    A size the graph leaves dynamic may be declared fixed (the server then refuses other sizes); a size the
    graph fixes may not be declared dynamic.
    """
    graph_in, graph_out = graph_tensor_specs(model)
    graph = {s.name: s for s in graph_in + graph_out}
    for section, declared in (("inputs", recipe.inputs), ("outputs", recipe.outputs)):
        for spec in declared:
            g = graph.get(spec.name)
            if g is None or spec.dtype == "BYTES":
                continue
            if g.dtype != spec.dtype:
                raise FactoryError(f"recipe [[{section}]] {spec.name!r} is {spec.dtype} but the ONNX graph's is "
                                   f"{g.dtype}. Fix: declare dtype = \"{g.dtype}\" (or leave [[inputs]]/[[outputs]] "
                                   "out: they are read from the graph)")
            if len(g.dims) != len(spec.dims) or any(gd != -1 and gd != sd for gd, sd in zip(g.dims, spec.dims)):
                raise FactoryError(f"recipe [[{section}]] {spec.name!r} has dims {list(spec.dims)} but the ONNX graph's "
                                   f"are {list(g.dims)} (without the batch axis). Fix: declare dims = {list(g.dims)}, "
                                   "or fixed sizes where the graph has -1")


def _import_onnx(recipe: Recipe, tmp: Path, say: Callable[[str], None]) -> ExportResult:
    src = recipe.source.path
    assert src is not None
    say(f"checking {src}")
    model = check_onnx_file(src)
    graph_inputs = [i.name for i in model.graph.input if i.name not in {init.name for init in model.graph.initializer}]
    graph_outputs = [o.name for o in model.graph.output]
    want_in = [s.name for s in recipe.inputs if s.dtype != "BYTES"]
    want_out = [s.name for s in recipe.outputs]
    if sorted(graph_inputs) != sorted(want_in) or not set(want_out) <= set(graph_outputs):
        raise FactoryError(f"the ONNX graph has inputs {graph_inputs} and outputs {graph_outputs}, but the recipe "
                           f"declares inputs {want_in} and outputs {want_out}. Fix: make [[inputs]]/[[outputs]] "
                           "match the graph's tensor names")
    check_declared_specs(recipe, model)
    onnx_path = tmp / Files.ONNX
    # Weights stream from the source's data files (if any) into this folder's layout, one tensor at a time.
    onnx_files.save(model, onnx_path, base_dir=Path(src).parent, consume=True)
    del model
    # No source framework to compare with: run it once on zeros to prove it executes.
    feeds = {}
    for s in recipe.inputs:
        if s.dtype == "BYTES":
            continue
        shape = (2,) + tuple(4 if d == -1 else d for d in s.dims)
        feeds[s.name] = np.zeros(shape, dtype=_NP_DTYPES[s.dtype])
    try:
        onnxruntime_session(onnx_path).run(want_out, feeds)
    except Exception as exc:  # ORT raises its own exception types
        raise FactoryError(f"ONNX Runtime cannot run {src}: {exc}. Fix: check the graph's dtypes and shapes "
                           "against the recipe") from exc
    return ExportResult(onnx_path, 0.0, recipe.export.tolerance, None, digest_path(src), recipe.export.opset,
                        tuple(want_in), tuple(want_out))


_NP_DTYPES = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32,
              "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_}
_TORCH_DTYPES = {"FP32": "torch.float32", "FP16": "torch.float16", "FP64": "torch.float64", "INT64": "torch.int64",
                 "INT32": "torch.int32", "INT16": "torch.int16", "INT8": "torch.int8", "UINT8": "torch.uint8",
                 "BOOL": "torch.bool"}
