"""``[source] kind = "gguf"``: what a GGUF file (llama.cpp's format) tells the recipe before any build.

The recipe reads the file's header alone (``gguf.GGUFReader``: its metadata and the tensors' names and types, no
weights): the architecture (a family the exporter builds and transformers reads from a GGUF), the context length,
the end-of-sequence id, and whether every tensor's type is one transformers can dequantize. The weights are read
in the build's source stage, behind its walls (:mod:`model_factory.build_engines.gguf_source`), into a Hugging Face
folder under the work folder; every later stage reads that folder (:func:`converted`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from model_factory.errors import FactoryError
from model_factory.recipe.errors import field_error as _err
from model_factory.recipe.specs import GenerationSettings

MAGIC = b"GGUF"
EXTRA = "pip install 'model-factory[gguf]'"
# general.architecture -> the Hugging Face model_type transformers gives it, for the families the exporter builds
# (model_factory.recipe.causal_lm.FAMILIES) that transformers 5 reads from a GGUF (GGUF_SUPPORTED_ARCHITECTURES).
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                 "gemma2": "gemma2", "gemma3": "gemma3_text", "nemotron": "nemotron", "gpt2": "gpt2"}
# The folder the source stage writes under the recipe's work folder.
SOURCE_DIR = "source"


@dataclass(frozen=True)
class GgufHeader:
    """What the recipe reads from a GGUF's header."""

    path: Path
    architecture: str  # general.architecture
    model_type: str  # the Hugging Face family it becomes
    context_length: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tensor_types: Mapping[str, int]  # GGML type name -> tensors of it
    chat_template: str | None


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise FactoryError(f"a gguf source needs the 'gguf' package ({exc}). Fix: {EXTRA}") from exc
    return gguf


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # a malformed field reads as absent
        return None


@contextlib.contextmanager
def one_reader_per_file() -> Iterator[None]:
    """Within it, every ``gguf.GGUFReader(path)`` of one file is the same reader, made once.

    Reading a GGUF's metadata is slow in gguf-py (its reader builds each of a 262k-token vocabulary's strings and
    scores from memory-mapped slices: about 15-20 s for Gemma 3 270M's file on 2 cores), and reading one file into
    a Hugging Face folder makes four: the header here, then transformers' config, weights and tokenizer loads, each
    ``GGUFReader(path)`` anew. A reader is only read from (fields, tensors' memory-mapped data), so one serves all.
    ``gguf.GGUFReader`` is swapped for a caching factory while inside (this process; put back on the way out)."""
    gguf = _require_gguf()
    original = gguf.GGUFReader
    readers: dict[tuple, Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        st = os.stat(path)
        key = (os.path.realpath(path), mode, st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def read_header(path: Path) -> GgufHeader:
    """A GGUF's header, refused (``source.path``) when the file is not a GGUF, its architecture is not built, or
    a tensor's type cannot be read."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise _err("source.path", f"{path} is not a GGUF file (it begins with {head!r}, not {MAGIC!r})",
                   "point it at a .gguf file (llama.cpp's format), or use kind = \"huggingface\" for a "
                   "save_pretrained() folder")
    gguf = _require_gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # a truncated or corrupt file: the reader's own message
        raise _err("source.path", f"{path} is not a readable GGUF ({type(exc).__name__}: {exc})",
                   "point it at a complete .gguf file") from None
    arch = str(_field(reader, "general.architecture") or "")
    name = str(_field(reader, "general.name") or "")
    if arch == "llama" and "mistral" in name.lower():  # llama.cpp writes Mistral as llama (so does transformers)
        arch = "mistral"
    if arch not in ARCHITECTURES:
        raise _err("source.path", f"{path}'s architecture {arch or '(none)'!r} is not one the factory builds from a "
                   "GGUF", f"use a GGUF of one of: {', '.join(ARCHITECTURES)} (or convert the model to a Hugging "
                   "Face folder and use kind = \"huggingface\")")
    readable = set(getattr(gguf.quants, "_type_traits", {})) | {gguf.GGMLQuantizationType.F32,
                                                                gguf.GGMLQuantizationType.F16}
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        if t.tensor_type not in readable:
            raise _err("source.path", f"{path}'s tensor {t.name} is {t.tensor_type.name}, a type gguf "
                       f"{getattr(gguf, '__version__', '')} cannot dequantize",
                       "use a GGUF quantized with a type gguf-py reads (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K, ...), or "
                       "upgrade gguf")
    raw_arch = str(_field(reader, "general.architecture"))
    ctx = _field(reader, f"{raw_arch}.context_length")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    template = _field(reader, "tokenizer.chat_template")
    return GgufHeader(path, arch, ARCHITECTURES[arch], int(ctx) if isinstance(ctx, int) else 0,
                      (int(eos),) if isinstance(eos, int) else (), int(bos) if isinstance(bos, int) else None,
                      types, template if isinstance(template, str) else None)


def check_gguf(path: Path, max_context: int | None,
               defaults: Mapping[str, Any]) -> tuple[GenerationSettings, int, GgufHeader]:
    """The generation settings of a GGUF source, as :func:`model_factory.recipe.causal_lm.check_causal_lm` gives a
    folder's (the folder the source stage writes is checked again by it)."""
    from model_factory.recipe.causal_lm import DEFAULT_MAX_CONTEXT, FAMILIES

    header = read_header(path)
    if not header.eos_token_ids:
        raise _err("source.path", f"{path} names no end-of-sequence token (tokenizer.ggml.eos_token_id): "
                   "generation could never stop", "use a GGUF written with its tokenizer (llama.cpp's converter "
                   "writes it)")
    if header.context_length < 1:
        raise _err("source.path", f"{path} has no {header.architecture}.context_length",
                   "use a GGUF written by llama.cpp's converter (it records the context length)")
    if max_context is not None and max_context > header.context_length:
        raise _err("shapes.max_context", f"{max_context} is longer than the {header.context_length} positions the "
                   "model has", f"use at most {header.context_length}")
    context = max_context if max_context is not None else min(header.context_length, DEFAULT_MAX_CONTEXT)
    family = header.model_type
    return GenerationSettings(family=family, architecture=FAMILIES[family], max_positions=header.context_length,
                              eos_token_ids=header.eos_token_ids, defaults=dict(defaults)), context, header


def converted(recipe: Any) -> Any:
    """``recipe`` as the stages after the source stage read it: a Hugging Face source, the folder the source stage
    wrote from the GGUF (``source.gguf`` keeps the file). A recipe of another kind is returned as it is."""
    src = recipe.source
    if src.kind != "gguf":
        return recipe
    folder = Path(recipe.work_dir) / SOURCE_DIR
    if not (folder / "config.json").is_file():
        raise FactoryError(f"{src.path} has not been converted yet ({folder} holds no config.json). Fix: run "
                           "model-factory export (or build) first: its source stage reads the GGUF")
    return dataclasses.replace(recipe, source=dataclasses.replace(src, kind="huggingface", path=folder,
                                                                  gguf=Path(src.path)))
