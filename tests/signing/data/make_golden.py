"""Write the golden signatures of this release (run once per format change, then commit the output).

    PYTHONPATH=. .venv/bin/python tests/signing/data/make_golden.py tests/signing/data/golden-<format>

golden-0.1.0: release 0.1.0 (a "model_factory" predicate member); golden-oms-1.0: OMS v1.0 to the
letter (the annotation on the first resource, provenance with output digests).

The private keys are thrown away: only public material and the signed files stay, and
tests/signing/test_golden.py checks that every kept release still verifies, with
model-factory and with model_signing. The CA is valid for 100 years so that the
certificate-mode golden does not expire under the tests.
"""

from __future__ import annotations

import datetime as dt
import sys
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from model_factory.signing import SignerConfig, sign_model_version

FACTS = {
    "source_model_digest": "0" * 63 + "1",
    "calibration_data_digest": "0" * 63 + "2",
    "recipe": {"model": {"name": "golden", "version": 1}},
    "tool_versions": {"model-factory": "0.1.0"},
    "precisions": ["fp32", "int8"],
    "accuracy_report": {"int8": {"cosine_mean": 0.99}},
    "builder_id": "urn:model-factory:builder:golden",
}


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Golden Corp"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, key, issuer, issuer_key, ca: bool) -> x509.Certificate:
    now = dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now)
         .not_valid_after(now + dt.timedelta(days=36500))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(digital_signature=not ca, content_commitment=False, key_encipherment=False,
                                      data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                                      encipher_only=False, decipher_only=False), critical=True))
    if not ca:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pem(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def main(out: Path) -> None:
    model = out / "repo" / "golden"
    for v in (1, 2):
        _pem(model / str(v) / "model.py", f"# golden model, version {v}\n".encode())
        _pem(model / str(v) / "weights.bin", bytes(range(256)) * 16 + bytes([v]))
        _pem(model / str(v) / "mf_backend" / "__init__.py", b"")
    _pem(model / "config.pbtxt", b'name: "golden"\nbackend: "python"\n')
    with tempfile.TemporaryDirectory() as tmp:
        key = ec.generate_private_key(ec.SECP256R1())
        key_file = _pem(Path(tmp) / "k.pem", key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
        _pem(out / "golden.pub", key.public_key().public_bytes(serialization.Encoding.PEM,
                                                               serialization.PublicFormat.SubjectPublicKeyInfo))
        sign_model_version(model, 1, SignerConfig(key_file), provenance=FACTS)

        root_key, leaf_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP256R1())
        root = _cert(_name("Golden Root CA"), root_key, _name("Golden Root CA"), root_key, ca=True)
        leaf = _cert(_name("golden signer"), leaf_key, root.subject, root_key, ca=False)
        _pem(out / "root.pem", root.public_bytes(serialization.Encoding.PEM))
        leaf_file = _pem(Path(tmp) / "leaf.pem", leaf.public_bytes(serialization.Encoding.PEM))
        leaf_key_file = _pem(Path(tmp) / "leaf.key", leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        sign_model_version(model, 2, SignerConfig(leaf_key_file, None, (leaf_file,)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
