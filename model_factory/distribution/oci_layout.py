"""OCI basics shared by every target: media types, descriptors, digests, and the OCI image layout on disk.

A *target* is where artifacts go and come from: a registry (:mod:`.registry`) or an OCI image layout
folder (``oci-layout:DIR``, for removable media across an air gap). Both offer the same small set of
operations (:class:`Target`), so push and pull are written once. Referrers are found the same way in
both: the OCI 1.1 referrers API where a registry has it, otherwise the tag schema (an image index
tagged ``sha256-<hex of the subject>`` that lists the referrers), which a layout always uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from model_factory.errors import FactoryError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
EMPTY_JSON = b"{}"
EMPTY_DIGEST = "sha256:" + hashlib.sha256(EMPTY_JSON).hexdigest()
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
ANNOTATION_TITLE = "org.opencontainers.image.title"
ANNOTATION_VERSION = "org.opencontainers.image.version"
ANNOTATION_CREATED = "org.opencontainers.image.created"

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_CHUNK = 1 << 20

Progress = Callable[[str, int, int], None]  # (what, bytes done, bytes total)


def sha256_bytes(data: bytes) -> str:
    """``sha256:<hex>`` of bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """``sha256:<hex>`` of a file, streamed (never held in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def check_digest(digest: str) -> str:
    """Refuse anything but ``sha256:<64 hex>`` (a digest also names files on disk: no path tricks)."""
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise FactoryError(f"{digest!r} is not a sha256 digest. Fix: the artifact is damaged; push it again")
    return digest


def descriptor(media_type: str, digest: str, size: int, annotations: dict[str, str] | None = None,
               artifact_type: str | None = None) -> dict[str, Any]:
    """An OCI content descriptor as a JSON-ready dict."""
    d: dict[str, Any] = {"mediaType": media_type, "digest": check_digest(digest), "size": int(size)}
    if artifact_type:
        d["artifactType"] = artifact_type
    if annotations:
        d["annotations"] = dict(annotations)
    return d


def canonical_json(obj: Any) -> bytes:
    """The bytes we push for a JSON document (sorted keys, no spaces): one digest per content."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def fallback_tag(subject_digest: str) -> str:
    """The referrers tag schema: ``sha256:<hex>`` -> ``sha256-<hex>``."""
    return check_digest(subject_digest).replace(":", "-")


@dataclass(frozen=True)
class Blob:
    """A blob to upload: bytes in memory (small) or a file on disk (streamed)."""

    digest: str
    size: int
    data: bytes | None = None
    path: Path | None = None

    @staticmethod
    def of_bytes(data: bytes) -> "Blob":
        return Blob(sha256_bytes(data), len(data), data=data)

    @staticmethod
    def of_file(path: Path, digest: str | None = None) -> "Blob":
        return Blob(digest or sha256_file(path), Path(path).stat().st_size, path=Path(path))


class Target(Protocol):
    """Where artifacts are stored: a registry repository, or an OCI image layout folder."""

    label: str  # for messages

    def has_blob(self, digest: str) -> bool: ...

    def put_blob(self, blob: Blob, progress: Progress | None = None) -> None: ...

    def fetch_blob(self, digest: str, size: int, dest: Path, progress: Progress | None = None) -> None:
        """Write the blob to ``dest``; its digest and size are checked while it streams (FactoryError if not)."""

    def put_manifest(self, data: bytes, media_type: str, reference: str) -> bool:
        """Store a manifest under a tag or its digest; True when the store indexes its ``subject`` itself."""

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        """The manifest bytes and their digest, by tag or digest (FactoryError when absent)."""

    def referrers_api(self, digest: str) -> list[dict[str, Any]] | None:
        """The referrers of ``digest`` from the OCI 1.1 API, or None where the store has no such API."""


class StreamCheck:
    """Hash bytes as they are written, and compare with the expected digest and size at the end."""

    def __init__(self, digest: str, size: int, what: str):
        self.digest, self.size, self.what = check_digest(digest), size, what
        self.h = hashlib.sha256()
        self.n = 0

    def update(self, chunk: bytes) -> None:
        self.n += len(chunk)
        if self.n > self.size:
            raise FactoryError(f"{self.what}: more bytes than the {self.size} its descriptor lists: the store holds "
                               "other content under this digest (tampered or damaged). Fix: push the model again "
                               "from a trusted build")
        self.h.update(chunk)

    def finish(self) -> None:
        got = "sha256:" + self.h.hexdigest()
        if self.n != self.size or got != self.digest:
            raise FactoryError(f"{self.what}: its content does not match its digest ({got[:19]}... for "
                               f"{self.digest[:19]}..., {self.n} of {self.size} bytes): the blob was swapped or "
                               "damaged in the store. Fix: push the model again from a trusted build")


def copy_checked(src: Path, digest: str, size: int, dest: Path, what: str, progress: Progress | None = None) -> None:
    """Copy a file, hashing it on the way; ``dest`` is written only through a temporary sibling."""
    check = StreamCheck(digest, size, what)
    tmp = dest.with_name(dest.name + ".part")
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        for chunk in iter(lambda: fin.read(_CHUNK), b""):
            check.update(chunk)
            fout.write(chunk)
            if progress:
                progress(what, check.n, size)
    commit_checked(check, tmp, dest)


