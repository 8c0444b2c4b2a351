"""Fail-closed serving: only verified models load, and the backend refuses bytes that changed after verification."""

from __future__ import annotations

import gc
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def signed_repo(tmp_path_factory, minilm_recipe, package_signed):
    """Two signed copies of MiniLM (``good`` and ``tampered``) and a policy trusting the key."""
    from model_factory.demo import write_key_policy
    from model_factory.signing import generate_keypair

    root = tmp_path_factory.mktemp("signed")
    repo = root / "repo"
    keys = generate_keypair(root / "keys")
    for name in ("good", "tampered"):
        package_signed(replace(minilm_recipe, name=name, repository=replace(minilm_recipe.repository, path=repo)), keys)
    policy = write_key_policy(root / "policy.toml", [keys.public_key])
    return repo, policy


def test_tampered_model_is_refused_and_the_other_serves(signed_repo) -> None:
    from model_factory.measure.client import embed_texts
    from model_factory.serving.server import ServerOptions, start_verified_server

    repo, policy = signed_repo
    onnx = repo / "tampered" / "1" / "model.onnx"
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0xFF
    onnx.write_bytes(bytes(data))
    seen_at_loaded = []  # what Triton said of each model when start-up called on_loaded (serve's signal boundary)
    server, report = start_verified_server(
        repo, ServerOptions(0, 0, 0), policy,
        on_loaded=lambda started: seen_at_loaded.append({m["name"]: m.get("state") for m in started.model_status()}))
    try:
        assert len(seen_at_loaded) == 1 and seen_at_loaded[0]["good"] == "READY", seen_at_loaded
        assert report.served == ("good",)
        assert "verification failed" in report.refused["tampered"] and "1/model.onnx" in report.refused["tampered"]
        assert embed_texts(server.http_url, "good", ["still served"]).shape == (1, 384)
        index = {m["name"]: m.get("state") for m in server.model_status()}
        assert index.get("good") == "READY" and index.get("tampered") != "READY"
    finally:
        assert server.stop() == 0
    # The verified digests (written to the temporary folder for the backend) go with the server object,
    # as its work folder does: a test suite or a restarting service leaves no folder behind per start.
    folders = (report.digests.path.parent, server._work)
    assert all(f.is_dir() for f in folders)
    del server
    gc.collect()
    assert not any(f.exists() for f in folders)
    # Serving wrote nothing into the repository (no bytecode caches): it still verifies, so the
    # next start serves it again.
    from model_factory.signing import load_policy, verify_repository

    assert [r.ok for r in verify_repository(repo, load_policy(policy)) if r.model == "good"] == [True]
    assert not list((repo / "good").rglob("__pycache__"))


def test_backend_refuses_bytes_swapped_after_verification(signed_repo, tmp_path: Path) -> None:
    """The real backend in the real server: its engine bytes differ from the verified digests."""
    from model_factory.serving.server import VERIFIED_DIGESTS_ENV, ServerOptions, TritonServer
    from model_factory.signing import signed_digests

    repo, _ = signed_repo
    copy = tmp_path / "repo"
    shutil.copytree(repo / "good", copy / "good")
    digests = signed_digests(copy / "good", 1)
    # As if model.onnx were replaced between `verify` and the load: the verified digest no longer matches.
    digests["1/model.onnx"] = "0" * 64
    table = tmp_path / "verified.json"
    table.write_text(json.dumps({"good": {"1": digests}}))
    server = TritonServer(copy, ["good"], ServerOptions(0, 0, 0), env={VERIFIED_DIGESTS_ENV: str(table)}).start()
    try:
        assert "changed after verification" in server.load_errors["good"]
    finally:
        server.stop()
