"""Verify every model version of a Triton repository against a trust policy, offline.

For each version: the signature file exists and is a well-formed bundle; its
signer is trusted by the policy (a listed key, or a certificate chaining to a
listed root, valid now, not revoked, with an allowed identity); the signed
statement is consistent and names this model; the files on disk are exactly
the signed ones (changed, missing, extra, renamed, symlinked, special files and
empty folders are all reported); the provenance, when present or required,
is signed by a trusted signer and names the same model version.

What is covered is decided here, by :mod:`model_factory.signing.layout`,
never by ``ignore_paths`` written into the bundle. Everything is collected,
not stopped at the first problem, so one run names every reason.
"""

from __future__ import annotations

import datetime as dt
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from model_factory.errors import FactoryError
from model_factory.signing import layout
from model_factory.signing.bundle import MAX_BUNDLE_BYTES, Bundle, parse_bundle
from model_factory.signing.certificates import check_chain, identity_matches, name_of, sans_of
from model_factory.signing.digests import file_tasks, hash_tasks, shard_tasks
from model_factory.signing.manifest import Manifest, describe_differences, parse_statement, split_shard
from model_factory.signing.model_config import derived_config_reasons
from model_factory.signing.policy import TrustPolicy
from model_factory.signing.provenance import check_statement


