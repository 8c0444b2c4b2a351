"""A signed model version as OCI content: the CNCF ModelPack artifact, the model-car image, and its referrers.

**ModelPack** (``artifactType application/vnd.cncf.model.manifest.v1+json``): one raw layer per file of
the version's signed unit (``config.pbtxt``, ``<v>/model.onnx``, the backend code, the tokenizer...), each
annotated with its path (``org.cncf.model.filepath``) and typed as weights, weight configuration, code,
docs or dataset. A layer's digest *is* the file's sha256, the same one the signature lists, so a
manifest can be checked against the signature before a byte of weights is downloaded.

**Model car** (an OCI image, what KServe model cars and Kubernetes image volumes mount): one tar layer
with the whole model folder under ``/models/<model>/`` (signature and provenance included), so the
init container runs ``model-factory verify`` on the mounted folder as it is.

**Referrers** (``subject`` = the model manifest): the signature bundle, the signed provenance, the
CycloneDX BOM and the release files, each a small artifact with an empty config.
"""

from __future__ import annotations

import datetime as dt
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from model_factory.distribution.oci_layout import (ANNOTATION_CREATED, ANNOTATION_TITLE, ANNOTATION_VERSION,
                                                   EMPTY_DIGEST, EMPTY_JSON, OCI_EMPTY, OCI_MANIFEST, Blob,
                                                   canonical_json, descriptor, sha256_file)
from model_factory.errors import FactoryError

MODEL_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
MODEL_CONFIG = "application/vnd.cncf.model.config.v1+json"
WEIGHT = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG = "application/vnd.cncf.model.weight.config.v1.raw"
CODE = "application/vnd.cncf.model.code.v1.raw"
DOC = "application/vnd.cncf.model.doc.v1.raw"
DATASET = "application/vnd.cncf.model.dataset.v1.raw"
FILEPATH = "org.cncf.model.filepath"
FILE_METADATA = "org.cncf.model.file.metadata+json"
IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
IMAGE_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"

SIGSTORE_BUNDLE = "application/vnd.dev.sigstore.bundle.v0.3+json"
BOM_TYPE = "application/vnd.cyclonedx+json"
RELEASE_TYPE = "application/vnd.model-factory.release.v1+json"
ROLE = "dev.model-factory.role"  # signature | provenance | bom | release
MODEL_NAME = "dev.model-factory.model"
EMPTY_DIRS = "dev.model-factory.empty-dirs"

_WEIGHT_SUFFIXES = (".onnx", ".plan", ".pt", ".pth", ".bin", ".safetensors", ".data", ".engine", ".npz")


def layer_media_type(relpath: str) -> str:
    """The ModelPack layer type of a file of the model folder."""
    p = PurePosixPath(relpath)
    if p.name.endswith(_WEIGHT_SUFFIXES) or ".onnx" in p.name:
        return WEIGHT
    if p.suffix == ".py" or "mf_backend" in p.parts:
        return CODE
    if "acceptance" in p.parts:
        return DATASET
    if p.suffix in (".md", ".txt", ".html") or p.name.endswith(".cdx.json"):
        return DOC
    return WEIGHT_CONFIG


@dataclass(frozen=True)
class VersionContent:
    """One signed model version as found on disk: its files (by the signature's digests) and signature files."""

    model_dir: Path
    model: str
    version: int
    files: dict[str, tuple[str, int]]  # relpath -> ("sha256:<hex>", size)
    empty_dirs: tuple[str, ...]
    signature: Path
    provenance: Path | None
    bom: str | None  # relpath of the version's BOM file, when there is one

    @property
    def role_files(self) -> dict[str, Path]:
        """The referrer files found beside the version: signature, provenance."""
        roles = {"signature": self.signature}
        if self.provenance is not None:
            roles["provenance"] = self.provenance
        return roles


