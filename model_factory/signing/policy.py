"""The trust policy: which signers ``verify`` accepts, parsed once from TOML.

Example (paths are relative to the policy file)::

    version = 1

    [[keys]]                       # raw public keys (model-factory keygen)
    name = "release-2026"
    path = "keys/release-2026.pub"
    expires = 2027-06-30           # optional: the key is refused after this date

    [certificates]                 # an in-house CA
    roots = ["pki/root.pem"]
    intermediates = []             # optional: bundles carry their intermediates
    crls = ["pki/root.crl", "pki/intermediate.crl"]   # optional; when given, every CA must have one
    subjects = ["CN=model-factory release,O=Example Corp"]
    sans = ["email:ml-release@example.com"]
    any_identity = false           # true: any leaf of these roots (subjects/sans ignored)

    [provenance]
    required = true
    builder_ids = []               # optional: allowed runDetails.builder.id values

    [release]                      # optional: signed releases (docs/releases.md)
    root = "release/1.root.json"   # the release root trusted first (never read from the repository)
    state_dir = "/var/lib/model-factory/release"   # trusted state: kept across restarts
    min_version = 1                # the floor: the oldest release a fresh verifier accepts

At least one key or one CA root is required. A CA without ``subjects``,
``sans`` or ``any_identity = true`` is an error: trusting every certificate a
CA ever issued should be a decision written down, not a default.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from model_factory.errors import FactoryError
from model_factory.fileio import read_toml
from model_factory.signing.certificates import LoadedCRL, load_certificates, load_crl
from model_factory.signing.keys import key_hint, load_public_key, parse_subject

_SAN_PREFIXES = ("email:", "uri:", "dns:")


@dataclass(frozen=True)
class TrustedKey:
    """A public key allowed to sign; ``hint`` is model_signing's key identifier."""

    name: str
    path: Path
    hint: str
    public_key: ec.EllipticCurvePublicKey = field(compare=False, repr=False)
    expires: dt.datetime | None = None


@dataclass(frozen=True)
class CertificateTrust:
    """CA roots, extra intermediates, CRLs, and the signer identities allowed."""

    roots: tuple[x509.Certificate, ...]
    intermediates: tuple[x509.Certificate, ...] = ()
    crls: tuple[LoadedCRL, ...] = ()
    subjects: tuple[x509.Name, ...] = ()
    sans: tuple[str, ...] = ()
    any_identity: bool = False


@dataclass(frozen=True)
class ProvenanceRule:
    """Whether each version needs a signed provenance statement, and from which builders."""

    required: bool = False
    builder_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReleaseRule:
    """Signed releases: the root trusted first, where trusted state is kept, and the release floor."""

    root: Path
    state_dir: Path
    min_version: int = 1


@dataclass(frozen=True)
class TrustPolicy:
    """Everything ``verify`` trusts. Build it with :func:`load_policy` or :func:`parse_policy`."""

    keys: tuple[TrustedKey, ...] = ()
    certificates: CertificateTrust | None = None
    provenance: ProvenanceRule = ProvenanceRule()
    source: Path | None = None
    release: ReleaseRule | None = None


def _err(where: str, problem: str, fix: str) -> FactoryError:
    return FactoryError(f"trust policy field '{where}': {problem}. Fix: {fix}")


