"""Signed releases through a real registry: push attaches ``.release/``, pull runs the TUF check before DEST changes.

Small generated models signed by our own ``sign``, real python-tuf metadata signed with real ECDSA
keys, the session's Distribution 2.8 registry (TLS + htpasswd). The trusted release state is a
folder on disk, reused across pulls as one machine (or a shared state volume) would.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric import ec

from model_factory.cli.main import main
from model_factory.distribution import modelpack as mp
from model_factory.distribution.oci_layout import OCI_INDEX, descriptor
from model_factory.distribution.push_pull import _install_release, attach, pull, push
from model_factory.errors import FactoryError
from model_factory.signing import SignerConfig, sign_model_version
from model_factory.signing.release import KeyFile, add_release, init_release, refresh_timestamp, release_files
from test_push_pull import snapshot, target

sys.path.insert(0, str(Path(__file__).parents[1] / "signing"))
from signing_helpers import build_model, write_key, write_pub  # noqa: E402

pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")


@pytest.fixture(scope="module")
def release_keys(tmp_path_factory) -> tuple[dict[str, KeyFile], dict[str, Path]]:
    d = tmp_path_factory.mktemp("oci-release-keys")
    keys, pubs = {}, {}
    for label in ("root", "targets", "online"):
        k = ec.generate_private_key(ec.SECP256R1())
        keys[label] = KeyFile(write_key(k, d / f"{label}.pem"))
        pubs[label] = write_pub(k, d / f"{label}.pub")
    return keys, pubs


@dataclass
class Factory:
    """A repository with model ``enc`` and signed releases, and the trust policies a fleet would use."""

    repo: Path
    keys: dict[str, KeyFile]
    signer: SignerConfig
    signer_pub: Path
    folder: Path

    def release(self) -> int:
        return add_release(self.repo, [self.keys["targets"]], [self.keys["online"]], [self.keys["online"]])

    def new_version(self, version: int) -> None:
        build_model(self.repo / "enc", (version,))
        sign_model_version(self.repo / "enc", version, self.signer)

    def policy(self, state: str = "state") -> Path:
        trust = self.folder / "trust"
        trust.mkdir(exist_ok=True)
        shutil.copy(self.repo / ".release" / "1.root.json", trust / "release-root.json")
        path = trust / f"policy-{state}.toml"
        path.write_text(f'version = 1\n[[keys]]\nname = "release"\npath = "{self.signer_pub}"\n'
                        f'[release]\nroot = "release-root.json"\nstate_dir = "{self.folder / state}"\n'
                        "min_version = 1\n")
        return path


@pytest.fixture
def factory(tmp_path, oci_keys, release_keys) -> Factory:
    """``enc`` version 1, signed, in release 1."""
    keys, pubs = release_keys
    repo = tmp_path / "repo"
    f = Factory(repo, keys, SignerConfig(oci_keys["trusted"][0]), oci_keys["trusted"][1], tmp_path)
    f.new_version(1)
    init_release(repo, [keys["root"]], {"targets": [pubs["targets"]], "snapshot": [pubs["online"]],
                                        "timestamp": [pubs["online"]]})
    assert f.release() == 1
    return f


def refused(ref: str, dest: Path, policy: Path, reg_options, match: str, **kw) -> None:
    before = snapshot(dest)
    with pytest.raises(FactoryError, match=match) as info:
        pull(ref, dest, policy, options=reg_options, **kw)
    assert "\n" not in str(info.value) and "Fix:" in str(info.value)
    assert snapshot(dest) == before  # DEST untouched (or still absent)


def test_honest_pull_then_a_repointed_tag_is_refused_as_a_rollback(registry, factory, oci_keys, reg_options,
                                                                   tmp_path):
    base = f"oci://{registry.host}/rel1/enc"
    old = push(factory.repo, "enc", f"{base}:1", options=reg_options)
    release_1 = tmp_path / "release-1"
    release_1.mkdir()
    for p in release_files(factory.repo):
        shutil.copy(p, release_1 / p.name)
    assert set(old.referrers) == {"signature", "release"}  # .release/ attached without a flag
    # Version 2 fixes a defect of version 1; release 2 lists version 2 only (version 1 retired).
    factory.new_version(2)
    shutil.rmtree(factory.repo / "enc" / "1")
    (factory.repo / "enc" / "1.sig").unlink()
    assert factory.release() == 2
    for tag in ("2", "stable"):
        push(factory.repo, "enc", f"{base}:{tag}", options=reg_options)

    # The honest pull, through the CLI with --release-state: release 2 is now trusted here.
    policy, state, dest = factory.policy(state="unused"), tmp_path / "node-state", tmp_path / "dest"
    r = CliRunner().invoke(main, [
        "pull", f"{base}:stable", str(dest), "--policy", str(policy), "--release-state", str(state),
        "--registry-config", str(registry.config), "--ca-file", str(registry.ca)])
    assert r.exit_code == 0, r.output
    assert snapshot(dest / "enc") == snapshot(factory.repo / "enc")
    assert json.loads((state / "floors.json").read_text())["models"] == {"enc": 2}
    assert not (tmp_path / "unused").exists()
    # The release came along: the same [release] policy (with this machine's state) verifies DEST, as serve does.
    assert snapshot(dest / ".release") == snapshot(factory.repo / ".release")
    r = CliRunner().invoke(main, ["verify", str(dest), "--policy", str(factory.policy(state="node-state"))])
    assert r.exit_code == 0, r.output
    # An older release's files (another model pulled later from it) never replace the newer one in DEST.
    _install_release(sorted(release_1.iterdir()), dest)
    assert snapshot(dest / ".release") == snapshot(factory.repo / ".release")
    before = snapshot(dest)

    # Someone with push rights re-points `stable` to the older, validly signed version 1; its release 1
    # metadata (validly signed too) is still attached to it. The TUF layer refuses it as a rollback ...
    t = target(registry, "rel1/enc", reg_options)
    old_manifest = t.get_manifest(old.digest)[0]
    t.put_manifest(old_manifest, mp.OCI_MANIFEST, "stable")
    refused(f"{base}:stable", dest, policy, reg_options, "rollback attack", release_state=state)
    # ... also for a brand-new DEST sharing the state (a new pod on the state volume), where the tag and
    # version checks alone let it through:
    refused(f"{base}:stable", tmp_path / "new-pod", policy, reg_options, "rollback attack", release_state=state)
    assert pull(f"{base}:stable", tmp_path / "no-release", oci_keys["policy"], options=reg_options).version == 1
    r = CliRunner().invoke(main, [
        "pull", f"{base}:stable", str(dest), "--policy", str(policy), "--release-state", str(state),
        "--registry-config", str(registry.config), "--ca-file", str(registry.ca)])
    assert r.exit_code == 1 and "Traceback" not in r.output and "rollback attack" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output

    # Release 2's metadata re-attached to version 1: release 2 does not list version 1.
    subject = descriptor(mp.OCI_MANIFEST, old.digest, len(old_manifest))
    attach(t, subject, mp.RELEASE_TYPE, "release", [(p.name, mp.file_blob(p), "application/json")
                                                     for p in release_files(factory.repo)])
    refused(f"{base}:stable", dest, policy, reg_options, "mix-and-match attack.*version 1 is not part of release 2",
            release_state=state)
    assert snapshot(dest) == before


def test_expired_timestamp_is_refused_as_a_freeze(registry, factory, reg_options, tmp_path):
    ref = f"oci://{registry.host}/rel2/enc:1"
    # Nobody re-signed the timestamp: the one pushed was signed two days ago and lived one.
    two_days_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2)
    refresh_timestamp(factory.repo, [factory.keys["online"]], now=two_days_ago)
    push(factory.repo, "enc", ref, options=reg_options)
    refused(ref, tmp_path / "dest", factory.policy(), reg_options, "freeze attack")
    # The fix: re-sign the timestamp and push again (the release referrer is replaced).
    refresh_timestamp(factory.repo, [factory.keys["online"]])
    push(factory.repo, "enc", ref, options=reg_options)
    assert pull(ref, tmp_path / "dest", factory.policy(), options=reg_options).version == 1


def test_missing_release_referrer_is_refused(registry, factory, reg_options, tmp_path):
    ref = f"oci://{registry.host}/rel3/enc:1"
    pushed = push(factory.repo, "enc", ref, options=reg_options)
    t = target(registry, "rel3/enc", reg_options)
    tag = pushed.digest.replace(":", "-")
    index = json.loads(t.get_manifest(tag)[0])
    index["manifests"] = [m for m in index["manifests"] if m["annotations"][mp.ROLE] != "release"]
    t.put_manifest(json.dumps(index).encode(), OCI_INDEX, tag)
    refused(ref, tmp_path / "dest", factory.policy(), reg_options, "no release metadata attached.*release add")
    assert not (tmp_path / "state").exists()  # refused before any release state was touched


def test_push_refuses_a_version_outside_the_release_and_state_needs_a_release_policy(factory, oci_keys, tmp_path):
    factory.new_version(2)  # signed, but no release lists it yet
    with pytest.raises(FactoryError, match="not in the repository's signed release.*release add"):
        push(factory.repo, "enc", f"oci-layout:{tmp_path / 'usb'}:2")
    assert not (tmp_path / "usb").exists()
    with pytest.raises(FactoryError, match=r"no \[release\] section"):
        pull(f"oci-layout:{tmp_path / 'usb'}:2", tmp_path / "dest", oci_keys["policy"], release_state=tmp_path / "s")
