"""Trust per tensor: each weight's name, dtype, shape and the SHA-256 of its bytes, and what changed between two.

A signature hashes files; a file's digest says only "this file differs". The manifest here says which
tensors: a "fine-tune" whose weights are byte-identical to its base, or one with a single tensor swapped
(``lm_head``), is visible as such.

* safetensors (a source's ``model.safetensors``, shards included): read from the file's JSON header and
  its data section, one tensor at a time in 1 MiB chunks; nothing is loaded whole, and no library that
  could run code opens the file.
* ONNX (a built ``model.onnx``): the initializers. The graph is parsed without its external data; an
  initializer kept in an external file is hashed from that file's byte range, streamed.

Digests are of the tensor's raw little-endian bytes, so a re-saved copy (another header order, other
metadata, another file digest) has the same manifest. :func:`diff_manifests` compares two; the BOM
(:mod:`model_factory.distribution.bom`) carries them, so the version's signature covers them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from model_factory.errors import FactoryError

CHUNK = 1 << 20
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
PROPERTY_PREFIX = "model-factory:tensor:"
SOURCE_SET = "source"


@dataclass(frozen=True)
class TensorDigest:
    """One tensor: where it is, what it is, and the sha256 of its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str
    file: str = ""  # the file it was read from (a shard's name), for the reader

    def describe(self) -> str:
        return f"{self.name} ({self.dtype} {list(self.shape)})"


def _hash_range(f: Any, start: int, length: int) -> str:
    h = hashlib.sha256()
    f.seek(start)
    left = length
    while left > 0:
        chunk = f.read(min(CHUNK, left))
        if not chunk:
            raise FactoryError(f"{getattr(f, 'name', 'a file')} ends inside a tensor. Fix: the file is truncated; "
                               "copy it again")
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()


def safetensors_manifest(path: Path) -> list[TensorDigest]:
    """The tensors of one safetensors file, in the order they are stored."""
    path = Path(path)
    with path.open("rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 2 <= n <= MAX_HEADER:
            raise FactoryError(f"{path} is not a safetensors file (header length {n}). Fix: pass a .safetensors "
                               "file or a folder that holds them")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise FactoryError(f"{path}: its safetensors header is not JSON ({exc}). Fix: the file is damaged; "
                               "copy it again") from exc
        base = 8 + n
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                         key=lambda kv: kv[1]["data_offsets"][0])
        out = []
        for name, info in entries:
            start, end = info["data_offsets"]
            out.append(TensorDigest(name, str(info["dtype"]).lower(), tuple(int(d) for d in info["shape"]),
                                    _hash_range(f, base + start, end - start), path.name))
    return out


def onnx_manifest(path: Path) -> list[TensorDigest]:
    """The initializers of an ONNX model (external data hashed from its file's byte range)."""
    from model_factory.errors import require

    onnx = require("onnx", "onnx")
    from onnx import numpy_helper

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    out = []
    for t in model.graph.initializer:
        dtype = onnx.TensorProto.DataType.Name(t.data_type).lower()
        shape = tuple(int(d) for d in t.dims)
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            ext = path.parent / info["location"]
            offset = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else ext.stat().st_size - offset
            with ext.open("rb") as f:
                digest = _hash_range(f, offset, length)
        elif t.raw_data:
            digest = hashlib.sha256(t.raw_data).hexdigest()
        else:  # typed fields (float_data ...): their values as little-endian bytes, as raw_data would hold them
            arr = numpy_helper.to_array(t)
            digest = hashlib.sha256(arr.astype(arr.dtype.newbyteorder("<")).tobytes()).hexdigest()
        out.append(TensorDigest(t.name, dtype, shape, digest, path.name))
    return out