def commit_checked(check: StreamCheck, tmp: Path, dest: Path) -> None:
    """Rename a fully streamed ``tmp`` to ``dest`` if its digest and size match; otherwise delete it and raise."""
    try:
        check.finish()
    except FactoryError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)


class OciLayout:
    """An OCI image layout folder (``oci-layout``, ``index.json``, ``blobs/sha256/``), as skopeo reads it.

    Tags are ``org.opencontainers.image.ref.name`` annotations in ``index.json``. Referrers are kept with
    the tag schema (``sha256-<hex>`` index), so ``skopeo copy`` can carry them to a registry like any tag.
    """

    def __init__(self, root: Path, create: bool = False):
        self.root = Path(root)
        self.label = f"oci-layout:{self.root}"
        if create:
            (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
            if not (self.root / "oci-layout").exists():
                (self.root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
            if not (self.root / "index.json").exists():
                self._write_index({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []})
        elif not (self.root / "oci-layout").is_file():
            raise FactoryError(f"{self.root} is not an OCI image layout (no oci-layout file). Fix: pass the folder "
                               "that `model-factory push ... oci-layout:DIR` wrote")

    def _blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / check_digest(digest).split(":", 1)[1]

    def _index(self) -> dict[str, Any]:
        try:
            return json.loads((self.root / "index.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FactoryError(f"{self.root}/index.json cannot be read ({exc}). Fix: write the layout again") from exc

    def _write_index(self, index: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".index.", dir=self.root)
        with os.fdopen(fd, "w") as f:
            json.dump(index, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.root / "index.json")

    def has_blob(self, digest: str) -> bool:
        return self._blob_path(digest).is_file()

    def put_blob(self, blob: Blob, progress: Progress | None = None) -> None:
        dest = self._blob_path(blob.digest)
        if dest.is_file():
            return
        if blob.data is not None:
            tmp = dest.with_name(dest.name + ".part")
            tmp.write_bytes(blob.data)
            os.replace(tmp, dest)
        else:
            assert blob.path is not None
            copy_checked(blob.path, blob.digest, blob.size, dest, f"blob {blob.digest[:19]}", progress)

    def fetch_blob(self, digest: str, size: int, dest: Path, progress: Progress | None = None) -> None:
        src = self._blob_path(digest)
        if not src.is_file():
            raise FactoryError(f"{self.label} has no blob {digest[:19]}...: the layout is incomplete. Fix: copy the "
                               "whole layout folder again")
        copy_checked(src, digest, size, Path(dest), f"blob {digest[:19]}", progress)

    def put_manifest(self, data: bytes, media_type: str, reference: str) -> bool:
        digest = sha256_bytes(data)
        self.put_blob(Blob(digest, len(data), data=data))
        index = self._index()
        desc = descriptor(media_type, digest, len(data))
        doc = json.loads(data)
        if doc.get("artifactType"):
            desc["artifactType"] = doc["artifactType"]
        manifests = index.setdefault("manifests", [])
        if not reference.startswith("sha256:"):
            desc["annotations"] = {ANNOTATION_REF_NAME: reference}
            manifests[:] = [m for m in manifests if (m.get("annotations") or {}).get(ANNOTATION_REF_NAME) != reference]
        elif any(m.get("digest") == digest for m in manifests):
            return False
        manifests.append(desc)
        self._write_index(index)
        return False

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        for m in self._index().get("manifests", []):
            if reference == m.get("digest") or (m.get("annotations") or {}).get(ANNOTATION_REF_NAME) == reference:
                path = self._blob_path(m["digest"])
                data = path.read_bytes() if path.is_file() else b""
                if sha256_bytes(data) != m["digest"]:
                    raise FactoryError(f"{self.label}: manifest {reference} does not match its digest (tampered or "
                                       "damaged). Fix: copy the layout again from a trusted source")
                return data, m["digest"]
        if reference.startswith("sha256:") and self._blob_path(reference).is_file():
            data = self._blob_path(reference).read_bytes()
            if sha256_bytes(data) == reference:
                return data, reference
        raise FactoryError(f"{self.label} has no manifest {reference!r}. Fix: check the tag (tags here: "
                           f"{', '.join(self.tags()) or 'none'})")

    def tags(self) -> list[str]:
        """Tags in ``index.json``."""
        return sorted(n for m in self._index().get("manifests", [])
                      if (n := (m.get("annotations") or {}).get(ANNOTATION_REF_NAME)))

    def referrers_api(self, digest: str) -> list[dict[str, Any]] | None:
        return None


def open_layout(root: Path, create: bool) -> OciLayout:
    """An OCI layout target; ``create`` makes the folder (for push)."""
    root = Path(root)
    if create and root.exists() and not root.is_dir():
        raise FactoryError(f"{root} exists and is not a folder. Fix: pass a folder for the OCI layout")
    if create and root.is_dir() and any(root.iterdir()) and not (root / "oci-layout").exists():
        raise FactoryError(f"{root} is a folder that is not an OCI layout. Fix: pass an empty or new folder")
    return OciLayout(root, create=create)


def remove_tree(path: Path) -> None:
    """Remove a staging folder, quietly."""
    shutil.rmtree(path, ignore_errors=True)
