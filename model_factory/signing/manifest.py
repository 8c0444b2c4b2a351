"""The signed manifest: one model version's files and digests, as an OMS v1.0 in-toto statement.

The statement follows the OpenSSF Model Signing specification v1.0
(``ossf/model-signing-spec``, ``spec/v1.0.md``), predicate
``https://model_signing/signature/v1.0``: a subject named after the model
folder whose sha256 is taken over all resource digests in order, and one
resource per file (``"files"`` method) or per shard (``"shards"``, read only),
sorted by name in Unicode code point order (spec §5.2.1, §6.4).

The predicate holds exactly ``resources`` and ``serialization`` (its schema
allows nothing else). What model-factory adds, the version the signature is
for and the empty folders of the unit (which a list of file digests cannot
cover), rides in the ``annotations`` of the first resource descriptor: the
spec lets resource descriptors carry in-toto's optional fields and tells
verifiers to ignore the ones they do not know (§5.2.1). Bundles written before
this (model-factory 0.1) carried a ``model_factory`` predicate member instead;
it is still read.

``ignore_paths`` in ``serialization`` record what the signer left out: the
spec's default exclusions (``.git``, ``.gitignore``, ``.gitattributes``,
``.github``), the other version folders and the signature files. What our
verifier accepts as left out is decided by :mod:`model_factory.signing.layout`
(see :mod:`model_factory.signing.verify`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from model_factory.errors import FactoryError
from model_factory.signing.digests import root_digest

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
_PREDICATE_V01 = "https://model_signing/Digests/v0.1"
EXTENSION_KEY = "model_factory"
# Format 1: a predicate member (0.1, read only); format 2: annotations of the first resource.
EXTENSION_FORMAT = 2
_LEGACY_FORMAT = 1
_PREDICATE_KEYS = ("resources", "serialization")
_SUPPORTED_HASHES = ("sha256",)
_SPEC_HASHES = ("sha256", "blake2b", "blake3")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MIN_SHARD_SIZE = 4096


class ManifestError(FactoryError):
    """A signed statement that is not a usable model manifest."""


def check_relpath(name: object) -> str | None:
    """Why ``name`` is not a clean relative POSIX path inside the model folder, or None."""
    if not isinstance(name, str) or not name:
        return f"resource name {name!r} is not a path"
    if "\x00" in name:
        return f"resource name {name!r} contains a NUL byte"
    if name.startswith("/"):
        return f"resource {name!r} is an absolute path, escaping the model folder"
    parts = name.split("/")
    if ".." in parts:
        return f"resource {name!r} escapes the model folder through '..'"
    if any(p in ("", ".") for p in parts):
        return f"resource name {name!r} is not a normalized path"
    return None


def _sort_key(name: str) -> str:
    # OMS v1.0 §5.2.1: sorted by name in Unicode code point order, which is Python's str order.
    # (model_signing 1.1.1 sorts by path components, "a/b" before "a-b/c"; it does not rely on the
    # order when verifying: the root digest is taken over the resources as listed.)
    return name


def split_shard(name: str) -> tuple[str, int, int]:
    """``"dir/file:0:100"`` into ``("dir/file", 0, 100)``."""
    path, start, end = name.rsplit(":", 2)
    return path, int(start), int(end)


@dataclass(frozen=True)
class Manifest:
    """A model version's signed content. ``items`` are (resource name, sha256 hex) in signed order."""

    model_name: str
    items: tuple[tuple[str, str], ...]
    method: str = "files"
    shard_size: int | None = None
    empty_dirs: tuple[str, ...] = ()
    version: int | None = None
    ignore_paths: tuple[str, ...] = ()

    @property
    def root_digest(self) -> str:
        return root_digest(d for _, d in self.items)

    def digests(self) -> dict[str, str]:
        """Resource name to sha256 hex."""
        return dict(self.items)

    def files(self) -> dict[str, tuple]:
        """Per file path, a comparable fingerprint: the digest, or the (start, end, digest) shards."""
        if self.method == "files":
            return {name: (digest,) for name, digest in self.items}
        out: dict[str, list] = {}
        for name, digest in self.items:
            path, start, end = split_shard(name)
            out.setdefault(path, []).append((start, end, digest))
        return {p: tuple(sorted(v)) for p, v in out.items()}

    def to_statement(self) -> dict[str, Any]:
        """The in-toto statement to sign."""
        serialization: dict[str, Any] = {"method": self.method, "hash_type": "sha256", "allow_symlinks": False}
        if self.method == "shards":
            serialization["shard_size"] = self.shard_size
        if self.ignore_paths:
            serialization["ignore_paths"] = list(self.ignore_paths)
        resources: list[dict[str, Any]] = [{"name": n, "algorithm": "sha256", "digest": d} for n, d in self.items]
        if resources:
            resources[0]["annotations"] = {EXTENSION_KEY: {"format": EXTENSION_FORMAT, "version": self.version,
                                                           "empty_directories": list(self.empty_dirs)}}
        predicate: dict[str, Any] = {"resources": resources, "serialization": serialization}
        return {
            "_type": STATEMENT_TYPE,
            "subject": [{"name": self.model_name, "digest": {"sha256": self.root_digest}}],
            "predicateType": PREDICATE_TYPE,
            "predicate": predicate,
        }


