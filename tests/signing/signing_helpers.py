"""Helpers shared by the signing tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NOW = dt.datetime.now(dt.timezone.utc)
DAY = dt.timedelta(days=1)


def write_key(key: ec.EllipticCurvePrivateKey, path: Path, password: bytes | None = None) -> Path:
    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc))
    return path


def write_pub(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def name(cn: str, org: str = "Example Corp") -> x509.Name:
    # Conventional order (O before CN), so that the RFC 4514 string reads "CN=...,O=...".
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, org), x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_cert(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
              issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool, not_before: dt.datetime = NOW - DAY,
              not_after: dt.datetime = NOW + 30 * DAY, email: str | None = None,
              eku: tuple = (ExtendedKeyUsageOID.CODE_SIGNING,)) -> x509.Certificate:
    b = (x509.CertificateBuilder()
         .subject_name(subject)
         .issuer_name(issuer.subject if issuer else subject)
         .public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(not_before)
         .not_valid_after(not_after)
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                        critical=False))
    usage = dict(digital_signature=not ca, content_commitment=False, key_encipherment=False,
                 data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                 encipher_only=False, decipher_only=False)
    b = b.add_extension(x509.KeyUsage(**usage), critical=True)
    if not ca and eku:
        b = b.add_extension(x509.ExtendedKeyUsage(list(eku)), critical=False)
    if email:
        b = b.add_extension(x509.SubjectAlternativeName([x509.RFC822Name(email)]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_crl(issuer: x509.Certificate, issuer_key: ec.EllipticCurvePrivateKey, revoked: list[x509.Certificate],
             next_update: dt.datetime = NOW + 7 * DAY) -> x509.CertificateRevocationList:
    b = (x509.CertificateRevocationListBuilder().issuer_name(issuer.subject)
         .last_update(NOW - DAY).next_update(next_update))
    for cert in revoked:
        b = b.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(cert.serial_number)
                                      .revocation_date(NOW - DAY).build())
    return b.sign(issuer_key, hashes.SHA256())


def write_crl(crl: x509.CertificateRevocationList, path: Path) -> Path:
    path.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    return path


@dataclass
class Leaf:
    """A signing certificate with its key files: ``chain`` is leaf then intermediate."""

    key: Path
    cert: Path
    chain: tuple[Path, ...]
    certificate: x509.Certificate


@dataclass
class Pki:
    root: Path
    intermediate: Path
    good: Leaf
    expired: Leaf
    not_yet_valid: Leaf
    revoked: Leaf
    server_only: Leaf  # EKU serverAuth only: not for code signing
    other_ca_root: Path
    other_ca_leaf: Leaf
    root_crl: Path
    intermediate_crl: Path
    stale_intermediate_crl: Path
    folder: Path


GOOD_SUBJECT = "CN=model-factory release,O=Example Corp"
GOOD_EMAIL = "ml-release@example.com"


def build_model(model_dir: Path, versions: tuple[int, ...] = (1,), extra: dict[str, bytes] | None = None) -> Path:
    """A fake Triton model folder: config.pbtxt and, per version, model.py, an ONNX blob, a backend package."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(f'name: "{model_dir.name}"\nbackend: "python"\nmax_batch_size: 8\n')
    for v in versions:
        vd = model_dir / str(v)
        (vd / "mf_backend").mkdir(parents=True)
        (vd / "model.py").write_text(f"# Triton entry point, version {v}\nfrom mf_backend.model import *\n")
        (vd / "model.onnx").write_bytes(bytes(range(256)) * 64 + str(v).encode())
        (vd / "mf_backend" / "__init__.py").write_text("")
        (vd / "mf_backend" / "model.py").write_text("class TritonPythonModel:\n    pass\n")
        (vd / "metadata.json").write_text(f'{{"version": {v}}}')
    for rel, data in (extra or {}).items():
        p = model_dir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return model_dir


def write_policy(path: Path, body: str) -> Path:
    path.write_text(body)
    return path
