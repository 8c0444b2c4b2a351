"""verify_repository: every tampering named, every trust failure named, nothing passes on doubt."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import pytest

from model_factory.errors import FactoryError
from model_factory.signing import (SignerConfig, load_policy, sign_model_version, sign_repository, signed_digests,
                                   verify_repository)
from model_factory.signing.bundle import parse_bundle, sign_statement
from model_factory.signing.keys import load_private_key

from signing_helpers import build_model


def results_by_version(repo: Path, policy_path: Path) -> dict[tuple[str, int | None], object]:
    return {(r.model, r.version): r for r in verify_repository(repo, load_policy(policy_path))}


def only_failure(repo: Path, policy_path: Path, model: str = "encoder", version: int | None = 1):
    results = results_by_version(repo, policy_path)
    failed = [k for k, r in results.items() if not r.ok]
    assert failed == [(model, version)], {k: r.reasons for k, r in results.items() if not r.ok}
    return results[(model, version)]


@pytest.fixture
def signed_repo(repo, keys):
    sign_repository(repo, SignerConfig(keys["trusted"].private))
    return repo


def test_untouched_repository_verifies(signed_repo, key_policy):
    results = verify_repository(signed_repo, load_policy(key_policy()))
    assert [(r.model, r.version, r.ok) for r in results] == [("encoder", 1, True), ("encoder", 2, True),
                                                             ("ranker", 3, True)]
    assert all(r.signer == "key:release" and r.reasons == () for r in results)
    # config.pbtxt + model.py, model.onnx, metadata.json, mf_backend/__init__.py, mf_backend/model.py
    assert results[0].files == 6


def test_changed_byte(signed_repo, key_policy):
    p = signed_repo / "encoder" / "1" / "model.onnx"
    data = bytearray(p.read_bytes())
    data[1000] ^= 1
    p.write_bytes(bytes(data))
    r = only_failure(signed_repo, key_policy())
    assert len(r.reasons) == 1 and r.reasons[0].startswith("file 1/model.onnx changed")


def test_changed_config_pbtxt_fails_every_version_of_that_model(signed_repo, key_policy):
    with open(signed_repo / "encoder" / "config.pbtxt", "a") as f:
        f.write("instance_group { kind: KIND_CPU }\n")
    results = results_by_version(signed_repo, key_policy())
    for v in (1, 2):
        assert results[("encoder", v)].reasons == ("file config.pbtxt changed" + results[("encoder", v)].reasons[0]
                                                   .removeprefix("file config.pbtxt changed"),)
    assert results[("ranker", 3)].ok


def test_changed_backend_code(signed_repo, key_policy):
    (signed_repo / "encoder" / "1" / "mf_backend" / "model.py").write_text("import os; os.system('evil')\n")
    r = only_failure(signed_repo, key_policy())
    assert r.reasons[0].startswith("file 1/mf_backend/model.py changed")


def test_missing_file(signed_repo, key_policy):
    (signed_repo / "encoder" / "1" / "metadata.json").unlink()
    r = only_failure(signed_repo, key_policy())
    assert r.reasons == ("file 1/metadata.json is signed but missing",)


def test_extra_file(signed_repo, key_policy):
    (signed_repo / "encoder" / "1" / "mf_backend" / "sitecustomize.py").write_text("print('hi')\n")
    r = only_failure(signed_repo, key_policy())
    assert r.reasons == ("file 1/mf_backend/sitecustomize.py is not covered by the signature (added after signing)",)


def test_extra_file_beside_config_is_covered(signed_repo, key_policy):
    # Model code can read any file in the model folder: a new one there fails every version.
    (signed_repo / "encoder" / "labels.txt").write_text("cat\ndog\n")
    results = results_by_version(signed_repo, key_policy())
    assert not results[("encoder", 1)].ok and not results[("encoder", 2)].ok
    assert "file labels.txt is not covered" in results[("encoder", 1)].reasons[0]


def test_renamed_file(signed_repo, key_policy):
    vd = signed_repo / "encoder" / "1"
    (vd / "model.onnx").rename(vd / "model.int8.onnx")
    r = only_failure(signed_repo, key_policy())
    assert r.reasons == ("file 1/model.onnx was renamed to 1/model.int8.onnx (same content, path not signed)",)


def test_symlink_replacing_a_file(signed_repo, key_policy, tmp_path):
    target = tmp_path / "elsewhere.onnx"
    p = signed_repo / "encoder" / "1" / "model.onnx"
    shutil.copyfile(p, target)
    p.unlink()
    p.symlink_to(target)
    r = only_failure(signed_repo, key_policy())
    assert len(r.reasons) == 1
    assert r.reasons[0].startswith("1/model.onnx is a symlink (to ") and str(target) in r.reasons[0]


def test_symlinked_version_folder(signed_repo, key_policy, tmp_path):
    vd = signed_repo / "encoder" / "1"
    moved = tmp_path / "v1"
    shutil.move(vd, moved)
    vd.symlink_to(moved, target_is_directory=True)
    r = only_failure(signed_repo, key_policy())
    assert any(x.startswith("1 is a symlink") for x in r.reasons)


def test_symlinked_model_folder(signed_repo, key_policy, tmp_path):
    moved = tmp_path / "encoder-elsewhere"
    shutil.move(signed_repo / "encoder", moved)
    (signed_repo / "encoder").symlink_to(moved, target_is_directory=True)
    results = results_by_version(signed_repo, key_policy())
    assert not results[("encoder", None)].ok
    assert "is a symlink" in results[("encoder", None)].reasons[0]


def test_fifo_is_reported(signed_repo, key_policy):
    os.mkfifo(signed_repo / "encoder" / "1" / "pipe")
    r = only_failure(signed_repo, key_policy())
    assert r.reasons == ("1/pipe is a fifo, not a regular file",)


def _resign_with_statement(model_dir: Path, version: int, key_path: Path, edit) -> None:
    """Re-sign a version's statement after ``edit`` changed it (a signer that lies)."""
    sig = model_dir / f"{version}.sig"
    bundle = parse_bundle(sig.read_text())
    statement = bundle.statement()
    edit(statement)
    sig.write_text(sign_statement(statement, load_private_key(key_path)).to_json())


