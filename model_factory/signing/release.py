"""Signed releases of a model repository, on The Update Framework (python-tuf): the publisher's side.

A release says which model versions make up the repository *now*, and is signed so that a fleet
can refuse an older release (rollback), a release that stopped being refreshed (freeze), a
repository mixed from two releases (mix-and-match), metadata with too few signatures and a root
rotation the old root did not sign. The four TUF roles, in ``<repo>/.release/``:

* ``N.root.json``  the keys and thresholds of every role; signed by the root keys (kept offline).
  Every version is kept: a client walks the chain, each step signed by the old and the new root.
* ``targets.json`` one target per signature file, ``<model>/<version>.sig`` (and
  ``<model>/<version>.provenance.sig``), by length and sha256; the ``.sig`` target's ``custom``
  names the model, the version and the signed files' digest (the statement's subject). The
  signature covers every file of the version, so the release pins the files through it. Its
  version is the *release number*.
* ``snapshot.json`` the targets version of this release (stops mix-and-match of metadata).
* ``timestamp.json`` short-lived (a day by default), re-signed by ``release timestamp`` with an
  online key: a repository nobody refreshes expires (freeze).

Triton never sees the folder: it is hidden, and serving loads models by name. Checking a
release (the client side) is :mod:`model_factory.signing.release_check`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from model_factory.errors import FactoryError
from model_factory.fileio import atomic_file
from model_factory.signing import layout

RELEASE_DIR = ".release"
ROLES = ("root", "targets", "snapshot", "timestamp")
# Defaults: root changes rarely (offline keys); a release lives until the next; the timestamp is
# short so that a frozen repository is noticed within a day.
DEFAULT_EXPIRY = {"root": dt.timedelta(days=365), "targets": dt.timedelta(days=90),
                  "snapshot": dt.timedelta(days=90), "timestamp": dt.timedelta(days=1)}


def _tuf():
    try:
        from securesystemslib.signer import CryptoSigner, SSlibKey
        from tuf.api import metadata
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise FactoryError("signed releases need python-tuf. Fix: pip install 'model-factory[sign]'") from exc
    return metadata, CryptoSigner, SSlibKey


@dataclass(frozen=True)
class KeyFile:
    """A private key (PEM, from ``model-factory keygen``) and its password, to sign one role."""

    path: Path
    password: bytes | None = None


def release_dir(repo: Path) -> Path:
    """``<repo>/.release``: where a repository's release metadata lives."""
    return Path(repo) / RELEASE_DIR


def release_files(repo: Path) -> list[Path]:
    """Every release metadata file of ``repo`` (all roots, targets, snapshot, timestamp), sorted.

    What to ship beside the repository (an OCI artifact's extra layer, a tarball): with these and
    the trust policy's root, :func:`~model_factory.signing.release_check.verify_release_files`
    checks a model version anywhere.
    """
    folder = release_dir(repo)
    if not folder.is_dir():
        raise FactoryError(f"{repo} has no release metadata ({RELEASE_DIR}/). Fix: model-factory release init, "
                           "then model-factory release add")
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink() and p.suffix == ".json"
                  and not p.name.startswith("."))


def _signer(key: KeyFile):
    from model_factory.signing.keys import load_private_key

    _, CryptoSigner, SSlibKey = _tuf()
    private = load_private_key(key.path, key.password)
    return CryptoSigner(private, SSlibKey.from_crypto(private.public_key()))


def public_key(path: Path):
    """A TUF key (SSlibKey) from a PEM public key, or from a private key's public half."""
    from cryptography.hazmat.primitives import serialization

    from model_factory.signing.keys import curve_name, load_public_key

    _, _, SSlibKey = _tuf()
    path = Path(path)
    data = path.read_bytes() if path.is_file() else b""
    if b"PRIVATE KEY" in data:
        try:
            pub = serialization.load_pem_private_key(data, None).public_key()
        except (TypeError, ValueError) as exc:
            raise FactoryError(f"{path} is an encrypted private key. Fix: pass its public key (.pub)") from exc
        curve_name(pub)  # type: ignore[arg-type]
    else:
        pub = load_public_key(path)
    return SSlibKey.from_crypto(pub)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _write(md, path: Path) -> None:
    from tuf.api.serialization.json import JSONSerializer

    with atomic_file(path, "wb") as f:
        f.write(md.to_bytes(JSONSerializer(compact=False)))


