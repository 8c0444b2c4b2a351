"""Signatures written by earlier releases must keep verifying (golden files, never regenerated in place).

Each ``data/golden-<release>/`` holds a signed repository (version 1 in key mode with
provenance, version 2 in certificate mode), the public key and the CA root. Add a new
folder with data/make_golden.py when the format changes; never edit an old one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from model_factory.signing import load_policy, signed_digests, verify_repository

DATA = Path(__file__).parent / "data"
RELEASES = sorted(p for p in DATA.glob("golden-*") if p.is_dir())


@pytest.fixture(params=RELEASES, ids=[p.name for p in RELEASES])
def golden(request, tmp_path):
    shutil.copytree(request.param, tmp_path / "g")
    g = tmp_path / "g"
    (g / "policy.toml").write_text(
        '[[keys]]\nname = "golden"\npath = "golden.pub"\n'
        '[certificates]\nroots = ["root.pem"]\nsubjects = ["CN=golden signer,O=Golden Corp"]\n')
    return g


def test_golden_verifies(golden):
    results = verify_repository(golden / "repo", load_policy(golden / "policy.toml"))
    assert [(r.version, r.ok, r.signer) for r in results] == [
        (1, True, "key:golden"), (2, True, "cert:CN=golden signer,O=Golden Corp")], [r.reasons for r in results]
    assert set(signed_digests(golden / "repo" / "golden", 1)) == {
        "config.pbtxt", "1/model.py", "1/weights.bin", "1/mf_backend/__init__.py"}


def test_golden_still_detects_tampering(golden):
    (golden / "repo" / "golden" / "2" / "weights.bin").write_bytes(b"x")
    results = verify_repository(golden / "repo", load_policy(golden / "policy.toml"))
    assert [r.ok for r in results] == [True, False]


def test_golden_verifies_with_model_signing(golden):
    model_signing = pytest.importorskip("model_signing")
    pytest.importorskip("OpenSSL")
    model = golden / "repo" / "golden"
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=golden / "golden.pub").verify(
        model, model / "1.sig")
    model_signing.verifying.Config().use_certificate_verifier(certificate_chain=[golden / "root.pem"]).verify(
        model, model / "2.sig")
