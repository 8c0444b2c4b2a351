"""X.509 chains from an in-house CA: path validation at verification time, CRLs, identities.

model_signing validates a chain at the leaf's ``notBefore`` (so an expired
leaf passes) and never checks revocation. Here every certificate must be valid
*now* (or at the time the caller passes), the chain is built by
``cryptography``'s verifier to a root listed in the trust policy, and each
certificate below the root is looked up in the policy's CRLs.

The leaf must be an end-entity certificate on P-256/P-384 allowed to sign
code: key usage digitalSignature, and if it has an extended key usage, that
includes codeSigning.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID

from model_factory.errors import FactoryError
from model_factory.signing.keys import _CURVE_NAMES


@dataclass(frozen=True)
class LoadedCRL:
    """A CRL from the trust policy, with the file it came from (for messages)."""

    path: Path
    crl: x509.CertificateRevocationList


@dataclass(frozen=True)
class ChainCheck:
    """The outcome of validating a bundle's chain: the chain built, and every problem found."""

    chain: tuple[x509.Certificate, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise FactoryError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def load_certificates(path: Path) -> list[x509.Certificate]:
    """All certificates in a PEM file (or one DER certificate)."""
    path = Path(path)
    data = _read(path, "certificate file")
    try:
        if b"-----BEGIN" in data:
            certs = x509.load_pem_x509_certificates(data)
        else:
            certs = [x509.load_der_x509_certificate(data)]
    except ValueError as exc:
        raise FactoryError(f"{path} holds no readable X.509 certificate ({exc}). "
                           "Fix: give a PEM or DER certificate file") from exc
    return certs


def load_crl(path: Path) -> LoadedCRL:
    """A PEM or DER certificate revocation list."""
    path = Path(path)
    data = _read(path, "CRL file")
    try:
        crl = (x509.load_pem_x509_crl(data) if b"-----BEGIN" in data else x509.load_der_x509_crl(data))
    except ValueError as exc:
        raise FactoryError(f"{path} is not a readable CRL ({exc}). Fix: give the PEM or DER CRL "
                           "published by your CA") from exc
    return LoadedCRL(path, crl)


def name_of(cert: x509.Certificate) -> str:
    """The subject as an RFC 4514 string, for messages and results."""
    return cert.subject.rfc4514_string() or "(empty subject)"


def sans_of(cert: x509.Certificate) -> list[str]:
    """Subject alternative names as ``email:``, ``uri:``, ``dns:`` strings."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    out = [f"email:{v}" for v in ext.get_values_for_type(x509.RFC822Name)]
    out += [f"uri:{v}" for v in ext.get_values_for_type(x509.UniformResourceIdentifier)]
    out += [f"dns:{v}" for v in ext.get_values_for_type(x509.DNSName)]
    return out


def _when(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _validity_problem(cert: x509.Certificate, at: dt.datetime, role: str) -> str | None:
    if at < cert.not_valid_before_utc:
        return (f"{role} certificate {name_of(cert)} is not valid yet (from {_when(cert.not_valid_before_utc)}). "
                "Fix: check the clock, or wait")
    if at > cert.not_valid_after_utc:
        return (f"{role} certificate {name_of(cert)} expired on {_when(cert.not_valid_after_utc)}. "
                "Fix: re-sign with a current certificate")
    return None


def leaf_problems(leaf: x509.Certificate) -> list[str]:
    problems = []
    key = leaf.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in _CURVE_NAMES:
        problems.append(f"signing certificate {name_of(leaf)} does not hold a P-256/P-384 ECDSA key")
    ext = leaf.extensions
    try:
        if ext.get_extension_for_class(x509.BasicConstraints).value.ca:
            problems.append(f"signing certificate {name_of(leaf)} is a CA certificate; sign with an "
                            "end-entity (leaf) certificate")
    except x509.ExtensionNotFound:
        pass
    try:
        ku = ext.get_extension_for_class(x509.KeyUsage).value
        ku_ok: bool | None = ku.digital_signature
    except x509.ExtensionNotFound:
        ku_ok = None
    try:
        eku = ext.get_extension_for_class(x509.ExtendedKeyUsage).value
        eku_ok: bool | None = ExtendedKeyUsageOID.CODE_SIGNING in eku
    except x509.ExtensionNotFound:
        eku_ok = None
    if ku_ok is False or eku_ok is False or (ku_ok is None and eku_ok is None):
        problems.append(f"signing certificate {name_of(leaf)} is not allowed to sign code "
                        "(needs key usage digitalSignature and, if present, extended key usage codeSigning)")
    return problems


def _revocation_problems(chain: list[x509.Certificate], crls: tuple[LoadedCRL, ...],
                         at: dt.datetime) -> list[str]:
    """Look each non-root certificate up in the CRL of its issuer; every issuer must have one."""
    problems = []
    for cert, issuer in zip(chain, chain[1:]):
        covering = [c for c in crls if c.crl.issuer == issuer.subject]
        valid = [c for c in covering if c.crl.is_signature_valid(issuer.public_key())]
        for c in covering:
            if c not in valid:
                problems.append(f"CRL {c.path.name} names {name_of(issuer)} as issuer but is not signed by it")
        if not valid:
            if not covering:
                problems.append(f"no CRL from {name_of(issuer)} in the trust policy, so revocation of "
                                f"{name_of(cert)} cannot be checked. Fix: add that CA's CRL to [certificates] crls")
            continue
        for c in valid:
            next_update = c.crl.next_update_utc
            if next_update is not None and at > next_update:
                problems.append(f"CRL {c.path.name} from {name_of(issuer)} is out of date (next update was "
                                f"{_when(next_update)}). Fix: fetch a current CRL from the CA")
            revoked = c.crl.get_revoked_certificate_by_serial_number(cert.serial_number)
            if revoked is not None and revoked.revocation_date_utc <= at:
                problems.append(f"certificate {name_of(cert)} (serial {cert.serial_number:x}) was revoked on "
                                f"{_when(revoked.revocation_date_utc)} per CRL {c.path.name}")
    return problems


def _path_validity_problems(leaf: x509.Certificate, candidates: list[x509.Certificate],
                            at: dt.datetime) -> list[str]:
    """Follow issuer names up from the leaf and report CA certificates not valid at ``at``."""
    problems, seen, cert = [], set(), leaf
    while cert.issuer != cert.subject:
        issuers = [c for c in candidates if c.subject == cert.issuer and c not in seen]
        if not issuers:
            break
        cert = issuers[0]
        seen.add(cert)
        p = _validity_problem(cert, at, "CA")
        if p:
            problems.append(p)
    return problems


def check_chain(chain_in_bundle: list[x509.Certificate], roots: tuple[x509.Certificate, ...],
                extra_intermediates: tuple[x509.Certificate, ...], crls: tuple[LoadedCRL, ...],
                at: dt.datetime) -> ChainCheck:
    """Validate the bundle's leaf up to a trusted root, at time ``at``, with revocation.

    ``chain_in_bundle`` is leaf first; the certificates after the leaf and
    ``extra_intermediates`` are only candidates for building the path.
    """
    leaf, bundled = chain_in_bundle[0], chain_in_bundle[1:]
    problems = leaf_problems(leaf)
    expired = _validity_problem(leaf, at, "signing")
    if expired:
        problems.append(expired)
    if not roots:
        return ChainCheck((leaf,), tuple(problems + ["the trust policy lists no CA roots, so a certificate "
                                                     "signature cannot be trusted. Fix: add [certificates] roots"]))
    if problems:
        return ChainCheck((leaf,), tuple(problems))
    builder = (verification.PolicyBuilder()
               .store(verification.Store(list(roots)))
               .time(at)
               .extension_policies(ca_policy=verification.ExtensionPolicy.webpki_defaults_ca(),
                                   # The end-entity rules (code signing) are checked above; the web-PKI
                                   # defaults would demand a TLS client EKU.
                                   ee_policy=verification.ExtensionPolicy.permit_all()))
    try:
        verified = builder.build_client_verifier().verify(leaf, list(bundled) + list(extra_intermediates))
    except verification.VerificationError as exc:
        # Say why in words: the verifier's own message ("candidates exhausted") names no certificate.
        problems.extend(_path_validity_problems(leaf, list(bundled) + list(extra_intermediates) + list(roots), at))
        if not problems:
            trusted = ", ".join(name_of(r) for r in roots)
            problems.append(f"signing certificate {name_of(leaf)} (issued by {leaf.issuer.rfc4514_string()}) does "
                            f"not chain to a CA trusted by the policy ({trusted}): {exc}")
        return ChainCheck((leaf,), tuple(problems))
    chain = list(verified.chain)
    if crls:
        problems.extend(_revocation_problems(chain, crls, at))
    return ChainCheck(tuple(chain), tuple(problems))


def name_key(name: x509.Name) -> tuple[tuple[str, str], ...]:
    """A comparable form of a name: its attributes, in any order.

    RFC 4514 strings list attributes in reverse order of the certificate, and
    tools print them either way; the attribute set is what identifies a signer.
    """
    return tuple(sorted((a.oid.dotted_string, str(a.value)) for a in name))


def identity_matches(cert: x509.Certificate, subjects: tuple[x509.Name, ...], sans: tuple[str, ...]) -> bool:
    """True when the leaf's subject equals an allowed subject, or one of its SANs is allowed."""
    if name_key(cert.subject) in {name_key(s) for s in subjects}:
        return True
    return bool(set(sans_of(cert)) & set(sans))