def test_path_escaping_the_model_folder(signed_repo, key_policy, keys):
    # Even a trusted signer cannot make verify read outside the model folder.
    (signed_repo / "outside.txt").write_text("secret")

    def edit(st):
        from model_factory.signing.digests import root_digest
        st["predicate"]["resources"].append({"name": "../outside.txt", "algorithm": "sha256", "digest": "0" * 64})
        st["subject"][0]["digest"]["sha256"] = root_digest(r["digest"] for r in st["predicate"]["resources"])

    _resign_with_statement(signed_repo / "encoder", 1, keys["trusted"].private, edit)
    r = only_failure(signed_repo, key_policy())
    assert r.reasons == ("signature 1.sig: resource '../outside.txt' escapes the model folder through '..'",)


def test_absolute_path_in_bundle(signed_repo, key_policy, keys):
    def edit(st):
        from model_factory.signing.digests import root_digest
        st["predicate"]["resources"][0]["name"] = "/etc/passwd"
        st["subject"][0]["digest"]["sha256"] = root_digest(r["digest"] for r in st["predicate"]["resources"])

    _resign_with_statement(signed_repo / "encoder", 1, keys["trusted"].private, edit)
    r = only_failure(signed_repo, key_policy())
    assert "is an absolute path, escaping the model folder" in r.reasons[0]


def test_unsigned_version(signed_repo, key_policy):
    build_model(signed_repo / "ranker", (4,))
    (signed_repo / "ranker" / "config.pbtxt").write_text((signed_repo / "ranker" / "config.pbtxt").read_text())
    results = results_by_version(signed_repo, key_policy())
    assert results[("ranker", 4)].reasons == ("unsigned: no signature 4.sig for version 4. Fix: model-factory sign",)
    # Adding an unsigned version beside a signed one does not break the signed one.
    assert results[("ranker", 3)].ok


