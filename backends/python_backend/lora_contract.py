"""A LoRA adapter's entry in the repository: what packaging writes and the backend (and ``serve``) read.

An adapter is its own versioned entry beside its base, signed like any model version, but not a Triton model (no
``config.pbtxt``: Triton never loads it; its base's stub does)::

    <repo>/<adapter>/<v>/adapter.json     AdapterSpec: the base's name, version and digests, rank, modules
    <repo>/<adapter>/<v>/adapter.npz      per graph module m: "m.A" [in, r] and "m.B" [r, out] (scaling folded in)
    <repo>/<adapter>/<v>/accuracy.json    the build's gate (perplexity and agreement against the merged FP32)

A graph module is named after the base graph's projection ``MatMul`` it adds to (``layers.0.attn.qkv_proj``, from
``/model/layers.0/attn/qkv_proj/MatMul``): a packed projection (q, k and v in one MatMul) gets one pair, the
Hugging Face modules' pairs side by side in ``A`` and block-diagonal in ``B``. ``base_digests`` are the sha256 of
the base version's files the adapter was checked with (relative to its version folder): a base whose bytes differ
is not the base the adapter was trained and gated on, and its stub refuses the adapter by name.

Requests name an adapter in ``sampling_parameters`` as ``lora_name`` (vLLM's Triton backend's key); the OpenAI
frontend sends it for the adapter's model name. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ADAPTER_SPEC = "adapter.json"
ADAPTER_WEIGHTS = "adapter.npz"
LORA_NAME = "lora_name"  # the sampling_parameters key that names a request's adapter
LORA_MASK = "lora_mask"  # the rewritten graph's input [batch, 1, k]: ones over each row's adapter's columns
# The builder's MatMul, its MatMulNBits, or the factory's weight-only INT8 / INT4 of it (lm_blockwise: "MatMul_Q8",
# "MatMul_Q4", a MatMulNBits under the MatMul's name and its bits).
_MODULE = re.compile(r"^/model/(layers\.\d+)/(attn|mlp)/(\w+)/(MatMul|MatMulNBits|MatMul_Q\d+)$")


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of a file, read in blocks: how ``base_digests`` name the base version's files."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def graph_module(node_name: str) -> str | None:
    """``layers.0.attn.qkv_proj`` for the builder's ``/model/layers.0/attn/qkv_proj/MatMul`` (or its MatMulNBits, or
    the factory's weight-only ``.../MatMul_Q8`` / ``MatMul_Q4``);
    None for a node that is no layer's projection (the LM head, attention's own MatMuls)."""
    m = _MODULE.match(node_name)
    return f"{m.group(1)}.{m.group(2)}.{m.group(3)}" if m else None


def lora_inputs(module: str) -> tuple[str, str]:
    """The rewritten graph's inputs of one module: the bound adapters' ``A`` transposed, side by side ``[k, in]``,
    and their ``B`` ``[k, out]`` (``k`` = adapters x rank)."""
    return f"lora.{module}.A", f"lora.{module}.B"


@dataclass(frozen=True)
class AdapterSpec:
    """``adapter.json``: which base an adapter applies to (name, version, digests) and what it adds."""

    name: str
    version: int
    base: str
    base_version: int
    base_digests: dict[str, str]  # relpath in the base's version folder -> sha256
    rank: int  # the widest module's rank (a packed module's ranks summed)
    modules: tuple[str, ...]
    weights_bytes: int
    peft: dict = field(default_factory=dict)  # what adapter_config.json said: r, lora_alpha, target_modules, ...

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "version": self.version, "base": self.base,
                           "base_version": self.base_version, "base_digests": dict(sorted(self.base_digests.items())),
                           "rank": self.rank, "modules": list(self.modules), "weights_bytes": self.weights_bytes,
                           "peft": self.peft}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "AdapterSpec":
        d = json.loads(text)
        return cls(str(d["name"]), int(d["version"]), str(d["base"]), int(d["base_version"]),
                   {str(k): str(v) for k, v in d["base_digests"].items()}, int(d["rank"]),
                   tuple(str(m) for m in d["modules"]), int(d["weights_bytes"]), dict(d.get("peft", {})))


def adapter_entries(repository: Path, base: str) -> list[tuple[str, Path]]:
    """``(adapter name, version folder)`` of every adapter entry in ``repository`` whose newest version names
    ``base``; hidden folders (a build's staging) and symlinks are not entries."""
    found = []
    repository = Path(repository)
    if not repository.is_dir():
        return found
    for entry in sorted(repository.iterdir()):
        if entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir():
            continue
        versions = sorted((int(p.name) for p in entry.iterdir() if p.name.isdigit() and (p / ADAPTER_SPEC).is_file()),
                          reverse=True)
        if not versions:
            continue
        vdir = entry / str(versions[0])
        try:
            named = json.loads((vdir / ADAPTER_SPEC).read_text()).get("base")
        except (OSError, ValueError):
            continue  # unreadable: no base claims it (serve's verification names a tampered entry)
        if named == base:
            found.append((entry.name, vdir))
    return found