def build_manifest(model_name: str, digests: Mapping[str, str], version: int,
                   empty_dirs: Iterable[str] = (), ignore_paths: Iterable[str] = ()) -> Manifest:
    """A "files" manifest, resources in model_signing's order."""
    items = tuple((n, digests[n]) for n in sorted(digests, key=_sort_key))
    return Manifest(model_name, items, "files", None, tuple(sorted(empty_dirs)), version,
                    tuple(sorted(ignore_paths)))


def _int(value: Any) -> int | None:
    # model_signing writes numbers through protobuf's Struct, which makes them floats.
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def parse_statement(statement: Mapping[str, Any]) -> Manifest:
    """Validate a signed model_signing v1.0 statement and return its manifest."""
    if statement.get("_type") != STATEMENT_TYPE:
        raise ManifestError(f"the statement type is {statement.get('_type')!r}, expected {STATEMENT_TYPE!r}")
    extra = sorted(set(statement) - {"_type", "subject", "predicateType", "predicate"})
    if extra:
        raise ManifestError(f"the statement has member {extra[0]!r}, which an OMS v1.0 statement does not allow")
    ptype = statement.get("predicateType")
    if ptype == _PREDICATE_V01:
        raise ManifestError("the signature uses model_signing's pre-1.0 format (Digests/v0.1), which does not "
                            "bind the file list. Fix: re-sign with model-factory sign or model_signing >= 1.0")
    if ptype != PREDICATE_TYPE:
        raise ManifestError(f"the predicate type is {ptype!r}, expected {PREDICATE_TYPE!r}")
    subjects = statement.get("subject")
    if not isinstance(subjects, list) or len(subjects) != 1 or not isinstance(subjects[0], dict):
        raise ManifestError("the statement must have exactly one subject")
    name = subjects[0].get("name")
    digest = subjects[0].get("digest")
    if not isinstance(name, str) or not name or not isinstance(digest, dict) \
            or not _HEX64.match(str(digest.get("sha256"))):
        raise ManifestError("the subject has no name or no sha256 digest")
    predicate = statement.get("predicate")
    if not isinstance(predicate, dict):
        raise ManifestError("the statement has no predicate")
    unknown = sorted(set(predicate) - set(_PREDICATE_KEYS) - {EXTENSION_KEY})
    if unknown:
        raise ManifestError(f"the predicate has member {unknown[0]!r}, which OMS v1.0 does not allow (only "
                            "resources and serialization). Fix: re-sign with model-factory sign")
    ser = predicate.get("serialization")
    if not isinstance(ser, dict):
        raise ManifestError("the predicate has no serialization section")
    method = ser.get("method")
    if method not in ("files", "shards"):
        raise ManifestError(f"serialization method {method!r} is not supported (files or shards)")
    hash_type = ser.get("hash_type")
    if hash_type not in _SUPPORTED_HASHES:
        known = "an OMS v1.0 hash model-factory does not implement" if hash_type in _SPEC_HASHES else "unknown"
        raise ManifestError(f"hash type {hash_type!r} is {known}. Fix: sign with sha256 (the OMS default, "
                            "model-factory sign)")
    # OMS v1.0 §6.1.1: the verifier applies the signer's symlink policy; ours never follows links.
    allow_symlinks = ser.get("allow_symlinks", False)
    if allow_symlinks is not False:
        raise ManifestError("the signature was made with allow_symlinks = true (symlinks followed), and "
                            "model-factory never follows symlinks. Fix: replace the links by the files and re-sign")
    shard_size = None
    if method == "shards":
        shard_size = _int(ser.get("shard_size"))
        if shard_size is None or shard_size < MIN_SHARD_SIZE:
            raise ManifestError(f"shard size {ser.get('shard_size')!r} is not a whole number >= {MIN_SHARD_SIZE}")
    ignore = ser.get("ignore_paths", [])
    if not isinstance(ignore, list) or not all(isinstance(p, str) and p for p in ignore):
        raise ManifestError("serialization.ignore_paths is not a list of paths")
    ignore = tuple(ignore)

    # model_signing names a shard digest after the shard size ("sha256-sharded-1000000000").
    algorithms = ("sha256",) if method == "files" else ("sha256", f"sha256-sharded-{shard_size}")
    resources = predicate.get("resources")
    if not isinstance(resources, list):
        raise ManifestError("the predicate has no resources list")
    if not resources:
        raise ManifestError("the signature lists no file (OMS v1.0 §6.1 rejects an empty model)")
    items: list[tuple[str, str]] = []
    seen: set[str] = set()
    extensions: list[Any] = []
    for res in resources:
        if not isinstance(res, dict):
            raise ManifestError("a resource is not an object")
        rname, alg, dig = res.get("name"), res.get("algorithm"), res.get("digest")
        if alg not in algorithms or not isinstance(dig, str) or not _HEX64.match(dig):
            raise ManifestError(f"resource {rname!r} has no sha256 digest")
        path = rname
        if method == "shards" and isinstance(rname, str):
            try:
                path, start, end = split_shard(rname)
            except ValueError:
                raise ManifestError(f"shard resource {rname!r} is not named path:start:end") from None
            if not 0 <= start <= end:
                raise ManifestError(f"shard resource {rname!r} has a bad byte range")
        problem = check_relpath(path)
        if problem:
            raise ManifestError(problem)
        if rname in seen:
            raise ManifestError(f"resource {rname!r} is listed twice")
        seen.add(rname)
        items.append((rname, dig))
        notes = res.get("annotations")
        if isinstance(notes, dict) and EXTENSION_KEY in notes:
            extensions.append(notes[EXTENSION_KEY])
    expected_root = digest["sha256"]
    got_root = root_digest(d for _, d in items)
    if got_root != expected_root:
        raise ManifestError(f"the subject digest {expected_root[:16]}... does not match the resources "
                            f"({got_root[:16]}...): the statement is inconsistent")

    if EXTENSION_KEY in predicate:
        extensions.append(predicate[EXTENSION_KEY])  # written by model-factory 0.1
    if len(extensions) > 1:
        raise ManifestError(f"the statement carries {len(extensions)} model-factory annotations; one is expected")
    version, empty = _extension(extensions[0]) if extensions else (None, ())
    return Manifest(name, tuple(items), method, shard_size, empty, version, ignore)