def _load(path: Path, cls):
    metadata, _, _ = _tuf()
    try:
        return metadata.Metadata[cls].from_file(str(path))
    except FileNotFoundError:
        raise FactoryError(f"release metadata {path} is missing. Fix: model-factory release init/add") from None
    except Exception as exc:  # tuf raises DeserializationError and friends
        raise FactoryError(f"release metadata {path} cannot be read ({exc}). Fix: restore it from the "
                           "release machine") from None


def root_versions(repo: Path) -> list[int]:
    """The versions of ``N.root.json`` present, sorted."""
    out = []
    for p in release_dir(repo).glob("*.root.json"):
        head = p.name.split(".")[0]
        if head.isdigit():
            out.append(int(head))
    return sorted(out)


def latest_root(repo: Path):
    """The newest root metadata of ``repo``'s release."""
    metadata, _, _ = _tuf()
    versions = root_versions(repo)
    if not versions:
        raise FactoryError(f"{repo} has no release root ({RELEASE_DIR}/1.root.json). Fix: model-factory release init")
    return _load(release_dir(repo) / f"{versions[-1]}.root.json", metadata.Root)


def _sign_all(md, keys: Iterable[KeyFile], role: str) -> None:
    signers = [_signer(k) for k in keys]
    if not signers:
        raise FactoryError(f"no key given to sign {role}. Fix: pass the {role} key(s)")
    for s in signers:
        md.sign(s, append=True)


def _set_role(root, role: str, keys: Sequence, threshold: int) -> None:
    if threshold < 1 or threshold > len(keys):
        raise FactoryError(f"{role} threshold {threshold} with {len(keys)} key(s): a threshold must be between 1 "
                           f"and the number of keys. Fix: pass more {role} keys or a lower threshold")
    for keyid in list(root.roles[role].keyids):
        root.revoke_key(keyid, role)
    for k in keys:
        root.add_key(k, role)
    root.roles[role].threshold = threshold


def init_release(repo: Path, root_keys: Sequence[KeyFile], role_keys: dict[str, Sequence[Path]],
                 thresholds: dict[str, int] | None = None, expires: dt.timedelta | None = None) -> Path:
    """Create ``<repo>/.release/1.root.json``: the keys and thresholds of the four roles, signed by the root keys.

    ``root_keys`` are private (they sign; keep them offline afterwards); ``role_keys`` maps
    ``targets``, ``snapshot`` and ``timestamp`` to public keys. Copy the written root into the trust
    policy's folder: it is what every verifier trusts first.
    """
    metadata, _, _ = _tuf()
    folder = release_dir(repo)
    if root_versions(repo):
        raise FactoryError(f"{folder} already holds a release root. Fix: use model-factory release rotate-root "
                           "to change keys")
    thresholds = thresholds or {}
    root = metadata.Root(expires=_now() + (expires or DEFAULT_EXPIRY["root"]), consistent_snapshot=False)
    _set_role(root, "root", [_signer(k).public_key for k in root_keys], thresholds.get("root", len(root_keys)))
    for role in ("targets", "snapshot", "timestamp"):
        paths = role_keys.get(role) or []
        if not paths:
            raise FactoryError(f"no {role} key given. Fix: pass --{role}-key PUB (model-factory keygen makes one)")
        _set_role(root, role, [public_key(p) for p in paths], thresholds.get(role, 1))
    md = metadata.Metadata(root)
    _sign_all(md, root_keys, "root")
    path = folder / "1.root.json"
    _write(md, path)
    return path


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return os.path.getsize(path), h.hexdigest()


def _subject_digest(sig: Path) -> str | None:
    """The signed statement's subject digest (all the version's files), read without trusting it."""
    from model_factory.signing.bundle import parse_bundle

    try:
        statement = parse_bundle(sig.read_bytes()).statement()
        return statement["subject"][0]["digest"]["sha256"]
    except (FactoryError, KeyError, IndexError, TypeError):
        return None


