"""Export stage: a Hugging Face folder, a torch module or an ONNX file becomes ``model.onnx``.

The exported graph has dynamic batch and sequence axes and is checked against
the source framework on sample inputs (max abs error reported; over the
recipe's tolerance the stage fails). Everything is written to a temporary
folder first and renamed into place.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from model_factory.backend.engines.torch import IO_EXTRA_FILE, TORCHSCRIPT_FILE
from model_factory.build_engines import onnx_files
from model_factory.errors import FactoryError, require
from model_factory.fileio import atomic_dir, digest_path
from model_factory.memory import release_memory
from model_factory.recipe import Recipe, TensorSpec

SAMPLE_TEXTS = (
    "A man is playing a guitar on the street.",
    "The quick brown fox jumps over the lazy dog.",
    "Triton serves models.",
    "Offline builds must never reach the network, not even for telemetry or tokenizer files.",
)

# Tokenizer files copied next to the model so the backend tokenizes with the model's own vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "merges.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model", "added_tokens.json")


@dataclass(frozen=True)
class ExportResult:
    """What the export stage produced and how close it is to the source framework."""

    onnx_path: Path
    max_abs_error: float
    tolerance: float
    tokenizer_dir: Path | None
    source_digest: str
    opset: int
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    # model.torchscript.pt (export.torchscript = true) and its max abs error vs the source model
    torchscript_path: Path | None = None
    torchscript_max_abs_error: float | None = None


def onnxruntime_session(path: Path, threads: int | None = None) -> Any:
    """An ONNX Runtime CPU session with telemetry switched off (we are air-gapped)."""
    ort = require("onnxruntime", "onnx")
    # ORT 1.32 resolves a telemetry host during inference unless told not to.
    if hasattr(ort, "disable_telemetry_events"):
        ort.disable_telemetry_events()
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def export_model(recipe: Recipe, out_dir: Path | None = None, progress: Callable[[str], None] | None = None) -> ExportResult:
    """Run the export stage for ``recipe`` into ``out_dir`` (default: the recipe's work dir)."""
    out_dir = Path(out_dir or recipe.work_dir / "export")
    say = progress or (lambda _msg: None)
    if recipe.export.torchscript and recipe.source.kind == "onnx":
        raise FactoryError("export.torchscript = true, but an onnx source has no torch module to trace. Fix: set "
                           "export.torchscript = false, or build from the huggingface folder or torch factory")
    with atomic_dir(out_dir) as tmp:
        if recipe.source.kind == "huggingface":
            result = _export_huggingface(recipe, tmp, say)
        elif recipe.source.kind == "torch":
            result = _export_torch_factory(recipe, tmp, say)
        else:
            result = _import_onnx(recipe, tmp, say)
        (tmp / "export.json").write_text(json.dumps({
            "max_abs_error": result.max_abs_error, "tolerance": result.tolerance,
            "source_digest": result.source_digest, "opset": result.opset,
            "inputs": list(result.input_names), "outputs": list(result.output_names),
            "torchscript": None if result.torchscript_path is None else {
                "file": result.torchscript_path.name, "max_abs_error": result.torchscript_max_abs_error,
                "torch": _torch_version()},
        }, indent=2))
    # Paths inside the result pointed into the temporary folder; re-base them.
    return ExportResult(
        onnx_path=out_dir / result.onnx_path.name,
        max_abs_error=result.max_abs_error, tolerance=result.tolerance,
        tokenizer_dir=(out_dir / "tokenizer") if result.tokenizer_dir else None,
        source_digest=result.source_digest, opset=result.opset,
        input_names=result.input_names, output_names=result.output_names,
        torchscript_path=(out_dir / result.torchscript_path.name) if result.torchscript_path else None,
        torchscript_max_abs_error=result.torchscript_max_abs_error,
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


def _embedding_module(model: Any, pooling: str, normalize: bool) -> Any:
    """Wrap an HF encoder so one graph returns ``last_hidden_state`` and a pooled ``embedding``."""
    torch = require("torch", "export")

    class EmbeddingModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):  # noqa: ANN001
            kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
            hidden = self.model(**kwargs).last_hidden_state
            if pooling == "cls":
                emb = hidden[:, 0]
            else:
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            if normalize:
                emb = torch.nn.functional.normalize(emb, p=2.0, dim=1)
            return hidden, emb

    return EmbeddingModel().eval()


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
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        hf = transformers.AutoModel.from_pretrained(str(src), local_files_only=True).eval()
    except (OSError, ValueError) as exc:
        raise FactoryError(f"cannot load a Hugging Face model from {src}: {exc}. Fix: point source.path "
                           "at a folder with config.json, the weights and the tokenizer files") from exc
    names = [s.name for s in recipe.inputs if s.dtype != "BYTES"]
    use_tti = "token_type_ids" in names
    wrapper = _embedding_module(hf, recipe.pooling, recipe.normalize)
    batch = tok(list(SAMPLE_TEXTS), padding=True, truncation=True, max_length=recipe.shapes.max_sequence_length,
                return_tensors="pt")
    args = [batch["input_ids"], batch["attention_mask"]]
    if use_tti:
        args.append(batch.get("token_type_ids", torch.zeros_like(batch["input_ids"])))
    in_names = ["input_ids", "attention_mask"] + (["token_type_ids"] if use_tti else [])
    out_names = ["last_hidden_state", "embedding"]
    onnx_path = tmp / "model.onnx"
    # The check runs at the traced shape and at another batch size and length: dynamic axes must hold.
    single = tok([SAMPLE_TEXTS[2]], truncation=True, max_length=recipe.shapes.max_sequence_length, return_tensors="pt")
    single_args = [single["input_ids"], single["attention_mask"]]
    if use_tti:
        single_args.append(single.get("token_type_ids", torch.zeros_like(single["input_ids"])))
    samples = [(dict(zip(in_names, (a.numpy() for a in sample))), _reference(torch, wrapper, sample))
               for sample in (args, single_args)]
    say("exporting to ONNX")
    dyn = {n: {0: "batch", 1: "sequence"} for n in in_names}
    dyn["last_hidden_state"] = {0: "batch", 1: "sequence"}
    dyn["embedding"] = {0: "batch"}
    _torch_export(torch, wrapper, tuple(args), onnx_path, in_names, out_names, dyn, recipe)
    ts_path, ts_err = None, None
    if recipe.export.torchscript:
        ts_path, ts_err = _save_torchscript(torch, wrapper, [tuple(args), tuple(single_args)], tmp, in_names,
                                            out_names, recipe, say)
    # The torch model is done with: free it before ONNX Runtime loads its own copy of the weights.
    del wrapper, hf
    release_memory()
    onnx_files.normalize(onnx_path)
    err = _compare_with_ort(onnx_path, samples, out_names)
    say(f"max abs error vs torch: {err:.3g}")
    _check_tolerance(err, recipe)
    tok_dir = tmp / "tokenizer"
    tok.save_pretrained(str(tok_dir))
    return ExportResult(onnx_path, err, recipe.export.tolerance, tok_dir, digest_path(src), recipe.export.opset,
                        tuple(in_names), tuple(out_names), ts_path, ts_err)


def _torch_export(torch: Any, module: Any, args: tuple, path: Path, in_names: list[str], out_names: list[str],
                  dynamic_axes: dict[str, dict[int, str]], recipe: Recipe) -> None:
    try:
        # The tracer warns about every Python-level branch in transformers' code; the exported
        # graph is checked numerically against the source below, which is what decides.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, str(path), input_names=in_names, output_names=out_names,
                              dynamic_axes=dynamic_axes, opset_version=recipe.export.opset,
                              dynamo=recipe.export.dynamo, do_constant_folding=True)
    except Exception as exc:  # torch raises many types here; all mean "this model did not export"
        raise FactoryError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}. Fix: check the model's "
                           "forward() runs on the example inputs, or try export.dynamo = true") from exc


