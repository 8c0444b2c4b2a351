"""Signing refuses what it cannot cover faithfully, and writes where the layout says."""

from __future__ import annotations

import json
import os

import pytest

from model_factory.errors import FactoryError
from model_factory.signing import SignerConfig, sign_model_version, sign_repository, verify_model_version
from model_factory.signing.bundle import parse_bundle


def test_bundle_location_and_content(repo, keys):
    path = sign_model_version(repo / "encoder", 2, SignerConfig(keys["trusted"].private))
    assert path == repo / "encoder" / "2.sig"
    statement = parse_bundle(path.read_text()).statement()
    names = [r["name"] for r in statement["predicate"]["resources"]]
    assert names == ["2/metadata.json", "2/mf_backend/__init__.py", "2/mf_backend/model.py", "2/model.onnx",
                     "2/model.py", "config.pbtxt"]
    assert statement["subject"][0]["name"] == "encoder"
    assert statement["predicate"]["serialization"]["ignore_paths"] == [
        ".git", ".gitattributes", ".github", ".gitignore", "1", "1.provenance.sig", "1.sig", "2.provenance.sig",
        "2.sig"]
    assert not list((repo / "encoder").glob(".*.tmp"))  # the temporary file was renamed away


def test_encrypted_key(repo, tmp_path, keys, key_policy):
    from model_factory.signing import generate_keypair, load_policy
    paths = generate_keypair(tmp_path / "k", "P-384", password=b"pw")
    sign_model_version(repo / "ranker", 3, SignerConfig(paths.private_key, b"pw"))
    policy = tmp_path / "p.toml"
    policy.write_text(f'[[keys]]\nname = "ci"\npath = "{paths.public_key}"\n')
    assert verify_model_version(repo / "ranker", 3, load_policy(policy)).ok
    with pytest.raises(FactoryError, match="wrong password"):
        sign_model_version(repo / "ranker", 3, SignerConfig(paths.private_key, b"nope"))


@pytest.mark.parametrize("setup, message", [
    (lambda m: (m / "1" / "link").symlink_to(m / "config.pbtxt"), "1/link is a symlink"),
    (lambda m: os.mkfifo(m / "1" / "fifo"), "1/fifo is a fifo"),
    (lambda m: (m / "01").mkdir(), "non-canonical number"),
])
def test_refuses_what_it_cannot_cover(repo, keys, setup, message):
    setup(repo / "encoder")
    with pytest.raises(FactoryError, match=message):
        sign_model_version(repo / "encoder", 1, SignerConfig(keys["trusted"].private))
    assert not (repo / "encoder" / "1.sig").exists()


def test_argument_errors(repo, keys, tmp_path):
    signer = SignerConfig(keys["trusted"].private)
    with pytest.raises(FactoryError, match="is not a version folder"):
        sign_model_version(repo / "encoder", 7, signer)
    with pytest.raises(FactoryError, match="not a model version number"):
        sign_model_version(repo / "encoder", "1", signer)  # type: ignore[arg-type]
    with pytest.raises(FactoryError, match="does not exist"):
        sign_repository(tmp_path / "nope", signer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FactoryError, match="holds no models"):
        sign_repository(tmp_path / "empty", signer)
    (repo / "broken").mkdir()
    with pytest.raises(FactoryError, match="model broken has no version folder"):
        sign_repository(repo, signer)
    with pytest.raises(FactoryError, match="cannot read the private key"):
        sign_repository(repo, SignerConfig(tmp_path / "missing.pem"))


def test_resign_replaces_the_bundle(repo, keys):
    signer = SignerConfig(keys["trusted"].private)
    first = json.loads(sign_model_version(repo / "ranker", 3, signer).read_text())
    (repo / "ranker" / "3" / "model.py").write_text("new code\n")
    second = json.loads(sign_model_version(repo / "ranker", 3, signer).read_text())
    assert first["dsseEnvelope"]["payload"] != second["dsseEnvelope"]["payload"]