def collect_targets(repo: Path) -> dict[str, Any]:
    """``path -> TargetFile`` (length, sha256, custom) for every signature file of every model version in ``repo``.

    Every version folder must have its signature: an unsigned version cannot be released.
    """
    metadata, _, _ = _tuf()
    repo = Path(repo)
    out: dict[str, Any] = {}
    for model_dir in sorted(p for p in repo.iterdir() if p.is_dir() and not p.is_symlink()
                            and not p.name.startswith(".")):
        entries = layout.model_entries(model_dir)
        for v in sorted(set(entries.versions) | set(entries.signed_versions)):
            sig = layout.signature_path(model_dir, v)
            if not sig.is_file() or not (model_dir / str(v)).is_dir():
                raise FactoryError(f"{model_dir.name} version {v} has no signature or no folder, so it cannot be "
                                   "released. Fix: model-factory sign (or remove the version)")
            length, sha = _digest(sig)
            custom = {"model": model_dir.name, "version": v, "files_sha256": _subject_digest(sig)}
            name = f"{model_dir.name}/{sig.name}"
            out[name] = metadata.TargetFile(length, {"sha256": sha}, name, {"custom": custom})
            prov = layout.provenance_path(model_dir, v)
            if prov.is_file():
                length, sha = _digest(prov)
                pname = f"{model_dir.name}/{prov.name}"
                out[pname] = metadata.TargetFile(length, {"sha256": sha}, pname)
    if not out:
        raise FactoryError(f"{repo} holds no signed model version to release. Fix: package and sign models first")
    return out


def _meta(path: Path, version: int):
    metadata, _, _ = _tuf()
    length, sha = _digest(path)
    return metadata.MetaFile(version, length, {"sha256": sha})


def add_release(repo: Path, targets_keys: Sequence[KeyFile], snapshot_keys: Sequence[KeyFile],
                timestamp_keys: Sequence[KeyFile], expires: dict[str, dt.timedelta] | None = None,
                now: dt.datetime | None = None, policy: object | None = None) -> int:
    """Publish the next release: every signed model version now in ``repo``. Returns the release number.

    Writes a new targets (version + 1), snapshot and timestamp. Sign with at least a threshold of
    each role's keys (the verifier refuses fewer). ``now`` is the signing time (tests pass a past one).
    With ``policy`` (a TrustPolicy), every model version must verify against it first.
    """
    metadata, _, _ = _tuf()
    repo = Path(repo)
    latest_root(repo)  # refuse early without a root
    if policy is not None:
        from model_factory.signing.verify import verify_repository

        failed = [r for r in verify_repository(repo, policy) if not r.ok]  # type: ignore[arg-type]
        if failed:
            raise FactoryError("refusing to release versions that do not verify: " + "; ".join(
                f"{r.model}/{r.version}: {r.reasons[0]}" for r in failed) + ". Fix: re-sign or remove them")
    folder = release_dir(repo)
    when = now or _now()
    expires = {**DEFAULT_EXPIRY, **(expires or {})}
    previous = folder / "targets.json"
    version = _load(previous, metadata.Targets).signed.version + 1 if previous.exists() else 1
    targets = metadata.Targets(version=version, expires=when + expires["targets"], targets=collect_targets(repo))
    md = metadata.Metadata(targets)
    _sign_all(md, targets_keys, "targets")
    staged = folder / ".targets.next.json"
    _write(md, staged)
    snap_path = folder / "snapshot.json"
    snap_version = _load(snap_path, metadata.Snapshot).signed.version + 1 if snap_path.exists() else 1
    snapshot = metadata.Snapshot(version=snap_version, expires=when + expires["snapshot"],
                                 meta={"targets.json": _meta(staged, version)})
    smd = metadata.Metadata(snapshot)
    _sign_all(smd, snapshot_keys, "snapshot")
    # targets first, then snapshot, then timestamp: a reader between two renames sees a snapshot that
    # does not match targets and is refused (mix-and-match), never a wrong release accepted.
    os.replace(staged, previous)
    _write(smd, snap_path)
    _timestamp(repo, timestamp_keys, expires["timestamp"], when)
    return version


def _timestamp(repo: Path, keys: Sequence[KeyFile], lifetime: dt.timedelta, when: dt.datetime) -> int:
    metadata, _, _ = _tuf()
    folder = release_dir(repo)
    snap_path = folder / "snapshot.json"
    snap = _load(snap_path, metadata.Snapshot)
    ts_path = folder / "timestamp.json"
    version = _load(ts_path, metadata.Timestamp).signed.version + 1 if ts_path.exists() else 1
    ts = metadata.Timestamp(version=version, expires=when + lifetime,
                            snapshot_meta=_meta(snap_path, snap.signed.version))
    md = metadata.Metadata(ts)
    _sign_all(md, keys, "timestamp")
    _write(md, ts_path)
    return version


