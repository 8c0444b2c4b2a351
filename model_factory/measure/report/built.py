"""Section "what was built": source and its digest, task, precisions, what is served and the sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_factory.measure.report.release import Release

# The files that carry a precision's weights or engine, by precision.
_MODEL_FILES = {"fp32": ("model.onnx", "model.onnx.data"), "fp16": ("model.fp16.onnx", "model.fp16.onnx.data"),
                "int8": ("model.int8.onnx", "model.int8.onnx.data")}


@dataclass(frozen=True)
class Artifact:
    """A model or engine file of the version folder."""

    name: str
    kind: str  # "ONNX", "ONNX weights", "TensorRT plan", "TorchScript"
    precision: str | None
    size: int | None


@dataclass(frozen=True)
class Built:
    """What one version is made of."""

    model: str
    version: int
    task: str
    created: str | None
    source: str
    source_digest: str | None
    precisions: tuple[str, ...]
    precisions_in_folder: tuple[str, ...]
    served_precision: str
    served_onnx: str | None
    served_plan: str | None
    engines: tuple[str, ...]
    artifacts: tuple[Artifact, ...]
    total_bytes: int
    file_count: int
    recipe: str | None
    tools: tuple[tuple[str, str], ...]
    stage_seconds: tuple[tuple[str, float], ...]


def _source(meta: dict[str, Any]) -> str:
    src = meta.get("source") or {}
    for key, label in (("package", "package"), ("path", "path"), ("factory", "factory")):
        if src.get(key):
            return f"{src.get('kind') or 'model'} {label} {src[key]}"
    return str(src.get("kind") or "unknown")


def _kind(name: str) -> str:
    if name.endswith(".plan"):
        return "TensorRT plan"
    if name.endswith(".onnx.data"):
        return "ONNX weights"
    if name.endswith(".onnx"):
        return "ONNX"
    return "TorchScript" if name.endswith(".pt") else "file"


def collect(release: Release) -> Built:
    """Read the section from ``metadata.json`` and the folder."""
    meta = dict(release.metadata)
    build = meta.get("build") or {}
    serve = meta.get("serve") or {}
    sizes = {f.path: f.size for f in release.files}
    artifacts = []
    for precision, names in _MODEL_FILES.items():
        for name in names:
            if name in sizes:
                artifacts.append(Artifact(name, _kind(name), precision, sizes[name]))
    for name in sorted(sizes):
        if name.endswith(".plan") or name.endswith(".pt"):
            parts = name.split(".")
            artifacts.append(Artifact(name, _kind(name), parts[1] if len(parts) > 2 else None, sizes[name]))
    return Built(
        model=release.model, version=release.version, task=str(meta.get("task") or "?"),
        created=meta.get("created"), source=_source(meta), source_digest=build.get("source_digest"),
        precisions=tuple(meta.get("precisions") or ()),
        precisions_in_folder=tuple(meta.get("precisions_in_folder") or ()),
        served_precision=str(serve.get("precision") or "fp32"), served_onnx=serve.get("onnx"),
        served_plan=serve.get("plan"), engines=tuple(meta.get("engines") or ()), artifacts=tuple(artifacts),
        total_bytes=release.total_bytes, file_count=len(release.files), recipe=meta.get("recipe"),
        tools=tuple(sorted((str(k), str(v)) for k, v in (meta.get("tools") or {}).items())),
        stage_seconds=tuple((str(k), float(v)) for k, v in (build.get("stage_seconds") or {}).items()),
    )
