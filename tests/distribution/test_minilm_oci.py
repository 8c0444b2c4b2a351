"""The MiniLM build through the registry: push -> registry -> pull -> verify -> serve, bytes identical; its BOM."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from test_push_pull import snapshot

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def minilm_signed(tmp_path_factory, minilm_recipe, minilm_export, package_signed):
    """MiniLM packaged and signed with provenance and a BOM (as the build writes it: BOM first, then signature)."""
    from model_factory.build.pipeline import provenance_for
    from model_factory.distribution.bom import write_bom
    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version
    from model_factory.demo import write_key_policy

    root = tmp_path_factory.mktemp("minilm-oci")
    keys = generate_keypair(root / "keys")
    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=root / "repo"))
    model_dir = package_signed(recipe, keys)
    facts = provenance_for(recipe, {"source_digest": minilm_export.source_digest}, accuracy={
        "min_accuracy": 0.99, "results": [{"precision": "fp16", "metric": "cosine", "score": 0.99999},
                                          {"precision": "int8", "metric": "cosine", "score": 0.993}]})
    write_bom(model_dir, recipe.version, facts)
    sign_model_version(model_dir, recipe.version, SignerConfig(keys.private_key), provenance=facts)
    return root / "repo", model_dir, write_key_policy(root / "policy.toml", [keys.public_key]), keys


def test_push_pull_verify_serve_identical(registry, reg_options, minilm_signed, tmp_path):
    from model_factory.distribution.push_pull import pull, push
    from model_factory.measure.client import embed_texts
    from model_factory.serving.server import ServerOptions, start_verified_server

    repo, model_dir, policy, keys = minilm_signed
    ref = f"oci://{registry.host}/models/{model_dir.name}:1"
    pushed = push(repo, model_dir.name, ref, options=reg_options)
    assert set(pushed.referrers) == {"signature", "provenance", "bom"}
    dest = tmp_path / "served"
    result = pull(ref, dest, policy, options=reg_options)
    assert result.referrers == ("bom", "provenance", "signature")
    assert snapshot(dest / model_dir.name) == snapshot(model_dir)  # every byte, signature files included

    # OpenSSF model_signing verifies the pulled folder too.
    model_signing = pytest.importorskip("model_signing")
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=keys.public_key).verify(
        dest / model_dir.name, dest / model_dir.name / "1.sig")

    server, report = start_verified_server(dest, ServerOptions(0, 0, 0), policy)
    try:
        assert report.served == (model_dir.name,)
        assert embed_texts(server.http_url, model_dir.name, ["pulled from the registry"]).shape == (1, 384)
    finally:
        assert server.stop() == 0


def test_bom_validates_and_matches_the_signature(minilm_signed):
    from click.testing import CliRunner

    from model_factory.cli.main import main
    from model_factory.distribution.bom import BOM_FILE, validate_bom
    from model_factory.signing import signed_digests

    repo, model_dir, policy, _ = minilm_signed
    r = CliRunner().invoke(main, ["bom", str(repo), "--model", model_dir.name])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    validate_bom(doc)
    assert doc["specVersion"] == "1.7"
    files = {c["name"]: c["hashes"][0]["content"] for c in doc["components"] if c["type"] == "file"}
    signed = signed_digests(model_dir, 1)
    assert signed.pop(f"1/{BOM_FILE}")  # the BOM is signed, and lists every other signed file with its digest
    assert files == signed
    model = next(c for c in doc["components"] if c["type"] == "machine-learning-model")
    card = model["modelCard"]
    assert card["modelParameters"]["task"] == "embedding"
    assert any(": STRING [" in i["format"] for i in card["modelParameters"]["inputs"])  # the text input
    assert card["modelParameters"]["outputs"]
    metrics = {m["slice"]: m["value"] for m in card["quantitativeAnalysis"]["performanceMetrics"]}
    assert metrics == {"precision=fp16 (gate passed)": "0.99999", "precision=int8 (gate passed)": "0.993"}
    data = {c["bom-ref"]: c for c in doc["components"] if c["type"] == "data"}
    assert "data:held-out" in data and len(data["data:held-out"]["hashes"][0]["content"]) == 64
    libraries = {c["name"] for c in doc["components"] if c["type"] == "library"}
    assert {"onnx", "onnxruntime"} <= libraries
    # A damaged BOM is refused by the CycloneDX validator.
    from model_factory.errors import FactoryError

    with pytest.raises(FactoryError, match="not valid CycloneDX"):
        validate_bom({**doc, "components": [{"type": "machine-learning-model"}]})