def refresh_timestamp(repo: Path, keys: Sequence[KeyFile], lifetime: dt.timedelta | None = None,
                      now: dt.datetime | None = None) -> int:
    """Re-sign the timestamp (new version, new expiry) for the current snapshot; returns its version.

    Run it on a schedule (a CronJob with the online timestamp key), more often than its lifetime.
    """
    if not (release_dir(repo) / "snapshot.json").exists():
        raise FactoryError(f"{repo} has no release yet. Fix: model-factory release add first")
    return _timestamp(Path(repo), keys, lifetime or DEFAULT_EXPIRY["timestamp"], now or _now())


def rotate_root(repo: Path, old_root_keys: Sequence[KeyFile], new_root_keys: Sequence[KeyFile],
                threshold: int | None = None, role_keys: dict[str, Sequence[Path]] | None = None,
                thresholds: dict[str, int] | None = None, expires: dt.timedelta | None = None) -> Path:
    """Write root version N+1 with new root keys (and optionally new keys of other roles).

    It is signed by the old root keys (a threshold of them: verifiers accept a new root only when
    the root they trust signed it) and by the new root keys (a threshold of the new root too).
    After changing the targets, snapshot or timestamp keys, publish with ``add_release`` or
    ``refresh_timestamp`` signed by the new keys.
    """
    metadata, _, _ = _tuf()
    repo = Path(repo)
    old = latest_root(repo)
    root = metadata.Root.from_dict(json.loads(json.dumps(old.signed.to_dict())))
    root.version = old.signed.version + 1
    root.expires = _now() + (expires or DEFAULT_EXPIRY["root"])
    thresholds = thresholds or {}
    if new_root_keys:
        new_pubs = [_signer(k).public_key for k in new_root_keys]
        _set_role(root, "root", new_pubs, threshold or len(new_pubs))
    for role, paths in (role_keys or {}).items():
        if paths:
            _set_role(root, role, [public_key(p) for p in paths], thresholds.get(role, 1))
    md = metadata.Metadata(root)
    signers = {}
    for k in list(old_root_keys) + list(new_root_keys):
        s = _signer(k)
        signers[s.public_key.keyid] = s
    for s in signers.values():
        md.sign(s, append=True)
    path = release_dir(repo) / f"{root.version}.root.json"
    _write(md, path)
    return path


@dataclass(frozen=True)
class ReleaseInfo:
    """What ``release show`` prints: versions, expiries, keys and the model versions released."""

    root_version: int
    thresholds: dict[str, str]
    release: int | None
    expires: dict[str, str]
    timestamp_version: int | None
    models: dict[str, list[int]]


def describe_release(repo: Path) -> ReleaseInfo:
    """Read (without verifying) the release metadata of ``repo``: a summary for people."""
    metadata, _, _ = _tuf()
    repo = Path(repo)
    root = latest_root(repo).signed
    folder = release_dir(repo)
    thresholds = {r: f"{root.roles[r].threshold} of {len(root.roles[r].keyids)}" for r in ROLES}
    expires = {"root": root.expires.isoformat()}
    release = ts_version = None
    models: dict[str, list[int]] = {}
    if (folder / "targets.json").exists():
        t = _load(folder / "targets.json", metadata.Targets).signed
        release, expires["targets"] = t.version, t.expires.isoformat()
        for target in t.targets.values():
            c = target.custom if isinstance(target.custom, dict) else {}
            if "model" in c:
                models.setdefault(c["model"], []).append(int(c["version"]))
    for role, cls in (("snapshot", metadata.Snapshot), ("timestamp", metadata.Timestamp)):
        if (folder / f"{role}.json").exists():
            signed = _load(folder / f"{role}.json", cls).signed
            expires[role] = signed.expires.isoformat()
            if role == "timestamp":
                ts_version = signed.version
    return ReleaseInfo(root.version, thresholds, release, expires, ts_version,
                       {m: sorted(v) for m, v in sorted(models.items())})