def test_unsigned_model(repo, key_policy):
    results = verify_repository(repo, load_policy(key_policy()))
    assert not any(r.ok for r in results)
    assert all(r.reasons[0].startswith("unsigned: no signature") for r in results)


def test_removed_version_with_signature_left(signed_repo, key_policy):
    shutil.rmtree(signed_repo / "encoder" / "2")
    r = only_failure(signed_repo, key_policy(), "encoder", 2)
    assert r.reasons[0].startswith("version folder 2/ is missing but its signature 2.sig is there")


def test_wrong_key(repo, key_policy, keys):
    sign_repository(repo, SignerConfig(keys["other"].private))
    results = verify_repository(repo, load_policy(key_policy()))
    assert not any(r.ok for r in results)
    assert all(r.reasons[0].startswith("signed by an unknown key") and r.signer is None for r in results)


def test_tampered_bundle_payload(signed_repo, key_policy):
    # Change a digest inside the signed payload without re-signing.
    sig = signed_repo / "encoder" / "1.sig"
    doc = json.loads(sig.read_text())
    payload = base64.b64decode(doc["dsseEnvelope"]["payload"]).replace(b'"digest": "', b'"digest": "0', 1)
    doc["dsseEnvelope"]["payload"] = base64.b64encode(payload).decode()
    sig.write_text(json.dumps(doc))
    r = only_failure(signed_repo, key_policy())
    assert r.reasons[0].startswith("the bundle's signature does not verify with key release")


def test_tampered_bundle_structure(signed_repo, key_policy):
    sig = signed_repo / "encoder" / "1.sig"
    sig.write_text(sig.read_text()[:-10])
    r = only_failure(signed_repo, key_policy())
    assert r.reasons[0].startswith("signature 1.sig is damaged or tampered: not JSON")


def test_signature_copied_from_another_version(signed_repo, key_policy):
    shutil.copyfile(signed_repo / "encoder" / "2.sig", signed_repo / "encoder" / "1.sig")
    r = only_failure(signed_repo, key_policy())
    assert r.reasons[0] == "the signature is for version 2, but it is stored as 1.sig"
    assert r.reasons[1].startswith("the signature covers 2/metadata.json, 2/mf_backend/__init__.py, "
                                   "2/mf_backend/model.py, 2/model.onnx, 2/model.py, which belong to other versions")
    assert "file 1/model.onnx is not covered by the signature (added after signing)" in r.reasons


def test_renamed_model_folder(signed_repo, key_policy):
    (signed_repo / "encoder").rename(signed_repo / "encoder-prod")
    results = results_by_version(signed_repo, key_policy())
    r = results[("encoder-prod", 1)]
    assert not r.ok and r.reasons[0].startswith("the signature is for model 'encoder', but the folder is 'encoder-prod'")


def test_other_versions_are_separate_units(signed_repo, key_policy):
    (signed_repo / "encoder" / "2" / "model.onnx").write_bytes(b"swapped")
    r = only_failure(signed_repo, key_policy(), "encoder", 2)
    assert r.reasons[0].startswith("file 2/model.onnx changed")


