"""Sign model versions of a Triton repository, offline.

One signature per model version, covering the unit defined in
:mod:`model_factory.signing.layout` (``config.pbtxt``, the version folder with
the backend code, every other file in the model folder; not the other
versions). It is written to ``<repo>/<model>/<version>.sig`` as a model_signing
v1.0 compatible bundle, and the optional build provenance to
``<repo>/<model>/<version>.provenance.sig``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from model_factory.errors import FactoryError
from model_factory.signing import layout
from model_factory.signing.bundle import sign_statement
from model_factory.signing.certificates import leaf_problems, load_certificates, name_of
from model_factory.signing.digests import file_tasks, hash_tasks
from model_factory.signing.keys import load_private_key
from model_factory.signing.manifest import build_manifest
from model_factory.signing.provenance import BuildProvenance, provenance_statement, reproducible


@dataclass(frozen=True)
class SignerConfig:
    """The signing key, its password, and (certificate mode) the chain: leaf first.

    Without ``certificate_chain`` the bundle names the key by model_signing's
    key hint and verifiers need the public key; with it, the bundle carries the
    chain and verifiers need the CA root.
    """

    private_key: Path
    password: bytes | None = None
    certificate_chain: tuple[Path, ...] = ()


@dataclass(frozen=True)
class _LoadedSigner:
    key: ec.EllipticCurvePrivateKey
    chain: tuple[x509.Certificate, ...]


def _load_signer(signer: SignerConfig) -> _LoadedSigner:
    key = load_private_key(Path(signer.private_key), signer.password)
    chain: list[x509.Certificate] = []
    for p in signer.certificate_chain:
        chain.extend(load_certificates(Path(p)))
    if chain:
        leaf = chain[0]
        if leaf.public_key() != key.public_key():
            raise FactoryError(f"the first certificate ({name_of(leaf)}) is not for this private key. "
                               "Fix: list the leaf certificate of this key first, then its intermediates")
        problems = leaf_problems(leaf)
        now = dt.datetime.now(dt.timezone.utc)
        if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
            problems.append(f"it is valid only from {leaf.not_valid_before_utc:%Y-%m-%d} to "
                            f"{leaf.not_valid_after_utc:%Y-%m-%d}")
        if problems:
            raise FactoryError(f"cannot sign with certificate {name_of(leaf)}: {'; '.join(problems)}. "
                               "Fix: ask the CA for a current code-signing certificate")
    return _LoadedSigner(key, tuple(chain))


def _write_atomic(path: Path, text: str) -> None:
    """Write a sibling temporary file, then rename: a reader never sees half a bundle."""
    # The temporary file sits one level up (the repository's top, where plain files are not models and
    # are ignored): one left by a killed signer never lands inside the signed model folder.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.parent.name}.{path.name}.", suffix=".tmp", dir=path.parent.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sign_loaded(model_dir: Path, version: int, signer: _LoadedSigner,
                 provenance: BuildProvenance | None) -> Path:
    from model_factory.locking import exclusive

    model_dir = Path(model_dir)
    # One writer per model: a package or another signing of it at the same time is refused.
    with exclusive(model_dir, f"packaging or signing of {model_dir.name}"):
        return _sign_locked(model_dir, version, signer, provenance)


def _sign_locked(model_dir: Path, version: int, signer: _LoadedSigner,
                 provenance: BuildProvenance | None) -> Path:
    version_dir = model_dir / str(version)
    if version_dir.is_symlink() or not version_dir.is_dir():
        raise FactoryError(f"{version_dir} is not a version folder. Fix: sign an existing version of "
                           f"{model_dir.name} (package the model first)")
    scan = layout.scan_unit(model_dir, version)
    if scan.problems:
        raise FactoryError(f"cannot sign {model_dir.name} version {version}: {'; '.join(scan.problems)}. "
                           "Fix: replace links by the files themselves and remove special files")
    if not scan.files:
        # OMS v1.0 6.1: a model with no regular file (after the exclusions) must not be signed.
        raise FactoryError(f"cannot sign {model_dir.name} version {version}: it holds no file. Fix: package the "
                           "model first (model-factory package)")
    try:
        digests = hash_tasks(file_tasks(model_dir, scan.files))
    except OSError as exc:
        raise FactoryError(f"cannot read {exc.filename or 'a file'} to sign it: {exc.strerror or exc}. "
                           "Fix: make every file of the model readable, and do not change it while signing") from exc
    manifest = build_manifest(model_dir.name, digests, version, scan.empty_dirs,
                              layout.other_version_ignores(model_dir, version))
    bundle = sign_statement(manifest.to_statement(), signer.key, signer.chain)
    sig_path = layout.signature_path(model_dir, version)
    prov_path = layout.provenance_path(model_dir, version)
    if provenance is not None:
        # The provenance lists every output's digest (the signed unit's files), and which of them a
        # rebuild cannot reproduce byte for byte.
        provenance = dataclasses.replace(provenance, outputs=dict(digests),
                                         not_reproducible=tuple(sorted(p for p in digests if not reproducible(p))))
        prov_bundle = sign_statement(provenance_statement(model_dir.name, manifest.root_digest, provenance),
                                     signer.key, signer.chain)
        _write_atomic(prov_path, prov_bundle.to_json())
    elif prov_path.is_file() and not prov_path.is_symlink():
        # A provenance left from an earlier signing describes another build: it would fail
        # verification, so it goes with the signature it belonged to.
        prov_path.unlink()
    _write_atomic(sig_path, bundle.to_json())
    return sig_path


def _provenance(provenance: Mapping[str, Any] | None) -> BuildProvenance | None:
    return None if provenance is None else BuildProvenance.from_mapping(provenance)


def sign_model_version(model_dir: Path, version: int, signer: SignerConfig,
                       provenance: dict | None = None) -> Path:
    """Sign one model version; returns the bundle path ``<model_dir>/<version>.sig``.

    ``provenance`` (see :class:`BuildProvenance`) adds a signed provenance
    statement at ``<model_dir>/<version>.provenance.sig``.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise FactoryError(f"version {version!r} is not a model version number. Fix: pass an integer like 1")
    return _sign_loaded(Path(model_dir), version, _load_signer(signer), _provenance(provenance))


def sign_repository(repo: Path, signer: SignerConfig, provenance: dict | None = None) -> list[Path]:
    """Sign every version of every model in a Triton repository; returns the bundle paths."""
    repo = Path(repo)
    if not repo.is_dir():
        raise FactoryError(f"model repository {repo} does not exist. Fix: pass the folder that holds the models")
    loaded = _load_signer(signer)
    build = _provenance(provenance)
    paths = []
    # Hidden folders (a build's staging, .git) are not models.
    models = sorted(p for p in repo.iterdir() if (p.is_dir() or p.is_symlink()) and not p.name.startswith("."))
    for model_dir in models:
        if model_dir.is_symlink():
            raise FactoryError(f"model folder {model_dir} is a symlink. Fix: move the model into the repository")
        versions = layout.model_entries(model_dir).versions
        if not versions:
            raise FactoryError(f"model {model_dir.name} has no version folder. Fix: package it, or remove "
                               "the folder from the repository")
        for version in versions:
            paths.append(_sign_loaded(model_dir, version, loaded, build))
    if not paths:
        raise FactoryError(f"model repository {repo} holds no models. Fix: package a model into it first")
    return paths