def collect_version(repo: Path, model: str, version: int | None) -> VersionContent:
    """Read one signed version of ``repo/model``; refuse an unsigned one or one changed since signing."""
    from model_factory.distribution.bom import BOM_FILE
    from model_factory.signing import layout
    from model_factory.signing.digests import file_tasks, hash_tasks
    from model_factory.signing.verify import signed_digests

    from model_factory.distribution.adapters import is_adapter_entry

    model_dir = Path(repo) / model
    if not (model_dir / "config.pbtxt").is_file() and not is_adapter_entry(model_dir):
        raise FactoryError(f"{model_dir} is not a packaged model (no config.pbtxt) nor a LoRA adapter entry (no "
                           "<version>/adapter.json). Fix: pass the repository and a model name in it (model-factory "
                           "build packages one)")
    versions = layout.model_entries(model_dir).versions
    if version is None:
        if not versions:
            raise FactoryError(f"model {model} has no version folder. Fix: build and sign it first")
        version = max(versions)
    if version not in versions:
        raise FactoryError(f"model {model} has no version {version} (it has {', '.join(map(str, versions)) or 'none'})."
                           " Fix: pass --version with one of them")
    sig = layout.signature_path(model_dir, version)
    if not sig.is_file():
        raise FactoryError(f"{model} version {version} is not signed ({sig.name} is missing); only signed versions "
                           "are pushed. Fix: model-factory sign --model ... --version ... first")
    scan = layout.scan_unit(model_dir, version)
    if scan.problems:
        raise FactoryError(f"cannot push {model} version {version}: {'; '.join(scan.problems)}")
    signed = signed_digests(model_dir, version)
    actual = hash_tasks(file_tasks(model_dir, scan.files))
    changed = sorted(p for p in set(signed) | set(actual) if signed.get(p) != actual.get(p))
    if changed:
        raise FactoryError(f"{model} version {version} changed since it was signed ({', '.join(changed[:5])}"
                           f"{' ...' if len(changed) > 5 else ''}). Fix: rebuild or re-sign it before pushing")
    files = {p: (f"sha256:{d}", (model_dir / p).stat().st_size) for p, d in sorted(actual.items())}
    prov = layout.provenance_path(model_dir, version)
    bom = f"{version}/{BOM_FILE}"
    return VersionContent(model_dir, model, version, files, scan.empty_dirs, sig, prov if prov.is_file() else None,
                          bom if bom in files else None)


def _file_metadata(path: Path, relpath: str) -> str:
    st = path.stat()
    meta = {"name": relpath, "mode": 0o644, "uid": 0, "gid": 0, "size": st.st_size,
            "mtime": dt.datetime.fromtimestamp(int(st.st_mtime), dt.timezone.utc).isoformat().replace("+00:00", "Z"),
            "typeflag": 48}
    return json.dumps(meta, sort_keys=True, separators=(",", ":"))


def modelpack(content: VersionContent, created: str | None = None) -> tuple[bytes, list[Blob]]:
    """The ModelPack manifest bytes and every blob it needs (config, one per file)."""
    layers, blobs, seen = [], [], set()
    for rel, (digest, size) in content.files.items():
        path = content.model_dir / rel
        layers.append(descriptor(layer_media_type(rel), digest, size,
                                 {FILEPATH: rel, FILE_METADATA: _file_metadata(path, rel)}))
        if digest not in seen:
            seen.add(digest)
            blobs.append(Blob(digest, size, path=path))
    # The build's time, not the push's: pushing the same version twice gives the same manifest digest.
    created = created or _built_at(content)
    config = {
        "descriptor": {"name": content.model, "version": str(content.version), "createdAt": created,
                       "vendor": "model-factory"},
        "config": {"format": "onnx", **_model_facts(content)},
        "modelfs": {"type": "layers", "diffIds": [layer["digest"] for layer in layers]},
    }
    config_bytes = canonical_json(config)
    config_blob = Blob.of_bytes(config_bytes)
    annotations = {ANNOTATION_VERSION: str(content.version), ANNOTATION_CREATED: created, MODEL_NAME: content.model}
    if content.empty_dirs:
        annotations[EMPTY_DIRS] = json.dumps(list(content.empty_dirs))
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": MODEL_ARTIFACT,
                "config": descriptor(MODEL_CONFIG, config_blob.digest, config_blob.size),
                "layers": layers, "annotations": annotations}
    return canonical_json(manifest), [config_blob, *blobs]