def _as_outputs(torch: Any, value: Any) -> list[Any]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _save_torchscript(torch: Any, module: Any, samples: list[tuple], tmp: Path, in_names: list[str],
                      out_names: list[str], recipe: Recipe, say: Callable[[str], None]) -> tuple[Path, float]:
    """Trace ``module`` (the same module the ONNX export used) into ``model.torchscript.pt``.

    A plain ``torch.jit.trace`` + ``torch.jit.save``, so an older torch (the serving machine's) loads
    what this one saved. The input and output names travel inside the file (an extra file), in the
    order of the traced ``forward``'s positional arguments and returned tuple. The saved file is
    loaded back and checked against the eager module at every sample shape (different batch sizes
    and lengths): a trace that baked a shape in fails here, not in the server.
    """
    path = tmp / TORCHSCRIPT_FILE
    fix = "set export.torchscript = false (the ONNX model still serves), or remove data-dependent Python " \
          "control flow from the model's forward()"
    say("tracing to TorchScript")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # Same reason as the ONNX export: the tracer warns about every Python-level branch; the
            # numerical check below decides.
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(module, samples[0], check_trace=False)
            n_out = len(_as_outputs(torch, traced(*samples[0])))
    except Exception as exc:  # the tracer raises many types; all mean "this model did not trace"
        raise FactoryError(f"torch.jit.trace failed: {type(exc).__name__}: {str(exc)[:300]}. Fix: {fix}") from exc
    if n_out != len(out_names):
        raise FactoryError(f"the traced model returns {n_out} tensors but the recipe declares {len(out_names)} "
                           f"outputs {out_names}. Fix: make forward() return one tensor per [[outputs]] entry, "
                           "in order, or set export.torchscript = false")
    io_names = {"format": 1, "inputs": list(in_names), "outputs": list(out_names), "torch": torch.__version__}
    with warnings.catch_warnings():
        # torch >= 2.10 marks TorchScript deprecated in favour of torch.export; a plain trace is kept on
        # purpose: the serving machine's older torch loads it, which a pt2 archive does not promise.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(traced, str(path), _extra_files={IO_EXTRA_FILE: json.dumps(io_names)})
        loaded = torch.jit.load(str(path), map_location="cpu")
    err = 0.0
    for sample in samples:
        with torch.no_grad():
            ref = _as_outputs(torch, module(*sample))
            got = _as_outputs(torch, loaded(*sample))
        for g, r in zip(got, ref):
            if tuple(g.shape) != tuple(r.shape):
                raise FactoryError(f"the TorchScript trace gives shape {tuple(g.shape)} where the source model "
                                   f"gives {tuple(r.shape)} (a shape was baked into the trace). Fix: {fix}")
            err = max(err, float((g.double() - r.double()).abs().max()) if r.numel() else 0.0)
    say(f"TorchScript max abs error vs torch: {err:.3g}")
    if not np.isfinite(err) or err > recipe.export.tolerance:
        raise FactoryError(f"the TorchScript trace differs from the source model by {err:.3g} (max abs), over the "
                           f"tolerance {recipe.export.tolerance:g}. Fix: {fix}")
    return path, err


