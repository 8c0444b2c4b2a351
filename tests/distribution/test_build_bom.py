"""`build` with a signer writes the version's BOM before signing: the signature covers it and it validates."""

from __future__ import annotations

import json


def test_build_writes_a_signed_bom(tmp_path, minilm_recipe):
    from tiny_torch_models import save_tiny_bert

    from model_factory.build.pipeline import build
    from model_factory.demo import write_key_policy
    from model_factory.distribution.bom import BOM_FILE, read_bom, validate_bom
    from model_factory.recipe import parse_recipe
    from model_factory.signing import SignerConfig, generate_keypair, load_policy, signed_digests, verify_repository

    folder = save_tiny_bert(tmp_path / "tiny-bert", minilm_recipe.source.path)
    recipe = parse_recipe({
        "model": {"name": "tiny", "version": 1},
        "source": {"kind": "huggingface", "path": str(folder)},
        "shapes": {"max_batch": 8, "max_sequence_length": 64, "sequence_buckets": [16, 64]},
        "repository": {"path": str(tmp_path / "repo"), "instance_kind": "cpu"},
    }, tmp_path)
    keys = generate_keypair(tmp_path / "keys")
    result = build(recipe, signer=SignerConfig(keys.private_key), engines=False,
                   parameters={"cost_model": "1e-4,1e-8,1e-11"})
    assert (result.version_dir / BOM_FILE).is_file()
    policy = write_key_policy(tmp_path / "policy.toml", [keys.public_key])
    assert [r.ok for r in verify_repository(tmp_path / "repo", load_policy(policy))] == [True]
    text, signed = read_bom(tmp_path / "repo", "tiny")
    assert signed and f"1/{BOM_FILE}" in signed_digests(result.model_dir, 1)
    doc = json.loads(text)
    validate_bom(doc)
    libraries = {c["name"]: c["version"] for c in doc["components"] if c["type"] == "library"}
    assert libraries.get("torch") and libraries.get("onnx")