def test_git_paths_follow_the_oms_default_exclusions(repo, key_policy, keys):
    # OMS v1.0 6.2: .git, .gitignore, .gitattributes and .github at the top of the model folder are left
    # out (Triton never loads them); the same names deeper down are ordinary files and signed.
    model = repo / "encoder"
    (model / ".gitattributes").write_text("*.onnx filter=lfs\n")
    (model / "1" / ".git").mkdir()
    (model / "1" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    sign_model_version(model, 1, SignerConfig(keys["trusted"].private))
    sign_model_version(repo / "ranker", 3, SignerConfig(keys["trusted"].private))
    assert "1/.git/HEAD" in signed_digests(model, 1) and ".gitattributes" not in signed_digests(model, 1)
    (model / ".gitattributes").write_text("*.onnx -filter\n")
    (model / ".gitignore").write_text("*.plan\n")
    (model / "1" / ".git" / "HEAD").write_text("ref: refs/heads/evil\n")
    results = results_by_version(repo, key_policy())
    reasons = results[("encoder", 1)].reasons
    assert len(reasons) == 1 and reasons[0].startswith("file 1/.git/HEAD changed"), reasons


def test_empty_folders_are_covered(repo, key_policy, keys):
    model = repo / "encoder"
    (model / "1" / "tokenizer").mkdir()
    sign_model_version(model, 1, SignerConfig(keys["trusted"].private))
    sign_model_version(model, 2, SignerConfig(keys["trusted"].private))
    sign_model_version(repo / "ranker", 3, SignerConfig(keys["trusted"].private))
    policy = key_policy()
    assert all(r.ok for r in verify_repository(repo, load_policy(policy)))
    (model / "1" / "tokenizer").rmdir()
    (model / "1" / "plugins").mkdir()
    r = only_failure(repo, policy)
    assert r.reasons == ("empty folder 1/tokenizer is signed but missing (or no longer empty)",
                         "empty folder 1/plugins is not covered by the signature")


def test_everything_is_reported_at_once(signed_repo, key_policy):
    vd = signed_repo / "encoder" / "1"
    (vd / "metadata.json").unlink()
    (vd / "model.py").write_text("changed\n")
    (vd / "new.bin").write_bytes(b"x")
    r = only_failure(signed_repo, key_policy())
    assert len(r.reasons) == 3


def test_policy_key_expiry(signed_repo, key_policy):
    r = results_by_version(signed_repo, key_policy('expires = 2020-01-01'))[("encoder", 1)]
    assert not r.ok and r.reasons[0].startswith("key release expired on 2020-01-01 per the trust policy")


def test_repository_errors(tmp_path, key_policy):
    with pytest.raises(FactoryError, match="does not exist"):
        verify_repository(tmp_path / "nope", load_policy(key_policy()))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FactoryError, match="holds no models"):
        verify_repository(tmp_path / "empty", load_policy(key_policy()))
    (tmp_path / "empty" / "model-without-versions").mkdir()
    (r,) = verify_repository(tmp_path / "empty", load_policy(key_policy()))
    assert not r.ok and r.version is None and "has no version folder" in r.reasons[0]


def test_signed_digests(signed_repo, key_policy):
    model = signed_repo / "encoder"
    policy = load_policy(key_policy())
    digests = signed_digests(model, 1, policy)
    assert set(digests) == {"config.pbtxt", "1/model.py", "1/model.onnx", "1/metadata.json",
                            "1/mf_backend/__init__.py", "1/mf_backend/model.py"}
    import hashlib
    assert digests["1/model.onnx"] == hashlib.sha256((model / "1" / "model.onnx").read_bytes()).hexdigest()
    assert signed_digests(model, 1) == digests
    (model / "1" / "model.onnx").write_bytes(b"other")
    with pytest.raises(FactoryError, match="failed verification: file 1/model.onnx changed"):
        signed_digests(model, 1, policy)
    # Without a policy only the bundle is read: the load-time byte check catches the change.
    from model_factory.backend.integrity import IntegrityError, read_checked
    with pytest.raises(IntegrityError, match="changed after verification"):
        read_checked(model, "1/model.onnx", signed_digests(model, 1))


def test_file_vanishing_during_verification(signed_repo, key_policy, monkeypatch):
    from model_factory.signing import layout, verify

    real = layout.scan_unit

    def scan_then_delete(model_dir, version):
        scan = real(model_dir, version)
        if model_dir.name == "encoder" and version == 1:
            (model_dir / "1" / "model.py").unlink()  # gone between the walk and the hashing
        return scan

    monkeypatch.setattr(verify.layout, "scan_unit", scan_then_delete)
    r = only_failure(signed_repo, key_policy())
    assert r.reasons == ("cannot read 1/model.py: No such file or directory (changed during verification, "
                         "or a permission problem)",)


def test_name_that_is_not_utf8(signed_repo, key_policy):
    os.close(os.open(os.fsencode(signed_repo / "encoder" / "1") + b"/\xff.bin", os.O_CREAT | os.O_WRONLY))
    r = only_failure(signed_repo, key_policy())
    assert r.reasons == ("'1/\\udcff.bin' has a name that is not valid UTF-8; rename it",)
