"""Fixtures for the signing tests: keys, an in-house PKI, fake Triton repositories, policies.

Everything is built under tmp_path with ``cryptography``; no real model is needed.
The PKI is made once per session (certificate building is cheap, but many tests use it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

# The helpers module sits beside this file; make it importable under any pytest import mode.
sys.path.insert(0, str(Path(__file__).parent))
from signing_helpers import (DAY, GOOD_EMAIL, GOOD_SUBJECT, NOW, Leaf, Pki, build_model, make_cert, make_crl, name,
                             write_cert, write_crl, write_key, write_policy, write_pub)  # noqa: E402


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    root_key = ec.generate_private_key(ec.SECP384R1())
    root = make_cert(name("Example Root CA"), root_key, None, root_key, ca=True, not_before=NOW - 365 * DAY,
                     not_after=NOW + 3650 * DAY)
    int_key = ec.generate_private_key(ec.SECP256R1())
    inter = make_cert(name("Example Signing CA"), int_key, root, root_key, ca=True, not_before=NOW - 365 * DAY,
                      not_after=NOW + 365 * DAY)
    inter_path = write_cert(inter, d / "intermediate.pem")

    def leaf(label: str, **kw) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = kw.pop("subject", name("model-factory release"))
        cert = make_cert(subject, key, inter, int_key, ca=False, email=kw.pop("email", GOOD_EMAIL), **kw)
        cert_path = write_cert(cert, d / f"{label}.pem")
        return Leaf(write_key(key, d / f"{label}.key"), cert_path, (cert_path, inter_path), cert)

    good = leaf("good")
    expired = leaf("expired", not_before=NOW - 30 * DAY, not_after=NOW - DAY)
    not_yet = leaf("not-yet-valid", not_before=NOW + DAY, not_after=NOW + 30 * DAY)
    revoked = leaf("revoked")
    server_only = leaf("server-only", eku=(ExtendedKeyUsageOID.SERVER_AUTH,))

    other_root_key = ec.generate_private_key(ec.SECP256R1())
    other_root = make_cert(name("Other Root CA"), other_root_key, None, other_root_key, ca=True)
    # Same subject names as ours: only the key material differs.
    other_int_key = ec.generate_private_key(ec.SECP256R1())
    other_inter = make_cert(name("Example Signing CA"), other_int_key, other_root, other_root_key, ca=True)
    other_inter_path = write_cert(other_inter, d / "other-intermediate.pem")
    other_key = ec.generate_private_key(ec.SECP256R1())
    other_cert = make_cert(name("model-factory release"), other_key, other_inter, other_int_key, ca=False,
                           email=GOOD_EMAIL)
    other_cert_path = write_cert(other_cert, d / "other-leaf.pem")
    other_leaf = Leaf(write_key(other_key, d / "other-leaf.key"), other_cert_path,
                      (other_cert_path, other_inter_path), other_cert)

    return Pki(
        root=write_cert(root, d / "root.pem"),
        intermediate=inter_path,
        good=good, expired=expired, not_yet_valid=not_yet, revoked=revoked, server_only=server_only,
        other_ca_root=write_cert(other_root, d / "other-root.pem"),
        other_ca_leaf=other_leaf,
        root_crl=write_crl(make_crl(root, root_key, []), d / "root.crl"),
        intermediate_crl=write_crl(make_crl(inter, int_key, [revoked.certificate]), d / "intermediate.crl"),
        stale_intermediate_crl=write_crl(make_crl(inter, int_key, [], next_update=NOW - DAY),
                                         d / "stale-intermediate.crl"),
        folder=d,
    )


@dataclass
class KeyFiles:
    private: Path
    public: Path


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> dict[str, KeyFiles]:
    """Raw key pairs: ``trusted`` (P-256), ``trusted384`` (P-384) and ``other`` (not in any policy)."""
    d = tmp_path_factory.mktemp("keys")
    out = {}
    for label, curve in (("trusted", ec.SECP256R1()), ("trusted384", ec.SECP384R1()), ("other", ec.SECP256R1())):
        k = ec.generate_private_key(curve)
        out[label] = KeyFiles(write_key(k, d / f"{label}.pem"), write_pub(k, d / f"{label}.pub"))
    return out


@pytest.fixture
def repo(tmp_path) -> Path:
    """A repository with model ``encoder`` (versions 1 and 2) and model ``ranker`` (version 3)."""
    r = tmp_path / "model_repository"
    build_model(r / "encoder", (1, 2))
    build_model(r / "ranker", (3,))
    (r / "README.md").write_text("Triton ignores plain files at the top of the repository.\n")
    return r


@pytest.fixture
def key_policy(tmp_path, keys) -> Callable[..., Path]:
    """Write a policy trusting the ``trusted`` key; extra TOML can be appended."""

    def make(extra: str = "", key: str = "trusted") -> Path:
        return write_policy(tmp_path / "policy-keys.toml",
                            f'version = 1\n[[keys]]\nname = "release"\npath = "{keys[key].public}"\n{extra}')

    return make


@pytest.fixture
def ca_policy(tmp_path, pki) -> Callable[..., Path]:
    """Write a policy trusting the in-house root for the release identity, with CRLs."""

    def make(identity: str = f'subjects = ["{GOOD_SUBJECT}"]', crls: tuple[Path, ...] | None = None,
             extra: str = "") -> Path:
        crl_list = (pki.root_crl, pki.intermediate_crl) if crls is None else crls
        crl_toml = ", ".join(f'"{p}"' for p in crl_list)
        return write_policy(tmp_path / "policy-ca.toml",
                            f'[certificates]\nroots = ["{pki.root}"]\ncrls = [{crl_toml}]\n{identity}\n{extra}')

    return make
