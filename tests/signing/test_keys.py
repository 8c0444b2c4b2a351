"""keygen for an air-gapped set-up: key files, modes, passwords, CSRs."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from model_factory.errors import FactoryError
from model_factory.signing import generate_keypair
from model_factory.signing.keys import key_hint, load_private_key, load_public_key


@pytest.mark.parametrize("curve, curve_class", [("P-256", ec.SECP256R1), ("P-384", ec.SECP384R1),
                                               ("P-521", ec.SECP521R1)])
def test_keypair(tmp_path, curve, curve_class):
    paths = generate_keypair(tmp_path / "keys", curve)
    assert stat.S_IMODE(paths.private_key.stat().st_mode) == 0o600
    assert paths.csr is None
    key = load_private_key(paths.private_key)
    assert isinstance(key.curve, curve_class)
    assert load_public_key(paths.public_key) == key.public_key()


def test_private_key_is_0600_even_with_a_permissive_umask(tmp_path):
    import os
    old = os.umask(0)
    try:
        paths = generate_keypair(tmp_path, "P-256")
    finally:
        os.umask(old)
    assert stat.S_IMODE(paths.private_key.stat().st_mode) == 0o600


def test_password(tmp_path):
    paths = generate_keypair(tmp_path, "P-256", password=b"correct horse")
    assert b"ENCRYPTED" in paths.private_key.read_bytes()
    assert load_private_key(paths.private_key, b"correct horse")
    with pytest.raises(FactoryError, match="pass its password"):
        load_private_key(paths.private_key)
    with pytest.raises(FactoryError, match="wrong password"):
        load_private_key(paths.private_key, b"wrong")
    with pytest.raises(FactoryError, match="password is empty"):
        generate_keypair(tmp_path / "other", "P-256", password=b"")


def test_csr(tmp_path):
    paths = generate_keypair(tmp_path, "P-384", csr_subject="CN=model-factory CI,O=Example Corp")
    csr = x509.load_pem_x509_csr(paths.csr.read_bytes())
    assert csr.is_signature_valid
    assert csr.subject.rfc4514_string() == "CN=model-factory CI,O=Example Corp"
    assert csr.public_key() == load_public_key(paths.public_key)
    eku = csr.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CODE_SIGNING in eku
    assert csr.extensions.get_extension_for_class(x509.KeyUsage).value.digital_signature


def test_refusals(tmp_path):
    generate_keypair(tmp_path, "P-256")
    with pytest.raises(FactoryError, match="already exists"):
        generate_keypair(tmp_path, "P-256")
    with pytest.raises(FactoryError, match="curve 'P-224' is not supported"):
        generate_keypair(tmp_path / "x", "P-224")
    with pytest.raises(FactoryError, match="not an RFC 4514 name"):
        generate_keypair(tmp_path / "y", "P-256", csr_subject="just a name")
    assert not (tmp_path / "y" / "signing-key.pem").exists()  # nothing written on a bad subject


def test_unsupported_keys(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    k = ed25519.Ed25519PrivateKey.generate()
    p = tmp_path / "ed.pem"
    p.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with pytest.raises(FactoryError, match="not an ECDSA key"):
        load_private_key(p)
    k1 = tmp_path / "k1.pem"
    k1.write_bytes(ec.generate_private_key(ec.SECP256K1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(FactoryError, match="secp256k1, which is not supported"):
        load_private_key(k1)


def test_key_hint_is_model_signings(tmp_path):
    sign_ec_key = pytest.importorskip("model_signing._signing.sign_ec_key")
    paths = generate_keypair(tmp_path, "P-256")
    signer = sign_ec_key.Signer(paths.private_key)
    assert signer._get_verification_material().public_key.hint == key_hint(load_public_key(paths.public_key))
