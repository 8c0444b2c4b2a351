"""Checking a signed release (the verifier's side): refuse rollback, freeze, mix-and-match, too few
signatures and a root rotation the old root did not sign.

The TUF client workflow is python-tuf's own (``tuf.ngclient.Updater``), reading the metadata
from a folder (``<repo>/.release``) instead of a URL. What it trusts lives in the policy's
``[release] state_dir``, which must outlive the process:

* ``root.json`` + ``root_history/``: the newest root trusted (seeded from the policy's root);
* ``timestamp.json``, ``snapshot.json``, ``targets.json``: the newest release trusted; an older
  one is refused (rollback), and an equal one must not be expired (freeze);
* ``floors.json``: the newest version of each model trusted; a release that lists an older one
  is refused (rollback of one model).

A verifier with an empty state dir (a brand-new pod) trusts the policy's root and accepts no
release below the policy's ``min_version``; between that floor and the newest release it is
protected only by the timestamp's short lifetime (docs/releases.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from model_factory.errors import FactoryError
from model_factory.fileio import atomic_file
from model_factory.signing import layout
from model_factory.signing.policy import ReleaseRule, TrustPolicy
from model_factory.signing.release import RELEASE_DIR, release_dir

_BASE_URL = "release:///"


@dataclass(frozen=True)
class ReleaseVerdict:
    """The release check of one repository (or one model version).

    ``problems`` concern the release metadata itself (every model is refused); ``by_model`` the
    content of one model; ``missing`` the model versions the release lists but the repository lacks.
    """

    release: int | None
    problems: tuple[str, ...] = ()
    by_model: dict[str, tuple[str, ...]] = field(default_factory=dict)
    missing: tuple[tuple[str, int], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems and not any(self.by_model.values())

    def all_problems(self) -> list[str]:
        """Every problem, the model named where it concerns one."""
        return list(self.problems) + [f"{m}: {p}" for m, ps in sorted(self.by_model.items()) for p in ps]


def _fetcher_class():
    from tuf.api import exceptions
    from tuf.ngclient import FetcherInterface

    class FolderFetcher(FetcherInterface):
        """Serves ``release:///<name>`` from one folder; remembers the last file asked for (to name the attack)."""

        def __init__(self, folder: Path) -> None:
            self.folder = folder
            self.last: str | None = None

        def _fetch(self, url: str) -> Iterator[bytes]:
            name = url[len(_BASE_URL):] if url.startswith(_BASE_URL) else url
            self.last = name
            if "/" in name or name.startswith("."):
                raise exceptions.DownloadHTTPError(f"{name}: not a release file", 404)
            try:
                fd = os.open(self.folder / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except FileNotFoundError:
                raise exceptions.DownloadHTTPError(f"{name} is missing", 404) from None
            except OSError as exc:  # a symlink (ELOOP) or unreadable: never followed
                raise exceptions.DownloadError(f"{name} cannot be read: {exc.strerror or exc}") from None
            with os.fdopen(fd, "rb") as f:
                return iter([f.read()])

    return FolderFetcher


@contextmanager
def _locked(state: Path) -> Iterator[None]:
    # Replicas sharing one state volume take turns (blocking: a start waits a moment, never fails).
    import fcntl

    try:
        state.mkdir(parents=True, exist_ok=True)
        fd = os.open(state / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise FactoryError(f"cannot write the release state dir {state} ({exc.strerror or exc}). Fix: make the "
                           "policy's [release] state_dir a writable folder that outlives the process (a volume)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _attack(exc: Exception, where: str | None) -> str:
    """A message naming the attack (or fault) that ``exc`` from the TUF client workflow means, and the fix."""
    from tuf.api import exceptions as e

    where = where or "the release metadata"
    role = where.split(".")[-2] if where.endswith(".json") else "metadata"
    if where.endswith(".root.json") and isinstance(exc, (e.UnsignedMetadataError, e.BadVersionNumberError)):
        return (f"bad root rotation: {where} is not signed by a threshold of the keys of the root trusted here and of "
                f"its own root keys ({exc}); a new root is trusted only when the old root signed it. Fix: sign the new "
                "root with the old root keys too (model-factory release rotate-root --old-root-key ...), or restore "
                "the released root files")
    if isinstance(exc, e.UnsignedMetadataError):
        return (f"below threshold: {where} has fewer valid signatures than the threshold the trusted root sets for "
                f"{role} ({exc}). Fix: sign it with at least a threshold of the {role} keys "
                f"(repeat --{role}-key for each key; see docs/releases.md)")
    if isinstance(exc, e.BadVersionNumberError) and "must be >=" in str(exc):
        return (f"rollback attack: {where} is older than the release already trusted here ({exc}): an older, validly "
                "signed release was put back. Fix: restore the newest release's files and metadata; to go back to an "
                "older model on purpose, publish it as a new release (model-factory release add)")
    if isinstance(exc, (e.BadVersionNumberError, e.LengthOrHashMismatchError)):
        return (f"mix-and-match attack: {where} does not belong with the rest of the release metadata ({exc}): files "
                "from two releases were mixed. Fix: restore all of .release/ from one release")
    if isinstance(exc, e.ExpiredMetadataError):
        return (f"freeze attack: {exc} (read at {where}): the repository is no longer refreshed, or an old copy "
                "is being replayed. Fix: re-sign the timestamp (model-factory release timestamp) or publish a new "
                "release; if that cannot be done, someone is holding updates back")
    if isinstance(exc, e.DownloadError):
        return (f"no usable release metadata: {exc}. Fix: publish a release (model-factory release add) and ship "
                f"{RELEASE_DIR}/ with the repository")
    return f"the release metadata is invalid ({where}: {exc}). Fix: restore {RELEASE_DIR}/ from the release machine"


def _refresh(folder: Path, rule: ReleaseRule):
    """Run the TUF client workflow on ``folder`` with the trusted state; the trusted targets, or a problem."""
    from tuf.api import exceptions
    from tuf.api.metadata import Metadata, Targets
    from tuf.ngclient import Updater

    state = rule.state_dir
    fetcher = _fetcher_class()(folder)
    boot = None
    if not os.path.lexists(state / "root.json"):
        try:
            boot = rule.root.read_bytes()
        except OSError as exc:
            return None, f"cannot read the release root {rule.root} named by the trust policy: {exc.strerror or exc}"
    try:
        updater = Updater(str(state), _BASE_URL, fetcher=fetcher, bootstrap=boot)
    except OSError as exc:
        raise FactoryError(f"cannot write the release state dir {state} ({exc.strerror or exc}). Fix: make it "
                           "writable by this user") from None
    except (exceptions.RepositoryError, ValueError) as exc:
        return None, (f"the trusted release root ({rule.root if boot else state / 'root.json'}) is not a valid, "
                      f"self-signed TUF root ({exc}). Fix: put the 1.root.json written by model-factory release init "
                      "in the trust policy's folder")
    try:
        updater.refresh()
    except (exceptions.RepositoryError, exceptions.DownloadError) as exc:
        return None, _attack(exc, fetcher.last)
    except OSError as exc:
        raise FactoryError(f"cannot write the release state dir {state} ({exc.strerror or exc}). Fix: make it "
                           "writable by this user") from None
    return Metadata[Targets].from_file(str(state / "targets.json")).signed, None


def _listed(targets) -> dict[str, dict[int, str]]:
    """model -> version -> target path of its ``.sig``, from the trusted targets."""
    out: dict[str, dict[int, str]] = {}
    for path, t in targets.targets.items():
        c = t.custom if isinstance(t.custom, dict) else {}
        if "model" in c and "version" in c:
            out.setdefault(str(c["model"]), {})[int(c["version"])] = path
    return out


def _matches(target, path: Path) -> bool:
    from tuf.api import exceptions

    try:
        with open(path, "rb") as f:
            target.verify_length_and_hashes(f)
        return True
    except (OSError, exceptions.LengthOrHashMismatchError):
        return False


def _check_version(targets, model_dir: Path, version: int, release: int) -> list[str]:
    """The signature files of one version on disk against the release."""
    problems = []
    for sig in (layout.signature_path(model_dir, version), layout.provenance_path(model_dir, version)):
        name = f"{model_dir.name}/{sig.name}"
        target = targets.targets.get(name)
        if not os.path.lexists(sig):
            if target is not None:
                problems.append(f"release {release} lists {name} but it is missing: held back or removed. "
                                "Fix: restore it from the release")
            continue
        if target is None:
            problems.append(f"mix-and-match attack: {name} (version {version}) is not part of release {release}: it "
                            "comes from another release or was never released. Fix: remove it, or publish a release "
                            "that includes it (model-factory release add)")
        elif not _matches(target, sig):
            problems.append(f"mix-and-match attack: {name} is not the signature release {release} lists: version "
                            f"{version} comes from another release. Fix: restore the released files, or publish a "
                            "new release")
    return problems


def _floors(state: Path) -> dict[str, int]:
    try:
        data = json.loads((state / "floors.json").read_text())
        return {str(k): int(v) for k, v in data.get("models", {}).items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as exc:
        raise FactoryError(f"the trusted release state {state / 'floors.json'} is damaged ({exc}). Fix: restore it "
                           "from a backup; deleting it makes this verifier as trusting as a fresh one") from None


def _model_rollbacks(listed: dict[str, dict[int, str]], floors: dict[str, int], release: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for model, versions in listed.items():
        newest, trusted = max(versions), floors.get(model, 0)
        if newest < trusted:
            out[model] = [f"rollback attack: release {release} lists {model} version {newest}, older than version "
                          f"{trusted} already trusted here. Fix: publish the older model again as a new, higher "
                          "version number, or restore the newer version in a new release"]
    return out


def _save_floors(state: Path, listed: dict[str, dict[int, str]], floors: dict[str, int], release: int) -> None:
    new = dict(floors)
    for model, versions in listed.items():
        new[model] = max(new.get(model, 0), max(versions))
    if new != floors or not (state / "floors.json").exists():
        with atomic_file(state / "floors.json") as f:
            f.write(json.dumps({"release": release, "models": new}, indent=2, sort_keys=True))


def _trusted_release(folder: Path, rule: ReleaseRule):
    """Targets of the trusted release from ``folder`` plus model floors; or (None, problem)."""
    targets, problem = _refresh(folder, rule)
    if problem:
        return None, {}, {}, problem
    if targets.version < rule.min_version:
        return None, {}, {}, (f"rollback attack: release {targets.version} is below the floor of the trust policy "
                              f"(min_version = {rule.min_version}): an older, validly signed release was put back. "
                              "Fix: restore the newest release; raise the floor with each release you must never "
                              "go back from")
    listed = _listed(targets)
    floors = _floors(rule.state_dir)
    return targets, listed, floors, None


def verify_release(repo: Path, policy: TrustPolicy) -> ReleaseVerdict:
    """Check ``repo``'s release metadata against the policy's ``[release]`` and its trusted state, then
    every model version on disk against the release. Updates the trusted state (newer metadata, floors)."""
    rule = policy.release
    if rule is None:
        raise FactoryError("the trust policy has no [release] section. Fix: add one (docs/releases.md)")
    repo = Path(repo)
    with _locked(rule.state_dir):
        targets, listed, floors, problem = _trusted_release(release_dir(repo), rule)
        if problem:
            return ReleaseVerdict(None, (problem,))
        release = targets.version
        by_model: dict[str, list[str]] = _model_rollbacks(listed, floors, release)
        seen: set[tuple[str, int]] = set()
        for model_dir in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")):
            entries = layout.model_entries(model_dir)
            versions = sorted(set(entries.versions) | set(entries.signed_versions))
            if model_dir.name not in listed and versions:
                by_model.setdefault(model_dir.name, []).append(
                    f"mix-and-match attack: model {model_dir.name} is not part of release {release}: it comes from "
                    "another release or was never released. Fix: remove it, or publish a release that includes it")
                continue
            for v in versions:
                seen.add((model_dir.name, v))
                by_model.setdefault(model_dir.name, []).extend(_check_version(targets, model_dir, v, release))
        # Held back: a listed version absent while an older version of the model is here, so the older one would be
        # served. Older versions may be retired (a pulled repository holds the version it serves; a repository may
        # be pruned), and a model absent altogether is simply not served (a pod may serve a subset of a release).
        newest_here = {m: max((v for mm, v in seen if mm == m), default=None) for m in listed}
        missing = sorted((m, v) for m, vs in listed.items() for v in vs
                         if newest_here[m] is not None and v > newest_here[m])
        for m, v in missing:
            by_model.setdefault(m, []).append(f"release {release} lists {m} version {v} but the repository lacks it: "
                                              "held back or removed. Fix: restore it from the release")
        _save_floors(rule.state_dir, {m: vs for m, vs in listed.items() if m not in by_model or
                                      not any(p.startswith("rollback") for p in by_model[m])}, floors, release)
    return ReleaseVerdict(release, (), {m: tuple(ps) for m, ps in by_model.items() if ps}, tuple(missing))


def check_release(repo: Path, policy: TrustPolicy, results: list) -> list:
    """``results`` of ``verify_repository`` with the release check folded in (unchanged without ``[release]``).

    A problem with the release metadata fails every model version; a problem with one model fails
    that model's versions; a listed version missing from disk is added as a failed result. The one
    call ``verify`` and ``serve`` make.
    """
    if policy.release is None:
        return results
    from model_factory.signing.verify import VerificationResult

    verdict = verify_release(repo, policy)
    out = []
    for r in results:
        extra = verdict.problems + verdict.by_model.get(r.model, ())
        out.append(dataclasses.replace(r, ok=False, reasons=r.reasons + extra) if extra else r)
    have = {(r.model, r.version) for r in results}
    out += [VerificationResult(m, v, False, verdict.by_model[m], None, 0) for m, v in verdict.missing
            if (m, v) not in have]
    return out


def verify_release_files(metadata_dir: Path, model_dir: Path, version: int, policy: TrustPolicy,
                         state_dir: Path | None = None) -> ReleaseVerdict:
    """Check one model version against release metadata shipped beside it (e.g. an OCI artifact's layer).

    ``metadata_dir`` holds the files of :func:`~model_factory.signing.release.release_files`;
    ``model_dir`` the model folder with ``<version>.sig``. The version must be in the trusted release
    with the same signature bytes, and not older than the model's trusted floor. ``state_dir``
    overrides the policy's (the same state should serve a whole machine).
    """
    rule = policy.release
    if rule is None:
        raise FactoryError("the trust policy has no [release] section. Fix: add one (docs/releases.md)")
    if state_dir is not None:
        rule = dataclasses.replace(rule, state_dir=Path(state_dir))
    model_dir, model = Path(model_dir), Path(model_dir).name
    with _locked(rule.state_dir):
        targets, listed, floors, problem = _trusted_release(Path(metadata_dir), rule)
        if problem:
            return ReleaseVerdict(None, (problem,))
        release = targets.version
        problems = _model_rollbacks(listed, floors, release).get(model, [])
        if int(version) not in listed.get(model, {}):
            problems.append(f"mix-and-match attack: {model} version {version} is not part of release {release}. "
                            "Fix: pull the artifact of the current release, or publish a release that includes it")
        else:
            problems += _check_version(targets, model_dir, int(version), release)
        if not problems:
            _save_floors(rule.state_dir, {model: listed[model]}, floors, release)
    return ReleaseVerdict(release, (), {model: tuple(problems)} if problems else {})
