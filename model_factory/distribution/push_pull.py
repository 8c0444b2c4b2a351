"""Push a signed model version to a registry or an OCI layout, and pull it back, verified, into a repository.

``push`` sends the version as a ModelPack artifact (or a model-car image) and attaches its signature,
provenance, BOM and release files (the repository's ``.release/``, when it has one) as referrers.
``pull`` checks everything before DEST changes:

1. the manifest and its referrers are read; the signature referrer must exist (and the release
   referrer, when the policy has a ``[release]`` section);
2. the signature's signer must be trusted by the policy, and the manifest's files must be exactly the
   signed files with the signed digests (checked before any weights are downloaded); with ``[release]``,
   the signed release must list this version's signature, and must not be older (rollback) or
   expired (freeze) compared with the release state trusted on this machine;
3. each blob is hashed while it streams into a staging folder beside DEST (a digest mismatch stops the pull);
4. the staged model folder is verified as ``model-factory verify`` would (signer, files, provenance);
5. the signed version must match a numeric tag, must not be older than the version already in DEST
   (a tag re-pointed to an older signed version), and the BOM referrer must be the signed BOM; a LoRA adapter
   entry must name a base version DEST holds with the bytes it was built on (``adapters.py``);
6. only then is ``DEST/<model>`` replaced, in one rename.
Any failure leaves DEST as it was; downloaded blobs stay in ``.<DEST>.oci-blobs`` so a retry resumes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Sequence

from model_factory.backend.lora_contract import ADAPTER_SPEC
from model_factory.distribution import modelpack as mp
from model_factory.distribution.adapters import check_base
from model_factory.distribution.oci_layout import (ANNOTATION_TITLE, ANNOTATION_VERSION, OCI_INDEX, OCI_MANIFEST,
                                                   Progress, Target, canonical_json, descriptor, fallback_tag,
                                                   open_layout, remove_tree, sha256_bytes, sha256_file)
from model_factory.distribution.registry import RegistryOptions, RegistryTarget, parse_registry_ref
from model_factory.errors import FactoryError
from model_factory.signing import layout

ReleaseCheck = Callable[[Path, int, Sequence[Path]], None]
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_NUMERIC_TAG = re.compile(r"^v?(0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class PushResult:
    """Where a version went: the manifest digest and each referrer's digest by role."""

    reference: str
    digest: str
    form: str
    referrers: dict[str, str]


@dataclass(frozen=True)
class PullResult:
    """What landed in DEST: the model folder, the verified signer, and the referrers that were checked."""

    model_dir: Path
    model: str
    version: int
    digest: str
    signer: str | None
    referrers: tuple[str, ...]


def open_target(ref: str, options: RegistryOptions, create: bool) -> tuple[Target, str]:
    """``oci://...`` -> a registry repository; ``oci-layout:DIR[:TAG]`` -> an OCI layout. Returns (target, reference)."""
    if ref.startswith("oci-layout:"):
        rest = ref[len("oci-layout:"):]
        folder, _, tag = rest.rpartition(":") if ":" in rest and "/" not in rest.rpartition(":")[2] else (rest, "", "")
        if not folder:
            raise FactoryError(f"{ref!r} names no folder. Fix: write oci-layout:DIR[:TAG]")
        return open_layout(Path(folder), create), tag or "latest"
    if ref.startswith("oci://"):
        parsed = parse_registry_ref(ref)
        return RegistryTarget(parsed, options), parsed.reference
    raise FactoryError(f"{ref!r} is neither oci://HOST/NAMESPACE/NAME:TAG nor oci-layout:DIR[:TAG]. Fix: use one "
                       "of those forms")


def _put_all(target: Target, blobs: Sequence[Any], progress: Progress | None) -> None:
    for blob in blobs:
        target.put_blob(blob, progress)


def attach(target: Target, subject: dict[str, Any], artifact_type: str, role: str,
           files: list[tuple[str, Any, str]], progress: Progress | None = None) -> str:
    """Attach a referrer to ``subject``; where the target does not index referrers, update the tag-schema index."""
    data, blobs = mp.referrer(subject, artifact_type, role, files)
    _put_all(target, blobs, progress)
    digest = sha256_bytes(data)
    if target.put_manifest(data, OCI_MANIFEST, digest):
        return digest
    tag = fallback_tag(subject["digest"])
    try:
        index = json.loads(target.get_manifest(tag)[0])
    except FactoryError:
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}
    entry = descriptor(OCI_MANIFEST, digest, len(data), {mp.ROLE: role}, artifact_type)
    # A re-push replaces the referrer of the same role: one signature per version, the newest.
    index["manifests"] = [m for m in index.get("manifests", [])
                          if (m.get("annotations") or {}).get(mp.ROLE) != role] + [entry]
    target.put_manifest(canonical_json(index), OCI_INDEX, tag)
    return digest


