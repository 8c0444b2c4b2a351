"""The source stage of ``[source] kind = "gguf"``: the GGUF read into the Hugging Face folder the exporter takes.

Run behind the build's walls like every stage that reads a source (:func:`model_factory.build.pipeline.run_stage`):
the file is classified first (:mod:`build_engines.source_scan`: a GGUF holds tensors and metadata, no code), then
transformers reads it (``from_pretrained(dir, gguf_file=name, dtype=float32)``: every tensor dequantized by
``gguf.quants``, llama.cpp's converter's transformations undone — Llama's Q/K row order, Gemma's norm + 1), and
``save_pretrained`` writes ``<work>/source/``: FP32 safetensors, the tokenizer (and chat template) from the GGUF's
metadata, ``generation_config.json`` with its bos/eos ids, and ``gguf_source.json`` (the file's sha256, its
architecture and tensor types), which the build records as its source digest in the provenance and the BOM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from model_factory.errors import FactoryError
from model_factory.fileio import atomic_dir, digest_path
from model_factory.recipe import Recipe
from model_factory.recipe.gguf import EXTRA, SOURCE_DIR, one_reader_per_file, read_header

RECORD = "gguf_source.json"


def _require(module: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise FactoryError(f"reading a GGUF with transformers needs {module!r} ({exc}). Fix: {EXTRA}") from exc


def gguf_record(folder: Path) -> dict[str, Any]:
    """What the source stage recorded of the GGUF a folder came from (``gguf_source.json``), or {}."""
    try:
        data = json.loads((Path(folder) / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def convert_gguf(recipe: Recipe, out_dir: Path | None = None,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write the recipe's GGUF as a Hugging Face folder (default ``<work>/source``); return its record.

    A folder already written from a file of the same sha256 is kept (a rebuild reads the GGUF once)."""
    from model_factory.build_engines.source_scan import scan_files, scan_summary

    say = progress or (lambda _m: None)
    src = recipe.source
    assert src.kind == "gguf" and src.path is not None
    gguf_path = Path(src.path)
    out_dir = Path(out_dir or Path(recipe.work_dir) / SOURCE_DIR)
    scan = scan_files([gguf_path], gguf_path.parent, allow_pickle=False).check().to_dict()
    say(f"[scan] {scan_summary(scan)}")
    sha = digest_path(gguf_path)
    done = gguf_record(out_dir)
    if done.get("sha256") == sha and (out_dir / "config.json").is_file():
        say(f"[source] {gguf_path.name} (sha256 {sha[:12]}...) already read into {out_dir}")
        return {**done, "source_scan": scan}
    for module in ("gguf", "accelerate", "torch", "transformers"):
        _require(module)
    with one_reader_per_file():  # the header and transformers' three loads: one metadata read, not four
        record = _convert(gguf_path, out_dir, sha, say)
    return {**record, "source_scan": scan}


def _convert(gguf_path: Path, out_dir: Path, sha: str, say: Callable[[str], None]) -> dict[str, Any]:
    header = read_header(gguf_path)
    import torch
    import transformers

    say(f"[source] reading {gguf_path.name} ({header.architecture}; "
        f"{', '.join(f'{n} {t}' for t, n in sorted(header.tensor_types.items()))}) with transformers")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                                  dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, NotImplementedError) as exc:  # transformers' refusal of what it cannot map
        raise FactoryError(f"transformers {transformers.__version__} cannot read {gguf_path} "
                           f"({type(exc).__name__}: {exc}). Fix: use a GGUF of a family transformers reads, or "
                           "convert it to a Hugging Face folder and use kind = \"huggingface\"") from None
    # A GGUF-loaded model is marked quantized (its quantizer dequantized it on load): save_pretrained refuses it
    # until the marks are cleared; the weights are FP32 then (the GGUF's values).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    gen = model.generation_config
    gen.eos_token_id = list(header.eos_token_ids) if len(header.eos_token_ids) > 1 else header.eos_token_ids[0]
    if header.bos_token_id is not None:
        gen.bos_token_id = header.bos_token_id
    if header.chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = header.chat_template
    record = {"file": gguf_path.name, "sha256": sha, "bytes": gguf_path.stat().st_size,
              "architecture": header.architecture, "model_type": header.model_type,
              "tensor_types": dict(sorted(header.tensor_types.items())),
              "chat_template": bool(header.chat_template), "transformers": transformers.__version__}
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    del model
    say(f"[source] {gguf_path.name} -> {out_dir} (FP32, sha256 {sha[:12]}...)")
    return record
