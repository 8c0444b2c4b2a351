"""Signed releases (TUF): one test per attack, each refused with a message naming it; honest updates pass.

Real python-tuf metadata signed with real ECDSA keys over a repository signed by our own
``sign``; the verifier is ``verify_repository`` + ``check_release`` with a state dir on disk, as
``verify`` and ``serve`` run it.
"""

from __future__ import annotations

import datetime as dt
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from model_factory.errors import FactoryError
from model_factory.signing import SignerConfig, load_policy, sign_model_version, sign_repository, verify_repository
from model_factory.signing.release import (KeyFile, add_release, describe_release, init_release, refresh_timestamp,
                                           release_files, rotate_root)
from model_factory.signing.release_check import check_release, verify_release_files

from signing_helpers import build_model, write_key, write_pub

pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")

ROLE_KEYS = ("root_a", "root_b", "root_new", "targets_a", "targets_b", "snapshot", "timestamp")


@dataclass
class Release:
    repo: Path
    keys: dict[str, KeyFile]
    pubs: dict[str, Path]
    signer: SignerConfig
    folder: Path

    def policy(self, state: str = "state", min_version: int = 1, root: Path | None = None) -> Path:
        trust = self.folder / "trust"
        trust.mkdir(exist_ok=True)
        shutil.copy(root or self.repo / ".release" / "1.root.json", trust / "release-root.json")
        path = trust / f"policy-{state}-{min_version}.toml"
        path.write_text(f'version = 1\n[[keys]]\nname = "release"\npath = "{self.signer_pub}"\n'
                        f'[release]\nroot = "release-root.json"\nstate_dir = "{self.folder / state}"\n'
                        f"min_version = {min_version}\n")
        return path

    signer_pub: Path = Path()

    def add(self, **kw) -> int:
        kw.setdefault("targets_keys", [self.keys["targets_a"]])
        return add_release(self.repo, snapshot_keys=[self.keys["snapshot"]], timestamp_keys=[self.keys["timestamp"]],
                           **kw)


def check(repo: Path, policy: Path) -> list:
    """What ``verify`` reports: every model version, with the release check folded in."""
    trust = load_policy(policy)
    return check_release(repo, trust, verify_repository(repo, trust))


def reasons(results: list) -> str:
    return " | ".join(r for res in results for r in res.reasons)


def assert_ok(results: list) -> None:
    assert all(r.ok for r in results), reasons(results)


@pytest.fixture(scope="module")
def role_keys(tmp_path_factory) -> tuple[dict[str, KeyFile], dict[str, Path]]:
    d = tmp_path_factory.mktemp("release-keys")
    keys, pubs = {}, {}
    for label in ROLE_KEYS:
        k = ec.generate_private_key(ec.SECP256R1())
        keys[label] = KeyFile(write_key(k, d / f"{label}.pem"))
        pubs[label] = write_pub(k, d / f"{label}.pub")
    return keys, pubs


@pytest.fixture
def rel(tmp_path, keys, role_keys) -> Release:
    """A repository (encoder v1, ranker v3) signed, with release root 1 (root threshold 2) and release 1."""
    repo = tmp_path / "repo"
    build_model(repo / "encoder", (1,))
    build_model(repo / "ranker", (3,))
    signer = SignerConfig(keys["trusted"].private)
    sign_repository(repo, signer)
    k, p = role_keys
    init_release(repo, [k["root_a"], k["root_b"]],
                 {"targets": [p["targets_a"]], "snapshot": [p["snapshot"]], "timestamp": [p["timestamp"]]})
    r = Release(repo, k, p, signer, tmp_path)
    r.signer_pub = keys["trusted"].public
    assert r.add() == 1
    return r


def new_version(r: Release, model: str, version: int) -> None:
    build_model(r.repo / model, (version,))
    sign_model_version(r.repo / model, version, r.signer)


# --------------------------------------------------------------------------- the honest path


def test_honest_releases_timestamps_and_root_rotation_pass(rel: Release) -> None:
    policy = rel.policy()
    assert_ok(check(rel.repo, policy))
    new_version(rel, "encoder", 2)
    assert rel.add() == 2
    assert_ok(check(rel.repo, policy))
    refresh_timestamp(rel.repo, [rel.keys["timestamp"]])
    assert_ok(check(rel.repo, policy))
    # Root 2: new root key, signed by both old root keys and the new one; the next release passes.
    rotate_root(rel.repo, [rel.keys["root_a"], rel.keys["root_b"]], [rel.keys["root_new"]])
    assert rel.add() == 3
    assert_ok(check(rel.repo, policy))
    # A restarted verifier (same state dir) and a fresh one (empty state, floor 3) both accept it.
    assert_ok(check(rel.repo, policy))
    assert_ok(check(rel.repo, rel.policy(state="fresh", min_version=3)))
    info = describe_release(rel.repo)
    assert (info.release, info.root_version, info.models) == (3, 2, {"encoder": [1, 2], "ranker": [3]})
    assert (rel.folder / "state" / "root_history" / "2.root.json").is_file()


