"""Offline signing and verification of Triton model repositories.

One signature per model version, in the OpenSSF Model Signing (OMS) v1.0
format to the letter (Sigstore bundle v0.3 JSON, DSSE envelope, in-toto
statement with per-file sha256; key and certificate methods), so
``model_signing`` verifies what we sign and we verify what it signs. No
transparency log and no network: trust comes from a local policy file (public
keys and/or in-house CA roots, CRLs, allowed identities).

Layers, from the bottom up:

* ``digests``      parallel sha256 of files and byte ranges (stdlib only)
* ``layout``       what one version's signature covers, and where it lives
* ``manifest``     the signed file list as an in-toto statement, and its diff
* ``keys``         ECDSA P-256/P-384/P-521 keys, keygen, CSRs
* ``bundle``       Sigstore bundle / DSSE envelope, sign and parse
* ``certificates`` X.509 chain at verification time, CRLs, identities
* ``policy``       the trust policy TOML, as frozen dataclasses
* ``provenance``   the signed SLSA build provenance (inputs, outputs' digests)
* ``sign`` / ``verify``  the operations
* ``release`` / ``release_check``  signed releases on TUF (python-tuf): publish; refuse rollback,
  freeze, mix-and-match, too few signatures, a bad root rotation

The load-time check (the bytes the backend loads are the bytes verified) is the backend's own
``integrity`` module (``backends/python_backend/integrity.py``), fed by ``serve`` with
:func:`signed_digests` from a full verification.

The whole package needs only the standard library and ``cryptography`` (releases: also ``tuf``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Re-exports are resolved on first use, so that importing one module of the package loads only
# what that module needs, not this whole package.
_EXPORTS = {
    "BuildProvenance": "provenance",
    "KeyPaths": "keys",
    "SignerConfig": "sign",
    "TrustPolicy": "policy",
    "VerificationResult": "verify",
    "check_release": "release_check",
    "generate_keypair": "keys",
    "load_policy": "policy",
    "parse_policy": "policy",
    "provenance_path": "layout",
    "sign_model_version": "sign",
    "sign_repository": "sign",
    "signature_path": "layout",
    "signed_digests": "verify",
    "verify_model_version": "verify",
    "verify_repository": "verify",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs; noqa: F401 below
    from model_factory.signing.keys import KeyPaths, generate_keypair
    from model_factory.signing.layout import provenance_path, signature_path
    from model_factory.signing.policy import TrustPolicy, load_policy, parse_policy
    from model_factory.signing.provenance import BuildProvenance
    from model_factory.signing.release_check import check_release
    from model_factory.signing.sign import SignerConfig, sign_model_version, sign_repository
    from model_factory.signing.verify import (VerificationResult, signed_digests, verify_model_version,
                                              verify_repository)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
