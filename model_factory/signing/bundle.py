"""Sigstore bundle v0.3 JSON around a DSSE envelope, as OpenSSF model_signing 1.x writes it.

The shape, field for field (see ``model_signing/_signing/sign_ec_key.py`` and
``sign_certificate.py``)::

    {"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
     "verificationMaterial": {"publicKey": {"hint": "<sha256 of the PEM public key>"},
                              "tlogEntries": []}
                          or {"x509CertificateChain": {"certificates": [{"rawBytes": "<b64 DER>"}, ...]},
                              "tlogEntries": []},
     "dsseEnvelope": {"payload": "<b64 in-toto statement>",
                      "payloadType": "application/vnd.in-toto+json",
                      "signatures": [{"sig": "<b64 DER ECDSA>", "keyid": ""}]}}

The signature is ECDSA over DSSE's pre-authentication encoding (PAE) of the
payload; there is no transparency-log entry (offline). Parsing here is strict:
anything unexpected is reported, since a bundle is attacker-controlled input
until its signature is checked.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from cryptography import exceptions, x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from model_factory.errors import FactoryError
from model_factory.signing.keys import key_hint, signature_hash

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
# Sigstore's newer spelling of the same version; accepted when reading.
_BUNDLE_MEDIA_TYPES = (BUNDLE_MEDIA_TYPE, "application/vnd.dev.sigstore.bundle+json;version=0.3")
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
# A model bundle lists one line per file: even 100k files stay far below this.
MAX_BUNDLE_BYTES = 64 << 20


class BundleError(FactoryError):
    """A signature file that is not a well-formed bundle (damaged or tampered)."""


@dataclass(frozen=True)
class Bundle:
    """A parsed bundle. ``certificates`` are DER, leaf first; empty in key mode."""

    payload: bytes
    payload_type: str
    signature: bytes
    key_hint: str | None = None
    certificates: tuple[bytes, ...] = ()

    def to_json(self) -> str:
        """The bundle as model_signing writes it (compact JSON, same key order)."""
        if self.certificates:
            material: dict[str, Any] = {"x509CertificateChain": {"certificates": [
                {"rawBytes": base64.b64encode(der).decode()} for der in self.certificates]}}
        else:
            material = {"publicKey": {"hint": self.key_hint or ""}}
        material["tlogEntries"] = []
        doc = {
            "mediaType": BUNDLE_MEDIA_TYPE,
            "verificationMaterial": material,
            "dsseEnvelope": {
                "payload": base64.b64encode(self.payload).decode(),
                "payloadType": self.payload_type,
                "signatures": [{"sig": base64.b64encode(self.signature).decode(), "keyid": ""}],
            },
        }
        return json.dumps(doc, separators=(",", ":"))

    def leaf_certificate(self) -> x509.Certificate | None:
        """The signing certificate, or None in key mode."""
        return self.chain()[0] if self.certificates else None

    def chain(self) -> list[x509.Certificate]:
        """All certificates of the bundle, leaf first."""
        try:
            return [x509.load_der_x509_certificate(der) for der in self.certificates]
        except ValueError as exc:
            raise BundleError(f"a certificate in the bundle is not valid DER ({exc})") from exc

    def verify_with(self, public_key: ec.EllipticCurvePublicKey) -> bool:
        """True when the DSSE signature verifies with ``public_key``."""
        try:
            public_key.verify(self.signature, pae(self.payload_type, self.payload),
                              ec.ECDSA(signature_hash(public_key)))
        except exceptions.InvalidSignature:
            return False
        return True

    def statement(self) -> dict[str, Any]:
        """The in-toto statement in the payload. Call only after the signature verified."""
        if self.payload_type != IN_TOTO_PAYLOAD_TYPE:
            raise BundleError(f"payload type is {self.payload_type!r}, expected {IN_TOTO_PAYLOAD_TYPE!r}")
        try:
            doc = json.loads(self.payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BundleError(f"the signed payload is not JSON ({exc})") from exc
        if not isinstance(doc, dict):
            raise BundleError("the signed payload is not a JSON object")
        return doc


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: what the signature covers."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def encode_statement(statement: dict[str, Any]) -> bytes:
    """Statement JSON as model_signing writes it (two-space indent, keys in insertion order)."""
    return json.dumps(statement, indent=2, ensure_ascii=False).encode("utf-8")


def sign_statement(statement: dict[str, Any], private_key: ec.EllipticCurvePrivateKey,
                   certificates: tuple[x509.Certificate, ...] = ()) -> Bundle:
    """Sign an in-toto statement into a bundle (key mode, or certificate mode with a chain)."""
    payload = encode_statement(statement)
    signature = private_key.sign(pae(IN_TOTO_PAYLOAD_TYPE, payload), ec.ECDSA(signature_hash(private_key)))
    if certificates:
        ders = tuple(c.public_bytes(serialization.Encoding.DER) for c in certificates)
        return Bundle(payload, IN_TOTO_PAYLOAD_TYPE, signature, None, ders)
    return Bundle(payload, IN_TOTO_PAYLOAD_TYPE, signature, key_hint(private_key.public_key()))


def _b64(value: Any, where: str) -> bytes:
    if not isinstance(value, str):
        raise BundleError(f"{where} is not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BundleError(f"{where} is not valid base64") from exc


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BundleError(f"{where} is missing or not an object")
    return value


def parse_bundle(text: str | bytes) -> Bundle:
    """Parse bundle JSON strictly; a BundleError says what is wrong."""
    if len(text) > MAX_BUNDLE_BYTES:
        raise BundleError(f"the bundle is larger than {MAX_BUNDLE_BYTES >> 20} MiB")
    try:
        doc = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"not JSON ({exc})") from exc
    except RecursionError:
        raise BundleError("its JSON nests too deeply to be a bundle") from None
    doc = _obj(doc, "the bundle")
    media = doc.get("mediaType")
    if media not in _BUNDLE_MEDIA_TYPES:
        raise BundleError(f"media type {media!r} is not a Sigstore bundle v0.3 ({BUNDLE_MEDIA_TYPE})")
    if "messageSignature" in doc:
        raise BundleError("it holds a plain message signature; model signatures use a DSSE envelope")
    material = _obj(doc.get("verificationMaterial"), "verificationMaterial")
    env = _obj(doc.get("dsseEnvelope"), "dsseEnvelope")

    extra = sorted(set(doc) - {"mediaType", "verificationMaterial", "dsseEnvelope"})
    if extra:
        raise BundleError(f"it has member {extra[0]!r}, which an OMS v1.0 bundle does not allow")
    extra = sorted(set(env) - {"payload", "payloadType", "signatures"})
    if extra:
        raise BundleError(f"its DSSE envelope has member {extra[0]!r}, which OMS v1.0 does not allow")

    hint: str | None = None
    certs: tuple[bytes, ...] = ()
    kinds = [k for k in ("publicKey", "x509CertificateChain", "certificate") if k in material]
    if len(kinds) != 1:
        raise BundleError("verificationMaterial must hold exactly one of publicKey (key method), "
                          "x509CertificateChain (certificate method) or certificate (sigstore method), found "
                          f"{kinds or 'none'}")
    if kinds[0] == "certificate":
        # OMS v1.0 §4.1: a single certificate is the sigstore method's field (a short-lived Fulcio
        # certificate, required with transparency-log entries), distinct from a certificate chain.
        if not material.get("tlogEntries"):
            raise BundleError("verificationMaterial.certificate is the sigstore method's field and needs "
                              "tlogEntries (OMS v1.0 4.1); it has none, so the bundle is malformed")
        raise BundleError("it is signed with the sigstore (keyless) method, whose transparency-log entries "
                          "cannot be checked offline. Fix: sign with a key or an in-house certificate chain "
                          "(model-factory sign)")
    if kinds[0] == "publicKey":
        pk = _obj(material["publicKey"], "verificationMaterial.publicKey")
        raw_hint = pk.get("hint")
        if raw_hint is not None and not isinstance(raw_hint, str):
            raise BundleError("verificationMaterial.publicKey.hint is not a string")
        if raw_hint is None and not isinstance(pk.get("rawBytes"), str):
            raise BundleError("verificationMaterial.publicKey has neither hint nor rawBytes (OMS v1.0 4.1)")
        hint = raw_hint or None
    else:
        chain = _obj(material["x509CertificateChain"], "verificationMaterial.x509CertificateChain")
        items = chain.get("certificates")
        if not isinstance(items, list) or not items:
            raise BundleError("the certificate chain in the bundle is empty")
        certs = tuple(_b64(_obj(c, "a certificate").get("rawBytes"), "a certificate's rawBytes") for c in items)
    if material.get("tlogEntries"):
        # Offline verification: a log entry would be unchecked, so it must not look like it counts.
        raise BundleError("it carries transparency-log entries, which offline verification cannot check")

    payload = _b64(env.get("payload"), "dsseEnvelope.payload")
    payload_type = env.get("payloadType")
    if payload_type != IN_TOTO_PAYLOAD_TYPE:
        raise BundleError(f"dsseEnvelope.payloadType is {payload_type!r}, expected {IN_TOTO_PAYLOAD_TYPE!r}")
    sigs = env.get("signatures")
    if not isinstance(sigs, list) or len(sigs) != 1:
        raise BundleError(f"the DSSE envelope must hold exactly one signature, found "
                          f"{len(sigs) if isinstance(sigs, list) else 'none'}")
    sig0 = _obj(sigs[0], "dsseEnvelope.signatures[0]")
    # OMS v1.0 4.1: keyid may be absent, "" or null; it is not used.
    if sig0.get("keyid") is not None and not isinstance(sig0.get("keyid"), str):
        raise BundleError("dsseEnvelope.signatures[0].keyid is not a string")
    signature = _b64(sig0.get("sig"), "dsseEnvelope.signatures[0].sig")
    if not signature:
        raise BundleError("dsseEnvelope.signatures[0].sig is empty")
    bundle = Bundle(payload, payload_type, signature, hint, certs)
    bundle.chain()  # fail here, not later, on a certificate that is not DER
    return bundle