def test_older_versions_may_be_retired_but_the_newest_may_not_be_held_back(rel: Release) -> None:
    policy = rel.policy()
    new_version(rel, "encoder", 2)
    assert rel.add() == 2  # lists encoder 1 and 2
    aside = rel.folder / "aside"
    aside.mkdir()
    # Version 1 retired (a pulled repository holds only the version it serves): version 2 is what the release asks.
    for path in (rel.repo / "encoder" / "1", rel.repo / "encoder" / "1.sig"):
        shutil.move(path, aside / path.name)
    assert_ok(check(rel.repo, policy))
    # Version 2 held back (version 1 put back in its place): refused.
    for name in ("1", "1.sig"):
        shutil.move(aside / name, rel.repo / "encoder" / name)
    for path in (rel.repo / "encoder" / "2", rel.repo / "encoder" / "2.sig"):
        shutil.move(path, aside / path.name)
    results = check(rel.repo, policy)
    assert not [r for r in results if r.model == "encoder" and r.ok]
    assert "release 2 lists encoder version 2 but the repository lacks it: held back" in reasons(results)
    assert all(r.ok for r in results if r.model == "ranker")
    # A listed model absent altogether is not served, and does not fail the others (a pod serving a subset).
    shutil.rmtree(rel.repo / "ranker")
    results = check(rel.repo, policy)
    assert {r.model for r in results} == {"encoder"} and "ranker" not in reasons(results)


# --------------------------------------------------------------------------- one test per attack


def test_rollback_to_an_older_release_is_refused(rel: Release) -> None:
    policy = rel.policy()
    assert_ok(check(rel.repo, policy))
    old = rel.folder / "release-1-copy"
    shutil.copytree(rel.repo, old)
    new_version(rel, "encoder", 2)
    rel.add()
    assert_ok(check(rel.repo, policy))
    # The attacker puts the whole older repository back: signatures, files and metadata all valid.
    shutil.rmtree(rel.repo)
    shutil.copytree(old, rel.repo)
    results = check(rel.repo, policy)
    assert not any(r.ok for r in results)
    assert "rollback attack" in reasons(results) and "Fix:" in reasons(results)
    # A brand-new verifier has no state: the policy's floor refuses it.
    fresh = check(rel.repo, rel.policy(state="fresh", min_version=2))
    assert not any(r.ok for r in fresh) and "below the floor" in reasons(fresh)


def test_a_release_with_an_older_model_version_is_refused(rel: Release) -> None:
    policy = rel.policy()
    new_version(rel, "encoder", 2)
    rel.add()
    assert_ok(check(rel.repo, policy))
    # A newer, validly signed release that puts encoder back to version 1.
    shutil.rmtree(rel.repo / "encoder" / "2")
    (rel.repo / "encoder" / "2.sig").unlink()
    rel.add()
    results = {(r.model, r.version): r for r in check(rel.repo, policy)}
    assert not results[("encoder", 1)].ok and results[("ranker", 3)].ok
    assert "rollback attack" in " ".join(results[("encoder", 1)].reasons)
    assert "version 1, older than version 2" in " ".join(results[("encoder", 1)].reasons)


def test_expired_timestamp_is_refused_as_a_freeze(rel: Release) -> None:
    policy = rel.policy()
    assert_ok(check(rel.repo, policy))
    # Nobody re-signed the timestamp: the last one expired (signed two days ago, lived one).
    refresh_timestamp(rel.repo, [rel.keys["timestamp"]], now=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2))
    results = check(rel.repo, policy)
    assert not any(r.ok for r in results) and "freeze attack" in reasons(results)
    # Re-signing the timestamp is the fix.
    refresh_timestamp(rel.repo, [rel.keys["timestamp"]])
    assert_ok(check(rel.repo, policy))


def test_models_mixed_from_two_releases_are_refused(rel: Release) -> None:
    policy = rel.policy()
    release1 = rel.folder / "release-1-copy"
    shutil.copytree(rel.repo, release1)
    (rel.repo / "ranker" / "3" / "metadata.json").write_text('{"version": 3, "fixed": true}')
    sign_model_version(rel.repo / "ranker", 3, rel.signer)
    rel.add()
    assert_ok(check(rel.repo, policy))
    # Release 2's metadata with ranker 3 from release 1 (validly signed, but another release's).
    shutil.rmtree(rel.repo / "ranker")
    shutil.copytree(release1 / "ranker", rel.repo / "ranker")
    results = {(r.model, r.version): r for r in check(rel.repo, policy)}
    assert results[("encoder", 1)].ok and not results[("ranker", 3)].ok
    assert "mix-and-match attack" in " ".join(results[("ranker", 3)].reasons)
    # A model no release lists is refused the same way.
    build_model(rel.repo / "stranger", (1,))
    sign_model_version(rel.repo / "stranger", 1, rel.signer)
    stranger = [r for r in check(rel.repo, policy) if r.model == "stranger"]
    assert stranger and "mix-and-match attack" in reasons(stranger)