def referrers(target: Target, digest: str) -> list[dict[str, Any]]:
    """The referrers of ``digest``: from the referrers API, else from the ``sha256-<hex>`` tag."""
    found = target.referrers_api(digest)
    if found is not None:
        return found
    try:
        data, _ = target.get_manifest(fallback_tag(digest))
    except FactoryError:
        return []
    try:
        return list(json.loads(data).get("manifests") or [])
    except (ValueError, AttributeError):
        return []


def push(repo: Path, model: str, ref: str, *, version: int | None = None, form: str = "modelpack",
         options: RegistryOptions = RegistryOptions(), release_files: Sequence[Path] = (),
         progress: Progress | None = None) -> PushResult:
    """Push one signed version of ``repo/model`` to ``ref`` with its referrers; returns the digests.

    ``form`` is ``modelpack`` (the ModelPack artifact that ``pull`` reads) or ``modelcar`` (an image whose
    files sit under ``/models/<model>/``, for KServe model cars and image volumes). ``release_files``
    (release metadata) are attached as one ``release`` referrer; when none are given and ``repo`` has a
    ``.release/`` folder, its signed TUF files are attached, and the version must be in that release.
    """
    if form not in ("modelpack", "modelcar"):
        raise FactoryError(f"unknown form {form!r}. Fix: use modelpack or modelcar")
    if not ref.startswith(("oci://", "oci-layout:")):
        open_target(ref, options, create=False)  # says which forms are accepted
    content = mp.collect_version(Path(repo), model, version)
    if not release_files:
        release_files = _repository_release(Path(repo), content)
    target, reference = open_target(ref, options, create=True)
    if reference.startswith("sha256:"):
        raise FactoryError("push needs a tag, not a digest. Fix: write ...:TAG (e.g. the version number)")
    with tempfile.TemporaryDirectory(prefix=".mf-push-", dir=content.model_dir.parent) as work:
        if form == "modelpack":
            manifest, blobs = mp.modelpack(content)
        else:
            manifest, blobs = mp.modelcar(content, Path(work))
        _put_all(target, blobs, progress)
        digest = sha256_bytes(manifest)
        target.put_manifest(manifest, OCI_MANIFEST, reference)
    subject = descriptor(OCI_MANIFEST, digest, len(manifest))
    attached = {}
    for role, path in content.role_files.items():
        attached[role] = attach(target, subject, mp.SIGSTORE_BUNDLE, role,
                                [(path.name, mp.file_blob(path), mp.SIGSTORE_BUNDLE)], progress)
    if content.bom is not None:
        path = content.model_dir / content.bom
        attached["bom"] = attach(target, subject, mp.BOM_TYPE, "bom", [(path.name, mp.file_blob(path), mp.BOM_TYPE)],
                                 progress)
    if release_files:
        files = [(Path(p).name, mp.file_blob(Path(p)), "application/json") for p in release_files]
        attached["release"] = attach(target, subject, mp.RELEASE_TYPE, "release", files, progress)
    return PushResult(f"{ref}", digest, form, attached)


def _repository_release(repo: Path, content: mp.VersionContent) -> list[Path]:
    """The repository's release files, when it has a ``.release/``; the version must be listed in that release."""
    from model_factory.signing.release import release_dir, release_files

    if not release_dir(repo).is_dir():
        return []
    files = release_files(repo)
    name = f"{content.model}/{content.signature.name}"
    try:
        listed = json.loads((release_dir(repo) / "targets.json").read_bytes())["signed"]["targets"]
    except (OSError, ValueError, KeyError, TypeError):
        listed = None
    if not isinstance(listed, dict) or name not in listed:
        # A pull whose policy has [release] would refuse it (mix-and-match): say so here, where it is fixed.
        raise FactoryError(f"{content.model} version {content.version} is not in the repository's signed release "
                           f"({repo / '.release'}): a pull that checks releases would refuse it. Fix: publish a "
                           "release that lists it (model-factory release add), then push")
    return files