def _built_at(content: VersionContent) -> str:
    try:
        meta = json.loads((content.model_dir / str(content.version) / "metadata.json").read_text())
        when = dt.datetime.fromisoformat(str(meta["created"]).replace("Z", "+00:00"))
    except (OSError, ValueError, KeyError):
        when = dt.datetime.fromtimestamp(int(content.signature.stat().st_mtime), dt.timezone.utc)
    return when.astimezone(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _model_facts(content: VersionContent) -> dict[str, Any]:
    """Precision and capabilities from the version's metadata.json, where it has them."""
    try:
        meta = json.loads((content.model_dir / str(content.version) / "metadata.json").read_text())
    except (OSError, ValueError):
        return {}
    facts: dict[str, Any] = {}
    serve = (meta.get("serve") or {}).get("precision")
    if serve:
        facts["precision"] = serve
    if meta.get("task") == "embedding":
        facts["capabilities"] = {"inputTypes": ["text"], "outputTypes": ["embedding"], "embedding": True}
    return facts


def _tar_info(name: str, size: int, is_dir: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0, 0, 0, "", ""
    info.mode = 0o755 if is_dir else 0o644
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    return info


def modelcar(content: VersionContent, workdir: Path) -> tuple[bytes, list[Blob]]:
    """An OCI image whose one layer holds ``models/<model>/...`` (files, signature, provenance).

    The tar is written to ``workdir`` (it can be large) with fixed owners and times, so the same version
    always gives the same layer digest.
    """
    tar_path = Path(workdir) / f"{content.model}-{content.version}.tar"
    entries = dict(content.files)
    for name in (content.signature.name, *([content.provenance.name] if content.provenance else [])):
        entries[name] = ("", (content.model_dir / name).stat().st_size)
    dirs = {str(parent) for rel in entries for parent in PurePosixPath(rel).parents if str(parent) != "."}
    dirs |= set(content.empty_dirs)
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("models", f"models/{content.model}", *(f"models/{content.model}/{d}" for d in sorted(dirs))):
            tar.addfile(_tar_info(d, 0, is_dir=True))
        for rel in sorted(entries):
            path = content.model_dir / rel
            with open(path, "rb") as f:
                tar.addfile(_tar_info(f"models/{content.model}/{rel}", path.stat().st_size), f)
    layer = Blob.of_file(tar_path)
    image_config = {"architecture": "amd64", "os": "linux",
                    "config": {"Labels": {MODEL_NAME: content.model, ANNOTATION_VERSION: str(content.version)}},
                    "rootfs": {"type": "layers", "diff_ids": [layer.digest]}}
    cfg = Blob.of_bytes(canonical_json(image_config))
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": descriptor(IMAGE_CONFIG, cfg.digest, cfg.size),
                "layers": [descriptor(IMAGE_LAYER_TAR, layer.digest, layer.size)],
                "annotations": {ANNOTATION_VERSION: str(content.version), MODEL_NAME: content.model}}
    return canonical_json(manifest), [cfg, layer]


def referrer(subject: dict[str, Any], artifact_type: str, role: str,
             files: list[tuple[str, Blob, str]]) -> tuple[bytes, list[Blob]]:
    """A referrer manifest (empty config, one layer per ``(title, blob, media type)``) for ``subject``."""
    layers = [descriptor(media, blob.digest, blob.size, {ANNOTATION_TITLE: title}) for title, blob, media in files]
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
                "config": descriptor(OCI_EMPTY, EMPTY_DIGEST, len(EMPTY_JSON)),
                "layers": layers, "subject": subject, "annotations": {ROLE: role}}
    return canonical_json(manifest), [Blob.of_bytes(EMPTY_JSON), *(b for _, b, _ in files)]


def file_blob(path: Path) -> Blob:
    """A blob for a small file beside the model (a signature, a release file)."""
    if not Path(path).is_file():
        raise FactoryError(f"{path} does not exist. Fix: pass an existing file")
    return Blob(sha256_file(path), Path(path).stat().st_size, data=Path(path).read_bytes())


def parse_manifest(data: bytes, what: str) -> dict[str, Any]:
    """A manifest as a dict; a FactoryError for anything that is not an OCI image manifest."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise FactoryError(f"{what} is not JSON: the artifact is damaged. Fix: push it again") from exc
    if not isinstance(doc, dict) or doc.get("schemaVersion") != 2 or not isinstance(doc.get("layers"), list):
        raise FactoryError(f"{what} is not an OCI image manifest. Fix: pass a reference that model-factory push wrote")
    return doc

