"""Section "engines": the TensorRT plans of a version, from their ``.plan.json`` sidecars.

The sidecar is written by ``build_engines/tensorrt.py`` beside each plan: the builder
(flavour and version), the GPU it was built on (or an ahead-of-time build and its
targets), the optimization profiles, the size and the build time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_factory.measure.report.release import Release


@dataclass(frozen=True)
class Profile:
    """One optimization profile: the shape range of its first input, and all of them as text."""

    label: str
    ranges: tuple[str, ...]  # "input_ids: min 1×1, opt 64×32, max 64×32"


@dataclass(frozen=True)
class Engine:
    plan: str
    precision: str
    builder: str  # "tensorrt_rtx 1.7.1.116"
    device: str  # the GPU product it was built for, or the ahead-of-time note
    targets: str | None
    plan_bytes: int | None
    build_seconds: float | None
    built_at: str | None
    strongly_typed: bool | None
    input_onnx: str | None
    profiles: tuple[Profile, ...]
    served: bool


@dataclass(frozen=True)
class Engines:
    engines: tuple[Engine, ...]

    @property
    def present(self) -> bool:
        return bool(self.engines)


def _dims(shape: Any) -> str:
    return "×".join(str(d) for d in shape)


def _profile(i: int, p: Mapping[str, Any]) -> Profile:
    ranges = tuple(f"{name}: min {_dims(s['min'])}, opt {_dims(s['opt'])}, max {_dims(s['max'])}"
                   for name, s in (p.get("inputs") or {}).items())
    label = f"profile {i}" + (f" (sequences ≤ {p['bucket']})" if p.get("bucket") is not None else "")
    return Profile(label, ranges)


def _device(meta: Mapping[str, Any]) -> str:
    dev = meta.get("device")
    if isinstance(dev, Mapping):
        cc = dev.get("compute_capability")
        return f"{dev.get('name', 'GPU')}" + (f" (compute capability {_dims(cc) if isinstance(cc, list) else cc})"
                                               if cc else "")
    return str(dev or "not recorded")


def collect(release: Release) -> Engines:
    """Every ``model.*.plan.json`` of the version folder (none: "no engines built")."""
    served_plan = (release.metadata.get("serve") or {}).get("plan")
    engines = []
    for path in sorted(release.version_dir.glob("*.plan.json")):
        meta = release.read_json(path.name) or {}
        plan = str(meta.get("plan") or path.name[: -len(".json")])
        size = meta.get("plan_bytes")
        if size is None and (release.version_dir / plan).is_file():
            size = (release.version_dir / plan).stat().st_size
        engines.append(Engine(
            plan=plan, precision=str(meta.get("precision") or "?"),
            builder=f"{meta.get('flavour', 'TensorRT')} {meta.get('version', '')}".strip(), device=_device(meta),
            targets=meta.get("targets"), plan_bytes=size, build_seconds=meta.get("build_seconds"),
            built_at=meta.get("built_at"), strongly_typed=meta.get("strongly_typed"),
            input_onnx=meta.get("input_onnx"),
            profiles=tuple(_profile(i, p) for i, p in enumerate(meta.get("profiles") or ())),
            served=plan == served_plan))
    return Engines(tuple(engines))