def _take(table: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise _err(where, "expected a table", f"write it as [{where}]")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _err(f"{where}.{unknown[0]}" if where else unknown[0], "unknown key",
                   f"remove it or use one of: {', '.join(sorted(allowed))}")
    return table


def _str_list(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _err(where, f"expected a list of strings, got {value!r}", 'write it as ["...", "..."]')
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _err(where, f"expected true or false, got {value!r}", "write true or false")
    return value


def _file(value: str, where: str, base: Path) -> Path:
    p = Path(value).expanduser()
    p = p if p.is_absolute() else base / p
    if not p.is_file():
        raise _err(where, f"{p} does not exist", "point it at an existing file (relative to the policy file)")
    return p


def _expiry(value: Any, where: str) -> dt.datetime:
    # TOML gives a date or a datetime (with or without an offset); a bare date means its end, UTC.
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    if isinstance(value, dt.date):
        return dt.datetime.combine(value, dt.time(23, 59, 59), dt.timezone.utc)
    raise _err(where, f"expected a TOML date, got {value!r}", "write a date such as 2027-06-30")


def parse_policy(data: Mapping[str, Any], base_dir: Path, source: Path | None = None) -> TrustPolicy:
    """Validate a policy mapping (as read from TOML); file paths are relative to ``base_dir``."""
    top = _take(dict(data), "", {"version", "keys", "certificates", "provenance", "release"})
    if top.get("version", 1) != 1:
        raise _err("version", f"{top['version']!r} is not supported", "write version = 1")

    keys = []
    raw_keys = top.get("keys", [])
    if not isinstance(raw_keys, list):
        raise _err("keys", "expected an array of tables", "write each key as a [[keys]] table")
    for i, item in enumerate(raw_keys):
        where = f"keys[{i}]"
        t = _take(item, where, {"name", "path", "expires"})
        for k in ("name", "path"):
            if not isinstance(t.get(k), str) or not t[k]:
                raise _err(f"{where}.{k}", "missing", f"add {k} = \"...\" to the [[keys]] table")
        path = _file(t["path"], f"{where}.path", base_dir)
        try:
            public_key = load_public_key(path)
        except FactoryError as exc:
            raise _err(f"{where}.path", str(exc), "use a P-256 or P-384 public key in PEM") from exc
        expires = _expiry(t["expires"], f"{where}.expires") if "expires" in t else None
        keys.append(TrustedKey(t["name"], path, key_hint(public_key), public_key, expires))
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise _err("keys", f"duplicate key names {names}", "give every key a distinct name")

    certs = None
    if "certificates" in top:
        c = _take(top["certificates"], "certificates",
                  {"roots", "intermediates", "crls", "subjects", "sans", "any_identity"})
        roots = tuple(cert for p in _str_list(c.get("roots", []), "certificates.roots")
                      for cert in load_certificates(_file(p, "certificates.roots", base_dir)))
        if not roots:
            raise _err("certificates.roots", "no CA root given", "list the PEM file of your in-house root CA")
        inter = tuple(cert for p in _str_list(c.get("intermediates", []), "certificates.intermediates")
                      for cert in load_certificates(_file(p, "certificates.intermediates", base_dir)))
        crls = tuple(load_crl(_file(p, "certificates.crls", base_dir))
                     for p in _str_list(c.get("crls", []), "certificates.crls"))
        subjects = []
        for s in _str_list(c.get("subjects", []), "certificates.subjects"):
            try:
                subjects.append(parse_subject(s))
            except FactoryError as exc:
                raise _err("certificates.subjects", str(exc), 'write "CN=...,O=..."') from exc
        sans = _str_list(c.get("sans", []), "certificates.sans")
        for s in sans:
            if not s.startswith(_SAN_PREFIXES):
                raise _err("certificates.sans", f"{s!r} has no type prefix",
                           "write email:..., uri:... or dns:...")
        any_identity = _bool(c.get("any_identity", False), "certificates.any_identity")
        if not (subjects or sans or any_identity):
            raise _err("certificates", "no allowed signer identity",
                       "list subjects and/or sans, or set any_identity = true to accept any leaf of these roots")
        certs = CertificateTrust(roots, inter, crls, tuple(subjects), tuple(sans), any_identity)

    if not keys and certs is None:
        raise _err("keys", "the policy trusts no one",
                   "add a [[keys]] table with a public key, or a [certificates] table with CA roots")

    p = _take(top.get("provenance", {}), "provenance", {"required", "builder_ids"})
    provenance = ProvenanceRule(_bool(p.get("required", False), "provenance.required"),
                                tuple(_str_list(p.get("builder_ids", []), "provenance.builder_ids")))
    return TrustPolicy(tuple(keys), certs, provenance, source, _release(top.get("release"), base_dir))


def _release(value: Any, base: Path) -> ReleaseRule | None:
    if value is None:
        return None
    r = _take(value, "release", {"root", "state_dir", "min_version"})
    for k in ("root", "state_dir"):
        if not isinstance(r.get(k), str) or not r[k]:
            raise _err(f"release.{k}", "missing", f'add {k} = "..." (see docs/releases.md)')
    floor = r.get("min_version", 1)
    if not isinstance(floor, int) or isinstance(floor, bool) or floor < 1:
        raise _err("release.min_version", f"expected a release number >= 1, got {floor!r}",
                   "write the oldest release a fresh verifier may accept, e.g. min_version = 3")
    state = Path(r["state_dir"]).expanduser()
    return ReleaseRule(_file(r["root"], "release.root", base), state if state.is_absolute() else base / state, floor)


def load_policy(path: str | Path) -> TrustPolicy:
    """Read and validate a trust policy TOML file."""
    path = Path(path)
    data = read_toml(path, "trust policy", "pass the policy file with --policy (see docs/signing.md for the format)")
    return parse_policy(data, path.resolve().parent, path.resolve())