def test_metadata_mixed_from_two_releases_is_refused(rel: Release, tmp_path: Path) -> None:
    old_targets = (rel.repo / ".release" / "targets.json").read_bytes()
    new_version(rel, "encoder", 2)
    rel.add()
    (rel.repo / ".release" / "targets.json").write_bytes(old_targets)
    results = check(rel.repo, rel.policy())
    assert not any(r.ok for r in results) and "mix-and-match attack" in reasons(results)


def test_metadata_below_the_threshold_is_refused(tmp_path, keys, role_keys) -> None:
    k, p = role_keys
    repo = tmp_path / "repo"
    build_model(repo / "encoder", (1,))
    signer = SignerConfig(keys["trusted"].private)
    sign_repository(repo, signer)
    init_release(repo, [k["root_a"]], {"targets": [p["targets_a"], p["targets_b"]], "snapshot": [p["snapshot"]],
                                       "timestamp": [p["timestamp"]]}, thresholds={"targets": 2})
    r = Release(repo, k, p, signer, tmp_path, signer_pub=keys["trusted"].public)
    r.add(targets_keys=[k["targets_a"]])  # one of the two targets keys
    results = check(repo, r.policy())
    assert not any(x.ok for x in results) and "below threshold" in reasons(results)
    assert "targets" in reasons(results)
    r.add(targets_keys=[k["targets_a"], k["targets_b"]])
    assert_ok(check(repo, r.policy()))


def test_root_rotation_not_signed_by_the_old_root_is_refused(rel: Release) -> None:
    policy = rel.policy()
    assert_ok(check(rel.repo, policy))
    # The attacker writes root 2 with their own key, signed by it alone, and re-signs everything.
    rotate_root(rel.repo, [], [rel.keys["root_new"]], role_keys={"targets": [rel.pubs["targets_b"]]})
    rel.add(targets_keys=[rel.keys["targets_b"]])
    results = check(rel.repo, policy)
    assert not any(r.ok for r in results) and "bad root rotation" in reasons(results)
    assert "2.root.json" in reasons(results)
    # A verifier that never saw root 1 is not fooled either: it starts from the policy's root.
    fresh = check(rel.repo, rel.policy(state="fresh"))
    assert not any(r.ok for r in fresh) and "bad root rotation" in reasons(fresh)


# --------------------------------------------------------------------------- the API for artifacts


def test_release_files_verify_one_version_elsewhere(rel: Release, tmp_path: Path) -> None:
    shipped = tmp_path / "artifact-release"
    shipped.mkdir()
    for f in release_files(rel.repo):
        shutil.copy(f, shipped / f.name)
    assert sorted(p.name for p in shipped.iterdir()) == ["1.root.json", "snapshot.json", "targets.json",
                                                        "timestamp.json"]
    trust = load_policy(rel.policy())
    verdict = verify_release_files(shipped, rel.repo / "encoder", 1, trust, state_dir=tmp_path / "oci-state")
    assert verdict.ok and verdict.release == 1, verdict.all_problems()
    bad = verify_release_files(shipped, rel.repo / "encoder", 7, trust, state_dir=tmp_path / "oci-state")
    assert not bad.ok and "mix-and-match attack" in " ".join(bad.all_problems())


def test_policy_release_section_is_validated(tmp_path, rel: Release) -> None:
    path = rel.policy()
    path.write_text(path.read_text().replace("min_version = 1", "min_version = 0"))
    with pytest.raises(FactoryError, match="release.min_version"):
        load_policy(path)


def test_a_repository_without_release_metadata_is_refused(rel: Release) -> None:
    policy = rel.policy()
    shutil.rmtree(rel.repo / ".release")
    results = check(rel.repo, policy)
    assert not any(r.ok for r in results)
    assert "no usable release metadata" in reasons(results) and "release add" in reasons(results)


def test_a_policy_root_that_is_not_a_release_root_is_refused(rel: Release, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus-root.json"
    bogus.write_text('{"signed": {"_type": "root"}, "signatures": []}')
    results = check(rel.repo, rel.policy(root=bogus))
    assert not any(r.ok for r in results) and "not a valid, self-signed TUF root" in reasons(results)


def test_add_refuses_unsigned_or_failing_versions(rel: Release) -> None:
    build_model(rel.repo / "encoder", (2,))  # not signed
    with pytest.raises(FactoryError, match="encoder version 2 has no signature"):
        rel.add()
    sign_model_version(rel.repo / "encoder", 2, rel.signer)
    (rel.repo / "encoder" / "2" / "model.onnx").write_bytes(b"changed after signing")
    with pytest.raises(FactoryError, match="refusing to release versions that do not verify"):
        rel.add(policy=load_policy(rel.policy()))