def manifest_of(path: Path) -> list[TensorDigest]:
    """One file's manifest (.safetensors or .onnx), or every safetensors file's in a folder (shards)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.safetensors") if p.is_file())
        out: list[TensorDigest] = []
        for p in files:
            out.extend(safetensors_manifest(p))
        return out
    if path.suffix == ".onnx":
        return onnx_manifest(path)
    return safetensors_manifest(path)


def source_manifest(recipe: Any) -> list[TensorDigest]:
    """The tensors of a recipe's source where they are data files (safetensors; an ONNX source's initializers)."""
    src = recipe.source
    if src.path is None:
        return []  # a torch factory builds its tensors in code: the built model's initializers carry them
    path = Path(src.path)
    if src.kind == "onnx":
        return onnx_manifest(path)
    return manifest_of(path) if path.is_dir() else []


# --- in the BOM: one CycloneDX "data" component per tensor ------------------------------------------------

def bom_components(tensors: Sequence[TensorDigest], ref_prefix: str) -> list[dict[str, Any]]:
    """The tensors as CycloneDX ``data`` components (name, sha256, dtype/shape/file as properties)."""
    return [{"type": "data", "bom-ref": f"{ref_prefix}{t.file}:{t.name}", "name": t.name,
             "hashes": [{"alg": "SHA-256", "content": t.sha256}],
             "properties": [{"name": PROPERTY_PREFIX + "dtype", "value": t.dtype},
                            {"name": PROPERTY_PREFIX + "shape", "value": json.dumps(list(t.shape))},
                            {"name": PROPERTY_PREFIX + "file", "value": t.file}]}
            for t in tensors]


def _from_component(c: Mapping[str, Any]) -> TensorDigest | None:
    props = {p.get("name"): p.get("value") for p in c.get("properties") or []}
    if PROPERTY_PREFIX + "dtype" not in props:
        return None
    sha = next((h.get("content") for h in c.get("hashes") or [] if h.get("alg") == "SHA-256"), "")
    return TensorDigest(str(c.get("name")), str(props[PROPERTY_PREFIX + "dtype"]),
                        tuple(json.loads(props.get(PROPERTY_PREFIX + "shape") or "[]")), str(sha),
                        str(props.get(PROPERTY_PREFIX + "file") or ""))


def manifests_from_bom(doc: Mapping[str, Any]) -> dict[str, list[TensorDigest]]:
    """The BOM's tensor sets: ``source`` (the source's weights) and one per built ONNX file."""
    sets: dict[str, list[TensorDigest]] = {}
    for comp in doc.get("components") or []:
        if comp.get("type") != "machine-learning-model":
            continue
        for ancestor in (comp.get("pedigree") or {}).get("ancestors") or []:
            found = [t for t in map(_from_component, ancestor.get("components") or []) if t]
            if found:
                sets[SOURCE_SET] = found
        for t in filter(None, map(_from_component, comp.get("components") or [])):
            sets.setdefault(t.file, []).append(t)
    return sets


# --- what changed ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorDiff:
    """Two manifests compared by tensor name."""

    label: str
    changed: tuple[tuple[TensorDigest, TensorDigest], ...]  # (old, new): other bytes, dtype or shape
    added: tuple[TensorDigest, ...]
    removed: tuple[TensorDigest, ...]
    unchanged: int

    @property
    def identical(self) -> bool:
        return not (self.changed or self.added or self.removed)

    def lines(self) -> list[str]:
        total = self.unchanged + len(self.changed) + len(self.removed)
        if self.identical:
            return [f"{self.label}: identical weights: all {self.unchanged} tensors have the same names, dtypes, "
                    "shapes and bytes (a fine-tune that claims this base changed nothing)"]
        out = [f"{self.label}: {len(self.changed)} of {total} tensors changed, {len(self.added)} added, "
               f"{len(self.removed)} removed, {self.unchanged} identical"]
        for old, new in self.changed:
            what = "bytes" if (old.dtype, old.shape) == (new.dtype, new.shape) else \
                f"{old.dtype} {list(old.shape)} -> {new.dtype} {list(new.shape)}"
            out.append(f"  changed  {new.name} ({what}; sha256 {old.sha256[:12]} -> {new.sha256[:12]})")
        out += [f"  added    {t.describe()}" for t in self.added]
        out += [f"  removed  {t.describe()}" for t in self.removed]
        return out


def diff_manifests(old: Iterable[TensorDigest], new: Iterable[TensorDigest], label: str = "weights") -> TensorDiff:
    old_by = {t.name: t for t in old}
    new_by = {t.name: t for t in new}
    changed = tuple((old_by[n], t) for n, t in new_by.items()
                    if n in old_by and (old_by[n].sha256, old_by[n].dtype, old_by[n].shape)
                    != (t.sha256, t.dtype, t.shape))
    return TensorDiff(label, changed, tuple(t for n, t in new_by.items() if n not in old_by),
                      tuple(t for n, t in old_by.items() if n not in new_by),
                      sum(1 for n, t in new_by.items() if n in old_by and (old_by[n].sha256, old_by[n].dtype,
                                                                            old_by[n].shape)
                          == (t.sha256, t.dtype, t.shape)))


def manifests_of_path(path: Path) -> dict[str, list[TensorDigest]]:
    """The tensor sets ``model-factory diff`` compares for one side.

    A version folder (or a model folder: its latest version) is read from its signed BOM, or, without one (a
    version that ``model-factory sign`` signed: only ``build`` writes the BOM), from its own .onnx files, one set
    each, named as a BOM names them; a Hugging Face folder or .safetensors file gives ``source``; an .onnx file
    its initializers.
    """
    path = Path(path)
    bom = _bom_file(path)
    if bom is not None:
        sets = manifests_from_bom(json.loads(bom.read_text()))
        if not sets:
            raise FactoryError(f"{bom} lists no tensors (built before per-tensor digests). Fix: rebuild that "
                               "version, or pass the source folders or .onnx files to compare")
        return sets
    if path.is_file() and path.suffix == ".onnx":
        return {path.name: onnx_manifest(path)}
    tensors = manifest_of(path)
    if tensors:
        return {SOURCE_SET: tensors}
    graphs = _onnx_files(path)
    if graphs:
        return {g.name: onnx_manifest(g) for g in graphs}
    raise FactoryError(f"{path} holds no .safetensors file, .onnx file or bom.cdx.json (nor does its latest "
                       "version folder). Fix: pass a model folder with safetensors weights, an .onnx file, or a "
                       "version folder of a repository")


def _onnx_files(path: Path) -> list[Path]:
    """The .onnx files of a version folder (its top level, where packaging puts them), or of a model folder's
    latest version folder that holds any."""
    if not path.is_dir():
        return []
    found = sorted(p for p in path.glob("*.onnx") if p.is_file())
    if found:
        return found
    versions = sorted((int(p.name) for p in path.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)
    for v in versions:
        found = sorted(p for p in (path / str(v)).glob("*.onnx") if p.is_file())
        if found:
            return found
    return []


def _bom_file(path: Path) -> Path | None:
    if path.is_file() and path.name.endswith(".cdx.json"):
        return path
    if not path.is_dir():
        return None
    if (path / "bom.cdx.json").is_file():
        return path / "bom.cdx.json"
    versions = sorted((int(p.name) for p in path.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)
    for v in versions:
        if (path / str(v) / "bom.cdx.json").is_file():
            return path / str(v) / "bom.cdx.json"
    return None


def diff_paths(old: Path, new: Path) -> list[TensorDiff]:
    """Compare the tensor sets of two sides: same-named sets, or the only set of each side."""
    a, b = manifests_of_path(old), manifests_of_path(new)
    common = [k for k in a if k in b]
    if not common and len(a) == 1 and len(b) == 1:
        (ka, va), (kb, vb) = next(iter(a.items())), next(iter(b.items()))
        return [diff_manifests(va, vb, ka if ka == kb else f"{ka} vs {kb}")]
    if not common:
        raise FactoryError(f"{old} has tensor sets {sorted(a)} and {new} has {sorted(b)}: nothing to pair. Fix: "
                           "compare two sources, two .onnx files, or two version folders")
    return [diff_manifests(a[k], b[k], k) for k in common]