def _extension(ext: Any) -> tuple[int | None, tuple[str, ...]]:
    """The signed version and empty folders of a model-factory annotation."""
    if not isinstance(ext, dict) or _int(ext.get("format")) not in (EXTENSION_FORMAT, _LEGACY_FORMAT):
        raise ManifestError(f"the {EXTENSION_KEY!r} annotation has an unknown format. "
                            "Fix: verify with the model-factory release that signed it, or re-sign")
    raw_empty = ext.get("empty_directories", [])
    if not isinstance(raw_empty, list):
        raise ManifestError("empty_directories is not a list")
    for d in raw_empty:
        problem = check_relpath(d)
        if problem:
            raise ManifestError(problem)
    version = None
    if ext.get("version") is not None:
        version = _int(ext.get("version"))
        if version is None:
            raise ManifestError(f"the signed version {ext.get('version')!r} is not a number")
    return version, tuple(raw_empty)


def _chosen_ignores(ignore_paths: Iterable[str]) -> list[str]:
    """The ignore paths a signer chose, beyond the rule's own (other versions, signature files, defaults)."""
    from model_factory.signing import layout

    return [p for p in ignore_paths if p not in layout.DEFAULT_EXCLUSIONS and not layout.is_version_name(p)
            and not layout.is_signature_name(p)]