def _release_gate(metadata_dir: Path, staged: Path, version: int, trust: Any, state_dir: Path | None,
                  ref: str) -> None:
    """The TUF release check of the policy's ``[release]`` on the staged signature files; one-line refusal."""
    from model_factory.signing.release_check import verify_release_files

    verdict = verify_release_files(metadata_dir, staged, version, trust, state_dir=state_dir)
    if not verdict.ok:
        problems = " ".join("; ".join(verdict.all_problems()).split())  # one line, whatever python-tuf said
        raise FactoryError(f"{ref} is refused by the signed release check: {problems}")


def _by_role(found: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    roles: dict[str, dict[str, Any]] = {}
    for m in found:
        role = (m.get("annotations") or {}).get(mp.ROLE)
        if role:
            roles[role] = m  # the last one listed is the newest push
    return roles


def _fetch_referrer(target: Target, desc: dict[str, Any], dest_dir: Path, subject: str) -> list[Path]:
    """Fetch one referrer's files into ``dest_dir`` (each checked against its digest); names from the titles."""
    data, _ = target.get_manifest(desc["digest"])
    doc = mp.parse_manifest(data, f"referrer {desc['digest'][:19]}")
    if (doc.get("subject") or {}).get("digest") != subject:
        raise FactoryError(f"referrer {desc['digest'][:19]}... is listed for this model but names another subject: "
                           "the referrers index was tampered with. Fix: push the model again")
    out = []
    for layer in doc["layers"]:
        title = (layer.get("annotations") or {}).get(ANNOTATION_TITLE, "")
        if not title or "/" in title or title.startswith("."):
            raise FactoryError(f"referrer {desc['digest'][:19]}... has a file named {title!r}. Fix: push it again")
        path = dest_dir / title
        target.fetch_blob(layer["digest"], int(layer["size"]), path)
        out.append(path)
    return out


def _safe_relpath(rel: Any) -> str:
    p = PurePosixPath(rel) if isinstance(rel, str) else None
    if p is None or not rel or p.is_absolute() or ".." in p.parts or str(p) != rel:
        raise FactoryError(f"the manifest names a file {rel!r} outside the model folder: refused. Fix: pull only "
                           "artifacts pushed by model-factory")
    return rel


def _precheck(manifest: dict[str, Any], sig: Path, policy: Any, model: str, version: int) -> dict[str, str]:
    """Before any weights are fetched: a trusted signer, and layers == the signed files with the signed digests."""
    from model_factory.signing.bundle import parse_bundle
    from model_factory.signing.manifest import parse_statement
    from model_factory.signing.verify import check_signer

    bundle = parse_bundle(sig.read_bytes())
    signer, problems = check_signer(bundle, policy, dt.datetime.now(dt.timezone.utc))
    if problems:
        raise FactoryError(f"the signature of {model} version {version} is not trusted: {'; '.join(problems)}")
    signed = parse_statement(bundle.statement()).digests()
    listed: dict[str, str] = {}
    for layer in manifest["layers"]:
        rel = _safe_relpath((layer.get("annotations") or {}).get(mp.FILEPATH))
        listed[rel] = layer["digest"]
    extra = sorted(p for p in listed if p not in signed)
    wrong = sorted(p for p in listed if p in signed and listed[p] != f"sha256:{signed[p]}")
    missing = sorted(p for p in signed if p not in listed)
    reasons = []
    if extra:
        reasons.append(f"the manifest lists files the signature does not cover: {', '.join(extra[:5])}")
    if wrong:
        reasons.append(f"the manifest's digests differ from the signed ones for {', '.join(wrong[:5])}")
    if missing:
        reasons.append(f"signed files are missing from the manifest: {', '.join(missing[:5])}")
    if reasons:
        raise FactoryError(f"{model} version {version} was altered in the store: {'; '.join(reasons)}. Fix: push "
                           "the signed version again from the factory")
    return listed


def _check_version(version: int, reference: str, expect: int | None, existing: Path, allow_downgrade: bool) -> None:
    from model_factory.signing import layout

    m = _NUMERIC_TAG.match(reference)
    if m and int(m.group(1)) != version:
        raise FactoryError(f"tag {reference!r} points to a manifest of signed version {version}: the tag was "
                           "re-pointed (a rollback?). Fix: pull by digest if this older version is wanted")
    if expect is not None and expect != version:
        raise FactoryError(f"the artifact is signed version {version}, not the expected {expect}")
    if existing.is_dir() and not allow_downgrade:
        newer = [v for v in layout.model_entries(existing).versions if v > version]
        if newer:
            raise FactoryError(f"{existing} already holds version {max(newer)}, newer than the pulled signed version "
                               f"{version}: refusing a rollback. Fix: pass --allow-downgrade if it is intended")


def _install(staged: Path, dest: Path, model: str) -> Path:
    """Put the verified model folder at ``dest/model`` in one rename (an exchange where one is there)."""
    from model_factory.fileio import _exchange

    dest.mkdir(parents=True, exist_ok=True)
    target = dest / model
    if not os.path.lexists(target):
        os.rename(staged, target)
    elif not _exchange(staged, target):
        aside = staged.with_name(staged.name + ".old")
        os.rename(target, aside)
        os.rename(staged, target)
    return target


def _release_number(files: list[Path]) -> tuple[int, int]:
    """(targets version, timestamp version) of a set of release metadata files; (0, 0) when unreadable."""
    by_name = {p.name: p for p in files}
    try:
        return tuple(int(json.loads(by_name[n].read_bytes())["signed"]["version"])  # type: ignore[return-value]
                     for n in ("targets.json", "timestamp.json"))
    except (KeyError, OSError, ValueError, TypeError):
        return (0, 0)


def _install_release(files: list[Path], dest: Path) -> None:
    """``DEST/.release/`` becomes the pulled release metadata (already checked against this machine's release
    state), so that ``verify``, ``serve`` and ``rollout`` on DEST check the pulled versions with the same
    ``[release]`` policy; a newer release already there is kept (another model pulled later from a newer release)."""
    from model_factory.fileio import atomic_dir
    from model_factory.signing.release import release_dir

    target = release_dir(dest)
    here = sorted(p for p in target.iterdir() if p.is_file()) if target.is_dir() else []
    if here and _release_number(here) > _release_number(files):
        return
    with atomic_dir(target) as tmp:
        for f in files:
            shutil.copyfile(f, tmp / f.name)


def pull(ref: str, dest: Path, policy: Path, *, options: RegistryOptions = RegistryOptions(),
         expect_version: int | None = None, allow_downgrade: bool = False,
         release_check: ReleaseCheck | None = None, release_state: Path | None = None,
         progress: Progress | None = None) -> PullResult:
    """Pull a ModelPack artifact into the repository ``dest`` (as ``dest/<model>``), verified first (see module doc).

    When the policy has a ``[release]`` section, the ``release`` referrer must be attached and the TUF
    release check runs on it before any weights are fetched; ``release_state`` overrides the policy's
    ``state_dir`` (what this machine has trusted). Its files then become ``dest/.release/`` (unless a newer
    release is there), so the same policy verifies and serves DEST. ``release_check`` (an extra hook) receives the staged
    model folder, the version and the release files, after every other check, and raises FactoryError
    to refuse.
    """
    from model_factory.signing import load_policy, verify_model_version

    trust = load_policy(Path(policy))
    if release_state is not None and trust.release is None:
        raise FactoryError(f"a release state dir was given but the trust policy {policy} has no [release] section. "
                           "Fix: add one (docs/releases.md), or drop --release-state")
    dest = Path(dest).absolute()
    target, reference = open_target(ref, options, create=False)
    data, digest = target.get_manifest(reference)
    manifest = mp.parse_manifest(data, f"manifest {reference}")
    if manifest.get("artifactType") != mp.MODEL_ARTIFACT:
        raise FactoryError(f"{ref} is not a ModelPack model artifact (a model-car image is mounted, not pulled). "
                           "Fix: pull the tag pushed with --form modelpack")
    ann = manifest.get("annotations") or {}
    model = ann.get(mp.MODEL_NAME, "")
    if not _MODEL_NAME.match(model) or not str(ann.get(ANNOTATION_VERSION, "")).isdigit():
        raise FactoryError(f"{ref} does not name its model and version. Fix: push it with model-factory push")
    version = int(ann[ANNOTATION_VERSION])
    roles = _by_role(referrers(target, digest))
    if "signature" not in roles:
        raise FactoryError(f"{ref} has no signature attached (no signature referrer of {digest[:19]}...): "
                           "unsigned models are never pulled. Fix: push it again with model-factory push, which "
                           "attaches the signature (or copy the sha256-<hex> referrers tag with it)")
    if trust.release is not None and "release" not in roles:
        raise FactoryError(f"{ref} has no release metadata attached (no release referrer of {digest[:19]}...), and the "
                           "trust policy's [release] section requires a signed release. Fix: publish a release in the "
                           "factory (model-factory release add) and push again: push attaches .release/ itself")
    dest.parent.mkdir(parents=True, exist_ok=True)
    blobs = dest.parent / f".{dest.name}.oci-blobs"  # kept on failure: a retry resumes downloads
    blobs.mkdir(exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.pull-", dir=dest.parent))
    try:
        staged = stage / model
        staged.mkdir()
        extras = stage / "referrers"
        extras.mkdir()
        fetched: dict[str, list[Path]] = {}
        for role, desc in roles.items():
            (extras / role).mkdir()
            fetched[role] = _fetch_referrer(target, desc, extras / role, digest)
        if len(fetched["signature"]) != 1:
            raise FactoryError(f"the signature referrer of {ref} holds {len(fetched['signature'])} files, not one")
        sig = shutil.copyfile(fetched["signature"][0], staged / f"{version}.sig")
        if "provenance" in fetched and len(fetched["provenance"]) == 1:
            shutil.copyfile(fetched["provenance"][0], staged / f"{version}.provenance.sig")
        listed = _precheck(manifest, Path(sig), trust, model, version)
        if trust.release is not None:  # before any weights: a rolled-back or frozen release costs no download
            _release_gate(extras / "release", staged, version, trust, release_state, ref)
        sizes = {layer["digest"]: int(layer["size"]) for layer in manifest["layers"]}
        for d, size in sizes.items():
            cached = blobs / d.split(":", 1)[1]
            if not (cached.is_file() and cached.stat().st_size == size and sha256_file(cached) == d):
                target.fetch_blob(d, size, cached, progress)
        uses: dict[str, int] = {}
        for d in listed.values():
            uses[d] = uses.get(d, 0) + 1
        for rel, d in listed.items():
            out = staged / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            cached = blobs / d.split(":", 1)[1]
            uses[d] -= 1
            # The last file with this content takes the blob itself (no copy of a multi-GB weight file).
            shutil.copyfile(cached, out) if uses[d] else os.replace(cached, out)
        for empty in json.loads(ann.get(mp.EMPTY_DIRS, "[]")):
            (staged / _safe_relpath(empty)).mkdir(parents=True, exist_ok=True)
        own_config = layout.own_config_path(staged, version)
        if layout.carries_own_config(staged, version) and not (staged / layout.CONFIG).exists():
            # The model's config.pbtxt is derived from the version's signed copy (signing/model_config.py).
            shutil.copyfile(own_config, staged / layout.CONFIG)
        result = verify_model_version(staged, version, trust)
        if not result.ok:
            raise FactoryError(f"{model} version {version} from {ref} failed verification: " + "; ".join(result.reasons))
        _check_version(version, reference, expect_version, dest / model, allow_downgrade)
        if (staged / str(version) / ADAPTER_SPEC).is_file():  # a LoRA adapter: only onto the base it was built on
            check_base(staged / str(version), dest)
        if "bom" in fetched:
            signed_bom = staged / str(version) / "bom.cdx.json"
            if not signed_bom.is_file() or sha256_file(signed_bom) != sha256_file(fetched["bom"][0]):
                raise FactoryError(f"the BOM attached to {ref} is not the signed BOM of version {version}. Fix: push "
                                   "the model again")
        if release_check is not None:
            release_check(staged, version, tuple(fetched.get("release", ())))
        model_dir = _install(staged, dest, model)
        if trust.release is not None:  # after the model: a crash between leaves an older release, refused (fail-closed)
            _install_release(fetched["release"], dest)
    finally:
        remove_tree(stage)
        if blobs.is_dir() and not any(blobs.iterdir()):
            blobs.rmdir()  # nothing downloaded yet: nothing to resume
    remove_tree(blobs)
    return PullResult(model_dir, model, version, digest, result.signer, tuple(sorted(fetched)))
