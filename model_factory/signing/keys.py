"""ECDSA keys: generation for an air-gapped set-up, loading, CSRs and key hints.

Only NIST P-256 and P-384 are used: they are what model_signing, Sigstore's
bundle format and the X.509 verifier of ``cryptography`` all accept. The hash
follows the curve (P-256 with SHA-256, P-384 with SHA-384, P-521 with SHA-512), as model_signing
does, so signatures verify in both tools.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from model_factory.errors import FactoryError

# The key types OMS v1.0's algorithm registry requires for the key and certificate methods.
CURVES: dict[str, type[ec.EllipticCurve]] = {"P-256": ec.SECP256R1, "P-384": ec.SECP384R1, "P-521": ec.SECP521R1}
_CURVE_NAMES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
_HASHES = {"P-256": hashes.SHA256, "P-384": hashes.SHA384, "P-521": hashes.SHA512}
PRIVATE_KEY_FILE = "signing-key.pem"
PUBLIC_KEY_FILE = "signing-key.pub"
CSR_FILE = "signing-key.csr"


@dataclass(frozen=True)
class KeyPaths:
    """The files written by :func:`generate_keypair` (``csr`` only when a subject was given)."""

    private_key: Path
    public_key: Path
    csr: Path | None = None


def curve_name(key: ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey) -> str:
    """``"P-256"``, ``"P-384"`` or ``"P-521"``; a FactoryError for any other curve."""
    name = _CURVE_NAMES.get(key.curve.name)
    if name is None:
        raise FactoryError(f"the key uses curve {key.curve.name}, which is not supported. "
                           f"Fix: use an ECDSA key on {' or '.join(CURVES)} (model-factory keygen)")
    return name


def signature_hash(key: ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey) -> hashes.HashAlgorithm:
    """The hash paired with the curve, as in model_signing (P-256: SHA-256, P-384: SHA-384, P-521: SHA-512)."""
    return _HASHES[curve_name(key)]()


def key_hint(public_key: ec.EllipticCurvePublicKey) -> str:
    """model_signing's key identifier: sha256 hex of the PEM SubjectPublicKeyInfo."""
    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def load_private_key(path: Path, password: bytes | None = None) -> ec.EllipticCurvePrivateKey:
    """Read a PEM private key (PKCS#8 or SEC1, optionally encrypted) on P-256/P-384/P-521."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FactoryError(f"cannot read the private key {path}: {exc.strerror or exc}. "
                           "Fix: pass the key written by model-factory keygen") from exc
    try:
        key = serialization.load_pem_private_key(data, password)
    except TypeError as exc:
        hint = "pass its password" if password is None else "this key is not encrypted: pass no password"
        raise FactoryError(f"cannot load the private key {path}: {exc}. Fix: {hint}") from exc
    except ValueError as exc:
        raise FactoryError(f"cannot load the private key {path}: wrong password or not a PEM private key. "
                           "Fix: check the password and the file") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise FactoryError(f"the private key {path} is not an ECDSA key. "
                           "Fix: create one with model-factory keygen (P-256 or P-384)")
    curve_name(key)
    return key


def load_public_key(path: Path) -> ec.EllipticCurvePublicKey:
    """Read a PEM public key (SubjectPublicKeyInfo) on P-256/P-384/P-521."""
    path = Path(path)
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except OSError as exc:
        raise FactoryError(f"cannot read the public key {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise FactoryError(f"{path} is not a PEM public key. Fix: use the .pub file written by "
                           "model-factory keygen") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise FactoryError(f"the public key {path} is not an ECDSA key. Fix: use a P-256 or P-384 key")
    curve_name(key)
    return key


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the first byte on (O_EXCL: never overwrite a key)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        # The umask may have removed bits from ``mode``; it can never add any, but set it exactly.
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)


def parse_subject(subject: str) -> x509.Name:
    """An RFC 4514 subject such as ``"CN=model-factory CI,O=Example Corp"``."""
    try:
        name = x509.Name.from_rfc4514_string(subject)
    except ValueError as exc:
        raise FactoryError(f"the subject {subject!r} is not an RFC 4514 name ({exc}). "
                           "Fix: write it as \"CN=model-factory CI,O=Example Corp\"") from exc
    if not list(name):
        raise FactoryError(f"the subject {subject!r} is empty. Fix: give at least CN=...")
    return name


def generate_keypair(out_dir: Path, curve: str = "P-256", password: bytes | None = None,
                     csr_subject: str | None = None) -> KeyPaths:
    """Create an ECDSA key pair in ``out_dir``, and a CSR for the in-house CA when asked.

    The private key is PKCS#8 PEM, encrypted when ``password`` is given, and
    created with mode 0600. Existing files are never overwritten. The CSR asks
    for a code-signing certificate (key usage digitalSignature, extended key
    usage codeSigning); the CA decides what it signs.
    """
    if curve not in CURVES:
        raise FactoryError(f"curve {curve!r} is not supported. Fix: use one of {', '.join(CURVES)}")
    if password is not None and not password:
        raise FactoryError("the password is empty. Fix: give a non-empty password or none")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = KeyPaths(out_dir / PRIVATE_KEY_FILE, out_dir / PUBLIC_KEY_FILE,
                     out_dir / CSR_FILE if csr_subject else None)
    for p in (paths.private_key, paths.public_key, paths.csr):
        if p is not None and (p.exists() or p.is_symlink()):
            raise FactoryError(f"{p} already exists. Fix: choose another folder or move the old key away "
                               "(keys are never overwritten)")
    name = parse_subject(csr_subject) if csr_subject else None

    key = ec.generate_private_key(CURVES[curve]())
    encryption = (serialization.BestAvailableEncryption(password) if password
                  else serialization.NoEncryption())
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    _write_new(paths.private_key, private_pem, 0o600)
    _write_new(paths.public_key, public_pem, 0o644)
    if name is not None and paths.csr is not None:
        csr = (x509.CertificateSigningRequestBuilder()
               .subject_name(name)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            key_cert_sign=False, crl_sign=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
               .sign(key, signature_hash(key)))
        _write_new(paths.csr, csr.public_bytes(serialization.Encoding.PEM), 0o644)
    return paths
