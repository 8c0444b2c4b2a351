"""Round trips with the installed OpenSSF model_signing 1.1.1, in key and certificate modes.

The unit model_signing signs is the model folder ``<repo>/<model>``; with
several versions, the other version folders and the signature files are
ignored paths. Our bundles record exactly those, so model_signing verifies
them with no extra option.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_factory.signing import SignerConfig, load_policy, sign_model_version, sign_repository, verify_repository

model_signing = pytest.importorskip("model_signing", reason="model-signing is not installed (extra: sign)")
pytest.importorskip("OpenSSL", reason="model_signing's certificate mode needs pyopenssl (extra: sign)")


def ms_verify_key(model_dir: Path, version: int, public_key: Path) -> None:
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public_key).verify(
        model_dir, model_dir / f"{version}.sig")


def ms_verify_cert(model_dir: Path, version: int, root: Path) -> None:
    model_signing.verifying.Config().use_certificate_verifier(certificate_chain=[root]).verify(
        model_dir, model_dir / f"{version}.sig")


def ms_hashing(ignore: list[str], shard_size: int | None = None):
    config = model_signing.hashing.Config()
    if shard_size:
        config = config.use_shard_serialization(shard_size=shard_size)
    return config.set_ignored_paths(paths=ignore, ignore_git_paths=True)


def test_model_signing_verifies_our_key_bundles(repo, keys):
    sign_repository(repo, SignerConfig(keys["trusted"].private))
    for v in (1, 2):
        ms_verify_key(repo / "encoder", v, keys["trusted"].public)
    ms_verify_key(repo / "ranker", 3, keys["trusted"].public)
    # And it sees tampering in our bundles' coverage too.
    (repo / "encoder" / "1" / "model.onnx").write_bytes(b"tampered")
    with pytest.raises(ValueError, match="Hash mismatch for '1/model.onnx'"):
        ms_verify_key(repo / "encoder", 1, keys["trusted"].public)
    with pytest.raises(ValueError, match="Key mismatch"):
        ms_verify_key(repo / "encoder", 2, keys["other"].public)


def test_model_signing_verifies_our_p384_bundle(repo, keys):
    sign_model_version(repo / "ranker", 3, SignerConfig(keys["trusted384"].private))
    ms_verify_key(repo / "ranker", 3, keys["trusted384"].public)


def test_model_signing_verifies_our_p521_bundle(repo, tmp_path):
    # P-521 (with SHA-512) is a key type OMS v1.0's algorithm registry requires.
    from model_factory.signing import generate_keypair
    paths = generate_keypair(tmp_path / "k521", "P-521")
    sign_model_version(repo / "ranker", 3, SignerConfig(paths.private_key))
    ms_verify_key(repo / "ranker", 3, paths.public_key)


def test_model_signing_verifies_our_certificate_bundles(repo, pki):
    sign_repository(repo, SignerConfig(pki.good.key, None, pki.good.chain))
    for v in (1, 2):
        ms_verify_cert(repo / "encoder", v, pki.root)
    with pytest.raises(Exception):
        ms_verify_cert(repo / "encoder", 1, pki.other_ca_root)


def test_model_signing_cli_verifies_our_bundle(repo, keys):
    sign_model_version(repo / "encoder", 2, SignerConfig(keys["trusted"].private))
    cli = Path(sys.executable).with_name("model_signing")
    if not cli.exists():
        pytest.skip("the model_signing command is not installed next to this Python")
    model = repo / "encoder"
    proc = subprocess.run([str(cli), "verify", "key", str(model), "--signature", str(model / "2.sig"),
                           "--public_key", str(keys["trusted"].public)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "Verification succeeded" in proc.stdout


def test_we_verify_model_signing_key_bundles(repo, keys, key_policy):
    signer = model_signing.signing.Config().use_elliptic_key_signer(private_key=keys["trusted"].private)
    # Each version ignores the other versions and every signature file (the unit's rule).
    for model, version, ignore in (("encoder", 1, ["2", "1.sig", "2.sig"]), ("encoder", 2, ["1", "1.sig", "2.sig"]),
                                   ("ranker", 3, ["3.sig"])):
        model_dir = repo / model
        signer.set_hashing_config(ms_hashing(ignore)).sign(model_dir, model_dir / f"{version}.sig")
    results = verify_repository(repo, load_policy(key_policy()))
    assert [(r.model, r.version, r.ok, r.signer) for r in results] == [
        ("encoder", 1, True, "key:release"), ("encoder", 2, True, "key:release"), ("ranker", 3, True, "key:release")]
    (repo / "encoder" / "1" / "model.py").write_text("changed\n")
    bad = {(r.model, r.version): r for r in verify_repository(repo, load_policy(key_policy()))}[("encoder", 1)]
    assert not bad.ok and bad.reasons[0].startswith("file 1/model.py changed")


def test_we_verify_model_signing_certificate_bundles(repo, pki, ca_policy):
    signer = model_signing.signing.Config().use_certificate_signer(
        private_key=pki.good.key, signing_certificate=pki.good.cert, certificate_chain=[pki.intermediate])
    model_dir = repo / "encoder"
    signer.set_hashing_config(ms_hashing(["2", "1.sig"])).sign(model_dir, model_dir / "1.sig")
    results = {(r.model, r.version): r for r in verify_repository(repo, load_policy(ca_policy()))}
    assert results[("encoder", 1)].ok, results[("encoder", 1)].reasons
    assert results[("encoder", 1)].signer == "cert:CN=model-factory release,O=Example Corp"
    assert results[("encoder", 2)].reasons[0].startswith("unsigned")


def test_we_verify_model_signing_shard_bundles(repo, keys, key_policy):
    model_dir = repo / "ranker"
    # model_signing's shard mode gives an empty file no shard: give the empty one content.
    (model_dir / "3" / "mf_backend" / "__init__.py").write_text("# package\n")
    (model_dir / "3" / "model.onnx").write_bytes(os.urandom(3 * 4096 + 5))
    (model_dir / "3" / "empty.txt").write_bytes(b"")
    (model_dir / "3" / "empty.txt").unlink()
    signer = model_signing.signing.Config().use_elliptic_key_signer(private_key=keys["trusted"].private)
    signer.set_hashing_config(ms_hashing(["3.sig"], shard_size=4096)).sign(model_dir, model_dir / "3.sig")
    policy = load_policy(key_policy())
    result = {(r.model, r.version): r for r in verify_repository(repo, policy)}[("ranker", 3)]
    assert result.ok, result.reasons
    # A changed byte in the third shard, and an empty file the shard mode cannot cover.
    with open(model_dir / "3" / "model.onnx", "r+b") as f:
        f.seek(2 * 4096 + 1)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    (model_dir / "3" / "py.typed").write_bytes(b"")
    result = {(r.model, r.version): r for r in verify_repository(repo, policy)}[("ranker", 3)]
    assert result.reasons == (
        "empty file 3/py.typed is not covered by the signature (per-shard signatures cannot cover empty files). "
        "Fix: re-sign with model-factory sign (per-file)",
        "file 3/model.onnx changed: its shard digests differ from the signed ones")


def test_signer_ignore_paths_are_not_trusted(repo, keys, key_policy):
    # A signer (or an attacker who re-signs with a stolen config) hides a file with ignore_paths:
    # model_signing honours the bundle's list at verify time; we do not.
    model_dir = repo / "ranker"
    (model_dir / "3" / "mf_backend" / "hook.py").write_text("import os\n")
    signer = model_signing.signing.Config().use_elliptic_key_signer(private_key=keys["trusted"].private)
    signer.set_hashing_config(ms_hashing(["3.sig", "3/mf_backend/hook.py"])).sign(model_dir, model_dir / "3.sig")
    (model_dir / "3" / "mf_backend" / "hook.py").write_text("import os; os.system('curl evil')\n")
    ms_verify_key(model_dir, 3, keys["trusted"].public)  # model_signing: fine
    result = {(r.model, r.version): r for r in verify_repository(repo, load_policy(key_policy()))}[("ranker", 3)]
    assert result.reasons == ("file 3/mf_backend/hook.py is left out of the signature by its ignore_paths, but Triton "
                              "can load it; model-factory does not trust unsigned files of a model version. Fix: "
                              "re-sign without ignoring it (model-factory sign)",)


def test_expired_leaf_model_signing_accepts_we_refuse(repo, pki, ca_policy):
    model_dir = repo / "ranker"
    signer = model_signing.signing.Config().use_certificate_signer(
        private_key=pki.expired.key, signing_certificate=pki.expired.cert, certificate_chain=[pki.intermediate])
    signer.set_hashing_config(ms_hashing(["3.sig"])).sign(model_dir, model_dir / "3.sig")
    ms_verify_cert(model_dir, 3, pki.root)  # the gap listed in docs/environment.md
    result = {(r.model, r.version): r for r in verify_repository(repo, load_policy(ca_policy()))}[("ranker", 3)]
    assert not result.ok and "expired on" in result.reasons[0]


def test_our_resource_order_is_code_point_and_model_signing_still_verifies(tmp_path, keys):
    # OMS v1.0 5.2.1 sorts resources by name in code point order ("a-b/c" before "a/b"); model_signing 1.1.1
    # sorts by path components, but takes the root digest over the resources as listed, so it verifies ours.
    model_dir = tmp_path / "repo" / "m"
    for rel in ("1/a/b", "1/a-b/c", "1/a.b", "1/A", "1/a/b-c/d", "config.pbtxt"):
        (model_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (model_dir / rel).write_text(rel)
    sign_model_version(model_dir, 1, SignerConfig(keys["trusted"].private))
    from model_factory.signing.bundle import parse_bundle
    ours = parse_bundle((model_dir / "1.sig").read_text()).statement()
    names = [r["name"] for r in ours["predicate"]["resources"]]
    assert names == sorted(names) == ["1/A", "1/a-b/c", "1/a.b", "1/a/b", "1/a/b-c/d", "config.pbtxt"]
    ms_verify_key(model_dir, 1, keys["trusted"].public)


def test_model_signing_cli_signs_we_verify(repo, keys, key_policy):
    # The command line of docs/signing.md, run as is (model_signing ignores the .sig it writes).
    cli = Path(sys.executable).with_name("model_signing")
    if not cli.exists():
        pytest.skip("the model_signing command is not installed next to this Python")
    model = repo / "encoder"
    proc = subprocess.run([str(cli), "sign", "key", str(model), "--private_key", str(keys["trusted"].private),
                           "--signature", str(model / "1.sig"), "--ignore-paths", str(model / "2"),
                           "--ignore-paths", str(model / "2.sig")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = {(r.model, r.version): r for r in verify_repository(repo, load_policy(key_policy()))}[("encoder", 1)]
    assert result.ok and result.signer == "key:release", result.reasons


def test_model_signing_verifies_versions_that_carry_their_own_config(tmp_path, keys):
    """A version with its own ``<version>/config.pbtxt`` leaves the model's (derived) one out of its unit and says so
    in ``ignore_paths``: model_signing verifies it, after the model's config.pbtxt changed for a newer version."""
    from signing_helpers import build_model

    model_dir = build_model(tmp_path / "repo" / "encoder", (1, 2))  # (its ignore_paths name the versions present)
    (model_dir / "1" / "config.pbtxt").write_bytes((model_dir / "config.pbtxt").read_bytes())
    sign_model_version(model_dir, 1, SignerConfig(keys["trusted"].private))
    # Version 2's packaging rewrites the model's config.pbtxt (its own, copied into 2/).
    (model_dir / "config.pbtxt").write_text('name: "encoder"\nbackend: "python"\nmax_batch_size: 16\n')
    (model_dir / "2" / "config.pbtxt").write_bytes((model_dir / "config.pbtxt").read_bytes())
    sign_model_version(model_dir, 2, SignerConfig(keys["trusted"].private))
    for v in (1, 2):
        ms_verify_key(model_dir, v, keys["trusted"].public)
    (model_dir / "1" / "config.pbtxt").write_text("tampered")
    with pytest.raises(ValueError, match="Hash mismatch for '1/config.pbtxt'"):
        ms_verify_key(model_dir, 1, keys["trusted"].public)