def _reference(torch: Any, module: Any, sample: Any) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*sample)
    return [t.numpy() for t in _as_outputs(torch, out)]


def _compare_with_ort(onnx_path: Path, samples: list[tuple[dict[str, np.ndarray], list[np.ndarray]]],
                      out_names: list[str]) -> float:
    """Max abs difference between ONNX Runtime on ``onnx_path`` and the references, over ``samples``."""
    sess = onnxruntime_session(onnx_path)
    err = 0.0
    for feeds, reference in samples:
        got = sess.run(out_names, feeds)
        err = max(err, float(max(np.max(np.abs(g.astype(np.float64) - r.astype(np.float64))) if r.size else 0.0
                                 for g, r in zip(got, reference))))
    del sess
    return err


def _dynamic_axes(specs: tuple[TensorSpec, ...]) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for s in specs:
        ax = {0: "batch"}
        for i, d in enumerate(s.dims, start=1):
            if d == -1:
                ax[i] = f"{s.name}_dim{i}"
        axes[s.name] = ax
    return axes


def load_factory(spec: str) -> Callable[[], Any]:
    """Resolve ``package.module:function``; a bad spec is a FactoryError naming the fix."""
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise FactoryError(f"source.factory: cannot import {mod_name!r} ({exc}). Fix: make the module "
                           "importable (install it, or run from its folder)") from exc
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise FactoryError(f"source.factory: {mod_name!r} has no function {fn_name!r}")
    return fn