def describe_differences(signed: Manifest, actual: Mapping[str, tuple], actual_empty: Iterable[str],
                         explained: Iterable[str] = ()) -> list[str]:
    """Human reasons for every difference between the signed manifest and what is on disk.

    ``actual`` maps each file path to the same fingerprint as :meth:`Manifest.files`.
    A file missing under one name and present under another with the same
    content is reported once, as a rename. Signed paths in ``explained`` (a
    symlink, an unreadable file: already reported) are not reported as missing.
    """
    expected = signed.files()
    reasons: list[str] = []
    missing = sorted(set(expected) - set(actual) - set(explained), key=_sort_key)
    extra = sorted(set(actual) - set(expected), key=_sort_key)
    by_content: dict[tuple, list[str]] = {}
    for path in extra:
        by_content.setdefault(actual[path], []).append(path)
    renamed_to: dict[str, str] = {}
    for path in missing:
        candidates = by_content.get(expected[path])
        if candidates:
            renamed_to[path] = candidates.pop(0)
    for path in missing:
        if path in renamed_to:
            reasons.append(f"file {path} was renamed to {renamed_to[path]} (same content, path not signed)")
        else:
            reasons.append(f"file {path} is signed but missing")
    moved = set(renamed_to.values())
    for path in extra:
        if path in moved:
            continue
        if signed.method == "shards" and actual[path] == ():
            reasons.append(f"empty file {path} is not covered by the signature (per-shard signatures cannot cover "
                           "empty files). Fix: re-sign with model-factory sign (per-file)")
        elif any(path == p or path.startswith(p.rstrip("/") + "/") for p in _chosen_ignores(signed.ignore_paths)):
            # OMS lets a signer leave paths out (ignore_paths); model-factory signs every file Triton can
            # load, so a left-out file in the unit is refused, never trusted unseen.
            reasons.append(f"file {path} is left out of the signature by its ignore_paths, but Triton can load it; "
                           "model-factory does not trust unsigned files of a model version. Fix: re-sign without "
                           "ignoring it (model-factory sign)")
        else:
            reasons.append(f"file {path} is not covered by the signature (added after signing)")
    for path in sorted(set(expected) & set(actual), key=_sort_key):
        if expected[path] != actual[path]:
            if signed.method == "files":
                reasons.append(f"file {path} changed: sha256 {actual[path][0][:16]}... on disk, "
                               f"{expected[path][0][:16]}... signed")
            else:
                reasons.append(f"file {path} changed: its shard digests differ from the signed ones")
    actual_empty = set(actual_empty)
    for d in sorted(set(signed.empty_dirs) - actual_empty):
        reasons.append(f"empty folder {d} is signed but missing (or no longer empty)")
    for d in sorted(actual_empty - set(signed.empty_dirs)):
        reasons.append(f"empty folder {d} is not covered by the signature")
    return reasons