@dataclass(frozen=True)
class VerificationResult:
    """The verdict for one model version (``version`` is None for a problem with the whole model folder)."""

    model: str
    version: int | None
    ok: bool
    reasons: tuple[str, ...]
    signer: str | None
    files: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""
        d = asdict(self)
        d["reasons"] = list(self.reasons)
        return d


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _read_signature_file(path: Path, what: str) -> tuple[Bundle | None, list[str]]:
    """Parse a bundle file that must be a regular file (never a link)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, []
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        return None, [f"{what} {path.name} is not a regular file (a symlink or special file); it is not read"]
    if st.st_size > MAX_BUNDLE_BYTES:
        return None, [f"{what} {path.name} is {st.st_size >> 20} MiB, too large for a bundle; it is not read"]
    try:
        return parse_bundle(path.read_bytes()), []
    except FactoryError as exc:
        return None, [f"{what} {path.name} is damaged or tampered: {exc}"]
    except OSError as exc:
        return None, [f"cannot read {what} {path.name}: {exc.strerror or exc}"]


def check_signer(bundle: Bundle, policy: TrustPolicy, at: dt.datetime) -> tuple[str | None, list[str]]:
    """Who signed ``bundle`` if the policy trusts them and the signature is intact; else the reasons."""
    if bundle.certificates:
        trust = policy.certificates
        if trust is None:
            return None, ["the signature was made with a certificate, but the trust policy has no [certificates] "
                          "section. Fix: add your CA root to the policy, or sign with a listed key"]
        try:
            chain = bundle.chain()
        except FactoryError as exc:
            return None, [f"the signature bundle is damaged: {exc}"]
        leaf = chain[0]
        problems: list[str] = []
        key = leaf.public_key()
        try:
            intact = bundle.verify_with(key)  # type: ignore[arg-type]
        except (FactoryError, TypeError, AttributeError):
            intact = False
        if not intact:
            problems.append("the bundle's signature does not match its content: the signature file was tampered with "
                            "or corrupted. Fix: re-sign the model version")
        problems.extend(check_chain(chain, trust.roots, trust.intermediates, trust.crls, at).problems)
        who = f"cert:{name_of(leaf)}"
        if not trust.any_identity and not identity_matches(leaf, trust.subjects, trust.sans):
            sans = ", ".join(sans_of(leaf)) or "no SANs"
            problems.append(f"signer {name_of(leaf)} ({sans}) is not an identity allowed by the trust policy. "
                            "Fix: add it to [certificates] subjects or sans if it should be trusted")
        return (None, problems) if problems else (who, [])

    if not policy.keys:
        return None, ["the signature was made with a raw key, but the trust policy lists no [[keys]]. Fix: add "
                      "the signer's public key to the policy, or sign with a certificate from the trusted CA"]
    if bundle.key_hint:
        candidates = [k for k in policy.keys if k.hint == bundle.key_hint]
        if not candidates:
            names = ", ".join(k.name for k in policy.keys)
            return None, [f"signed by an unknown key (model_signing key hint {bundle.key_hint[:16]}...), not by a key "
                          f"the trust policy lists ({names}). Fix: re-sign with a trusted key, or add its public key"]
    else:
        candidates = list(policy.keys)  # bundles from before key hints existed name no key
    for k in candidates:
        if bundle.verify_with(k.public_key):
            if k.expires is not None and at > k.expires:
                return None, [f"key {k.name} expired on {k.expires:%Y-%m-%d} per the trust policy. "
                              "Fix: re-sign with the current key (see key rotation in docs/signing.md)"]
            return f"key:{k.name}", []
    if bundle.key_hint:
        return None, [f"the bundle's signature does not verify with key {candidates[0].name}, which it names: the "
                      "signature file was tampered with or corrupted. Fix: re-sign the model version"]
    return None, ["the signature does not verify with any key in the trust policy"]


def _actual_fingerprints(model_dir: Path, files: tuple[str, ...], manifest: Manifest,
                         unreadable: dict[str, str]) -> dict[str, tuple]:
    """Hash the unit the way the manifest was made: per file, or per shard.

    Files that vanish or cannot be read meanwhile land in ``unreadable`` (path -> why).
    """
    readable = []
    for p in files:
        try:
            os.lstat(model_dir / p)
            readable.append(p)
        except OSError as exc:
            unreadable[p] = exc.strerror or str(exc)
    errors: dict[str, str] = {}
    if manifest.method == "files":
        out = {p: (d,) for p, d in hash_tasks(file_tasks(model_dir, readable), errors=errors).items()}
        unreadable.update(errors)
        return out
    assert manifest.shard_size is not None
    # An empty file has no shard: it still appears, with an empty fingerprint.
    shards: dict[str, list] = {p: [] for p in readable}
    for name, digest in hash_tasks(shard_tasks(model_dir, readable, manifest.shard_size), errors=errors).items():
        path, start, end = split_shard(name)
        shards[path].append((start, end, digest))
    for name, why in errors.items():
        path = split_shard(name)[0]
        unreadable[path] = why
        shards.pop(path, None)
    return {p: tuple(sorted(v)) for p, v in shards.items()}


def _provenance_reasons(model_dir: Path, version: int, manifest: Manifest, policy: TrustPolicy,
                        at: dt.datetime) -> list[str]:
    path = layout.provenance_path(model_dir, version)
    bundle, problems = _read_signature_file(path, "provenance")
    if problems:
        return problems
    if bundle is None:
        if policy.provenance.required:
            return [f"no signed provenance ({path.name}), which the trust policy requires. Fix: sign this version "
                    "with the build's provenance (model-factory build, or sign --provenance)"]
        return []
    signer, problems = check_signer(bundle, policy, at)
    if problems:
        return [f"provenance {path.name}: {p}" for p in problems]
    try:
        statement = bundle.statement()
    except FactoryError as exc:
        return [f"provenance {path.name}: {exc}"]
    return [f"{path.name}: {r}" for r in check_statement(statement, model_dir.name, manifest.root_digest,
                                                          policy.provenance.builder_ids)]


def _verify_version(model_dir: Path, version: int, policy: TrustPolicy,
                    at: dt.datetime) -> tuple[VerificationResult, Manifest | None]:
    model = model_dir.name

    def result(reasons: list[str], signer: str | None = None, files: int = 0) -> VerificationResult:
        return VerificationResult(model, version, not reasons, tuple(reasons), signer, files)

    sig = layout.signature_path(model_dir, version)
    version_dir = model_dir / str(version)
    if not os.path.lexists(version_dir):
        return result([f"version folder {version}/ is missing but its signature {sig.name} is there: with a version "
                       "removed, Triton serves another one. Fix: restore the folder, or delete the signature if the "
                       "removal is intended"]), None
    scan = layout.scan_unit(model_dir, version)
    if not os.path.lexists(sig):
        return result([f"unsigned: no signature {sig.name} for version {version}. Fix: model-factory sign"],
                      files=len(scan.files)), None
    bundle, problems = _read_signature_file(sig, "signature")
    if bundle is None:
        return result(problems, files=len(scan.files)), None
    signer, problems = check_signer(bundle, policy, at)
    if problems:
        # The statement of an untrusted bundle is not read: its file list proves nothing.
        return result(problems, files=len(scan.files)), None
    try:
        manifest = parse_statement(bundle.statement())
    except FactoryError as exc:
        return result([f"signature {sig.name}: {exc}"], signer, len(scan.files)), None

    reasons: list[str] = []
    if manifest.model_name != model:
        reasons.append(f"the signature is for model {manifest.model_name!r}, but the folder is {model!r}: a model "
                       "folder was renamed or a signature copied. Fix: restore the name or re-sign")
    if manifest.version is not None and manifest.version != version:
        reasons.append(f"the signature is for version {manifest.version}, but it is stored as {sig.name}")
    reasons.extend(scan.problems)
    outside = sorted(p for p in manifest.files() if layout.outside_unit(p, version))
    if outside:
        reasons.append(f"the signature covers {', '.join(outside)}, which belong to other versions or are signature "
                       f"files, not to version {version}. Fix: sign each version with the other versions and every "
                       "*.sig file ignored (model-factory sign does this)")
    unreadable: dict[str, str] = {}
    actual = _actual_fingerprints(model_dir, scan.files, manifest, unreadable)
    reasons.extend(f"cannot read {p}: {why} (changed during verification, or a permission problem)"
                   for p, why in sorted(unreadable.items()))
    # Already explained above: do not report these again as "missing".
    explained = set(scan.not_regular) | set(outside) | set(unreadable)
    reasons.extend(describe_differences(manifest, actual, scan.empty_dirs, explained))
    # The model's config.pbtxt, out of the unit of a version that carries its own, must be that copy if it serves it.
    reasons.extend(derived_config_reasons(model_dir, version))
    reasons.extend(_provenance_reasons(model_dir, version, manifest, policy, at))
    return result(reasons, signer, len(manifest.files())), manifest


def verify_model_version(model_dir: Path, version: int, policy: TrustPolicy) -> VerificationResult:
    """Verify one version of one model folder."""
    return _verify_version(Path(model_dir), int(version), policy, _now())[0]


def verify_repository(repo: Path, policy: TrustPolicy) -> list[VerificationResult]:
    """Verify every version of every model in ``repo``; one result per model version.

    A model folder without any version, or that is a symlink, gives one
    failed result with ``version=None``. Plain files at the top of the
    repository are ignored, as Triton ignores them, and so are hidden folders
    (``.<model>.staging-*`` of an interrupted build, ``.git``): ``serve``
    never loads them.
    """
    repo = Path(repo)
    if not repo.is_dir():
        raise FactoryError(f"model repository {repo} does not exist. Fix: pass the folder that holds the models")
    at = _now()
    results: list[VerificationResult] = []
    entries = sorted(os.scandir(repo), key=lambda e: e.name)
    for entry in entries:
        if entry.is_symlink():
            results.append(VerificationResult(entry.name, None, False, (
                f"model folder {entry.name} is a symlink; symlinks are never trusted. "
                "Fix: move the model into the repository",), None, 0))
            continue
        if not entry.is_dir(follow_symlinks=False) or entry.name.startswith("."):
            continue  # plain files and hidden folders (a build's staging, .git) are not models
        model_dir = Path(entry.path)
        try:
            found = layout.model_entries(model_dir)
        except OSError as exc:
            results.append(VerificationResult(entry.name, None, False, (
                f"cannot read model folder {entry.name}: {exc.strerror or exc}",), None, 0))
            continue
        versions = sorted(set(found.versions) | set(found.signed_versions))
        if not versions:
            results.append(VerificationResult(entry.name, None, False, (
                f"model {entry.name} has no version folder and no signature. Fix: package and sign it, or remove "
                "the folder (Triton would try to load it)",), None, 0))
            continue
        for version in versions:
            results.append(_verify_version(model_dir, version, policy, at)[0])
    if not results:
        raise FactoryError(f"model repository {repo} holds no models, so there is nothing to verify. "
                           "Fix: pass the repository folder (the one that holds <model>/config.pbtxt)")
    return results


def signed_digests(model_dir: Path, version: int, policy: TrustPolicy | None = None) -> dict[str, str]:
    """The signed ``relpath -> sha256`` map of one model version (paths relative to ``model_dir``).

    With ``policy``, the whole version is verified first (signer, files,
    provenance) and any failure raises a FactoryError with every reason. Without
    it, only the bundle's own consistency is checked: the trust decision is the
    one ``verify_repository`` made before the server started, and this map lets
    the backend re-check the bytes it actually loads (``model_factory.backend.integrity``), closing the
    gap between the two.
    """
    model_dir = Path(model_dir)
    if policy is not None:
        res, manifest = _verify_version(model_dir, int(version), policy, _now())
        if not res.ok or manifest is None:
            raise FactoryError(f"{model_dir.name} version {version} failed verification: " + "; ".join(res.reasons))
    else:
        sig = layout.signature_path(model_dir, version)
        bundle, problems = _read_signature_file(sig, "signature")
        if bundle is None:
            raise FactoryError(f"{model_dir.name} version {version}: " + ("; ".join(problems) or
                               f"no signature {sig.name}. Fix: model-factory sign"))
        manifest = parse_statement(bundle.statement())
        if manifest.model_name != model_dir.name:
            raise FactoryError(f"the signature {sig} is for model {manifest.model_name!r}, not {model_dir.name!r}")
    if manifest.method != "files":
        raise FactoryError(f"{model_dir.name} version {version} was signed per shard, so there is no per-file "
                           "digest. Fix: re-sign with model-factory sign (per-file sha256)")
    return manifest.digests()