def _export_torch_factory(recipe: Recipe, tmp: Path, say: Callable[[str], None]) -> ExportResult:
    torch = require("torch", "export")
    assert recipe.source.factory is not None
    produced = load_factory(recipe.source.factory)()
    if not (isinstance(produced, tuple) and len(produced) == 2):
        raise FactoryError("source.factory must return (torch.nn.Module, example_inputs) where example_inputs "
                           "is a dict of input name to tensor")
    module, example = produced
    in_names = [s.name for s in recipe.inputs]
    if isinstance(example, dict):
        missing = [n for n in in_names if n not in example]
        if missing:
            raise FactoryError(f"the factory's example inputs lack {missing}. Fix: return a dict with every "
                               "[[inputs]] name of the recipe")
        args = tuple(example[n] for n in in_names)
    else:
        args = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    out_names = [s.name for s in recipe.outputs]
    module = module.eval()
    onnx_path = tmp / "model.onnx"
    say("exporting to ONNX")
    dyn = _dynamic_axes(recipe.inputs) | _dynamic_axes(recipe.outputs)
    reference = _reference(torch, module, args)
    _torch_export(torch, module, args, onnx_path, in_names, out_names, dyn, recipe)
    ts_path, ts_err = None, None
    if recipe.export.torchscript:
        samples = [args]
        # A second batch size, as the HF export checks a second shape: the trace must not bake it in.
        if all(isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] > 1 for a in args):
            samples.append(tuple(a[:1] for a in args))
        ts_path, ts_err = _save_torchscript(torch, module, samples, tmp, in_names, out_names, recipe, say)
    feeds = {n: a.numpy() for n, a in zip(in_names, args)}
    del module, produced
    release_memory()
    onnx_files.normalize(onnx_path)
    err = _compare_with_ort(onnx_path, [(feeds, reference)], out_names)
    say(f"max abs error vs torch: {err:.3g}")
    _check_tolerance(err, recipe)
    mod_file = getattr(importlib.import_module(recipe.source.factory.split(":")[0]), "__file__", None)
    digest = digest_path(Path(mod_file)) if mod_file else hashlib.sha256(recipe.source.factory.encode()).hexdigest()
    return ExportResult(onnx_path, err, recipe.export.tolerance, None, digest, recipe.export.opset,
                        tuple(in_names), tuple(out_names), ts_path, ts_err)


def check_onnx_file(path: Path) -> Any:
    """Check an ONNX file (and its external data); return its graph, weights left in their data file.

    A broken file is a FactoryError naming the problem. The returned model is graph-only where the
    file has external data (see :mod:`~model_factory.build_engines.onnx_files`).
    """
    onnx_files.check(path)
    return onnx_files.load_graph(path)


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
    onnx_path = tmp / "model.onnx"
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


_NP_DTYPES = {"FP32": np.float32, "FP16": np.float16, "INT64": np.int64, "INT32": np.int32, "INT8": np.int8,
              "BOOL": np.bool_}
