"""Sigstore bundle v0.3 / DSSE: model_signing's exact shape, strict parsing, tamper evidence."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from model_factory.signing.bundle import (BUNDLE_MEDIA_TYPE, IN_TOTO_PAYLOAD_TYPE, BundleError, pae, parse_bundle,
                                          sign_statement)
from model_factory.signing.keys import key_hint

STATEMENT = {"_type": "https://in-toto.io/Statement/v1", "subject": [], "predicateType": "x", "predicate": {}}


@pytest.fixture(scope="module")
def key():
    return ec.generate_private_key(ec.SECP256R1())


def test_key_mode_round_trip(key):
    b = sign_statement(STATEMENT, key)
    doc = json.loads(b.to_json())
    assert list(doc) == ["mediaType", "verificationMaterial", "dsseEnvelope"]
    assert doc["mediaType"] == BUNDLE_MEDIA_TYPE
    assert doc["verificationMaterial"] == {"publicKey": {"hint": key_hint(key.public_key())}, "tlogEntries": []}
    assert doc["dsseEnvelope"]["payloadType"] == IN_TOTO_PAYLOAD_TYPE
    parsed = parse_bundle(b.to_json())
    assert parsed == b and parsed.verify_with(key.public_key()) and parsed.statement() == STATEMENT
    assert not parsed.verify_with(ec.generate_private_key(ec.SECP256R1()).public_key())


def test_pae_matches_model_signing():
    sigstore_pb = pytest.importorskip("model_signing._signing.sign_sigstore_pb")
    assert pae(IN_TOTO_PAYLOAD_TYPE, b'{"a": 1}') == sigstore_pb.pae(b'{"a": 1}')


def test_tampered_payload_does_not_verify(key):
    doc = json.loads(sign_statement(STATEMENT, key).to_json())
    payload = base64.b64decode(doc["dsseEnvelope"]["payload"]).replace(b'"x"', b'"y"')
    doc["dsseEnvelope"]["payload"] = base64.b64encode(payload).decode()
    assert not parse_bundle(json.dumps(doc)).verify_with(key.public_key())


def _doc(key):
    return json.loads(sign_statement(STATEMENT, key).to_json())


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(mediaType="application/vnd.dev.sigstore.bundle.v0.1+json"), "not a Sigstore bundle v0.3"),
    (lambda d: d["verificationMaterial"].update(x509CertificateChain={"certificates": []}), "exactly one of"),
    (lambda d: d["verificationMaterial"].update(tlogEntries=[{"logIndex": 1}]), "transparency-log entries"),
    (lambda d: d["dsseEnvelope"]["signatures"].append(d["dsseEnvelope"]["signatures"][0]), "exactly one signature"),
    (lambda d: d["dsseEnvelope"].update(payload="%%%"), "not valid base64"),
    (lambda d: d.pop("dsseEnvelope"), "dsseEnvelope is missing"),
    (lambda d: d["verificationMaterial"].pop("publicKey") and d["verificationMaterial"].update(
        x509CertificateChain={"certificates": [{"rawBytes": base64.b64encode(b"junk").decode()}]}),
     "not valid DER"),
    (lambda d: d["verificationMaterial"].pop("publicKey") and d["verificationMaterial"].update(
        certificate={"rawBytes": base64.b64encode(b"junk").decode()}), "sigstore method's field"),
    (lambda d: d.update(extra=1), "does not allow"),
    (lambda d: d["dsseEnvelope"].update(payloadType="text/plain"), "payloadType is 'text/plain'"),
])
def test_parse_rejects(key, edit, message):
    d = _doc(key)
    edit(d)
    with pytest.raises(BundleError, match=message):
        parse_bundle(json.dumps(d))


def test_parse_rejects_non_json():
    with pytest.raises(BundleError, match="not JSON"):
        parse_bundle(b"\x00garbage")
    with pytest.raises(BundleError, match="not an object"):
        parse_bundle("[]")
