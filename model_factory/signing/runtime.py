"""Load-time integrity check for the Python backend: standard library only.

This module imports nothing from model-factory and nothing outside the
standard library at import time, so the backend can call it inside Triton's
stub, or carry a copy of this one file. ``cryptography`` is imported only when
a public key is given to check the bundle's signature.

Typical use in ``initialize()``::

    digests = load_signed_digests(model_dir, version, public_key_pem=pinned)  # or signed_digests(...)
    plan = read_verified(model_dir, f"{version}/model.plan", digests)          # the bytes that were checked
    engine = runtime.deserialize_cuda_engine(plan)

Reading the bytes once and hashing those same bytes leaves no window between
the check and the use. The full trust decision (CA chain, CRL, identities,
provenance) is :func:`model_factory.signing.verify.signed_digests` with a
policy, or ``model-factory verify`` before the server starts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

try:  # inside model-factory, one user-facing error type; in a standalone copy, a plain exception
    from model_factory.errors import FactoryError as _Base
except ImportError:  # pragma: no cover - exercised only in a copied module
    _Base = Exception  # type: ignore[misc,assignment]

_IN_TOTO = "application/vnd.in-toto+json"


class IntegrityError(_Base):  # type: ignore[valid-type,misc]
    """Bytes that do not match the signed digest, or a signature file that cannot be used."""


def _pae(payload_type: str, payload: bytes) -> bytes:
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def _check_signature(envelope: dict, payload: bytes, public_key_pem: bytes, where: str) -> None:
    from cryptography import exceptions
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = serialization.load_pem_public_key(public_key_pem)
    # The curve decides the hash, as in model_signing and keys.signature_hash.
    by_size = {256: hashes.SHA256, 384: hashes.SHA384, 521: hashes.SHA512}
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.key_size not in by_size:
        raise IntegrityError(f"{where}: the pinned public key is not a P-256/P-384/P-521 ECDSA key")
    algorithm = by_size[key.curve.key_size]()
    try:
        sig = base64.b64decode(envelope["signatures"][0]["sig"], validate=True)
        key.verify(sig, _pae(envelope["payloadType"], payload), ec.ECDSA(algorithm))
    except (exceptions.InvalidSignature, KeyError, IndexError, TypeError, ValueError):
        raise IntegrityError(f"{where}: the signature does not verify with the pinned public key") from None


def load_signed_digests(model_dir: str | os.PathLike, version: int,
                        public_key_pem: bytes | None = None) -> dict[str, str]:
    """The ``relpath -> sha256`` map in ``<model_dir>/<version>.sig``.

    Checks that the statement is consistent (its subject digest covers exactly
    the listed digests) and, with ``public_key_pem``, that the DSSE signature
    verifies with that key (the raw signing key, or the leaf certificate's key).
    """
    model_dir = Path(model_dir)
    path = model_dir / f"{int(version)}.sig"
    where = f"signature {path}"
    if path.is_symlink() or not path.is_file():
        raise IntegrityError(f"{where} is missing or not a regular file. Fix: sign the model version")
    try:
        envelope = json.loads(path.read_bytes())["dsseEnvelope"]
        payload = base64.b64decode(envelope["payload"], validate=True)
        if envelope["payloadType"] != _IN_TOTO:
            raise ValueError("not an in-toto payload")
        statement = json.loads(payload)
        resources = statement["predicate"]["resources"]
        method = statement["predicate"]["serialization"]["method"]
        subject = statement["subject"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise IntegrityError(f"{where} is not a model signature bundle ({exc})") from None
    if public_key_pem is not None:
        _check_signature(envelope, payload, public_key_pem, where)
    if method != "files":
        raise IntegrityError(f"{where} holds per-shard digests, not per-file ones. Fix: re-sign with model-factory")
    if subject.get("name") != model_dir.name:
        raise IntegrityError(f"{where} is for model {subject.get('name')!r}, not {model_dir.name!r}")
    root = hashlib.sha256()
    digests: dict[str, str] = {}
    for res in resources:
        name, digest = res.get("name"), res.get("digest")
        if res.get("algorithm") != "sha256" or not isinstance(name, str) or not isinstance(digest, str):
            raise IntegrityError(f"{where} lists a resource without a sha256 digest")
        root.update(bytes.fromhex(digest))
        digests[name] = digest
    if root.hexdigest() != subject.get("digest", {}).get("sha256"):
        raise IntegrityError(f"{where} is inconsistent: its subject digest does not cover its file list")
    return digests


def check_bytes(relpath: str, data: bytes | memoryview, digests: dict[str, str]) -> None:
    """Raise IntegrityError unless ``data`` is the signed content of ``relpath``."""
    expected = digests.get(relpath)
    if expected is None:
        raise IntegrityError(f"{relpath} is not covered by the model signature. Fix: re-sign the model version")
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise IntegrityError(f"{relpath} does not match its signature (sha256 {actual[:16]}..., signed "
                             f"{expected[:16]}...): the file changed after verification")


def read_verified(model_dir: str | os.PathLike, relpath: str, digests: dict[str, str]) -> bytes:
    """Read ``model_dir/relpath`` once, check those bytes against the signed digest, return them."""
    path = Path(model_dir) / relpath
    if path.is_symlink():
        raise IntegrityError(f"{relpath} is a symlink; signed files are never links")
    data = path.read_bytes()
    check_bytes(relpath, data, digests)
    return data


def check_file(model_dir: str | os.PathLike, relpath: str, digests: dict[str, str]) -> None:
    """Hash ``model_dir/relpath`` in place (streaming) and check it against the signed digest."""
    path = Path(model_dir) / relpath
    if path.is_symlink():
        raise IntegrityError(f"{relpath} is a symlink; signed files are never links")
    expected = digests.get(relpath)
    if expected is None:
        raise IntegrityError(f"{relpath} is not covered by the model signature. Fix: re-sign the model version")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    actual = h.hexdigest()
    if actual != expected:
        raise IntegrityError(f"{relpath} does not match its signature (sha256 {actual[:16]}..., signed "
                             f"{expected[:16]}...): the file changed after verification")
