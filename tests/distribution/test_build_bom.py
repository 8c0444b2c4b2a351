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


def test_the_bom_traces_every_tensor_and_diff_names_the_one_that_changed(tmp_path, minilm_recipe):
    """Two signed builds of a tiny BERT, the second with one tensor changed: the BOMs list every tensor of the
    source (as its safetensors holds it) and of model.onnx, with the source scan; `diff` of the two version
    folders names exactly that tensor in the source, and `report --against` says the same."""
    from click.testing import CliRunner
    from safetensors.numpy import load_file, save_file
    from tiny_torch_models import save_tiny_bert

    from model_factory.build.pipeline import build
    from model_factory.cli.main import main
    from model_factory.distribution.bom import BOM_FILE, validate_bom
    from model_factory.recipe import parse_recipe
    from model_factory.signing import SignerConfig, generate_keypair
    from model_factory.signing.tensors import manifests_from_bom, onnx_manifest, safetensors_manifest

    folder = save_tiny_bert(tmp_path / "base", minilm_recipe.source.path)
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    for p in folder.iterdir():
        (tuned / p.name).write_bytes(p.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    name = "encoder.layer.1.output.dense.weight"
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    keys = generate_keypair(tmp_path / "keys")
    dirs = []
    for version, src in ((1, folder), (2, tuned)):
        recipe = parse_recipe({
            "model": {"name": "tiny", "version": version}, "source": {"kind": "huggingface", "path": str(src)},
            "shapes": {"max_batch": 8, "max_sequence_length": 64, "sequence_buckets": [16, 64]},
            "repository": {"path": str(tmp_path / f"repo{version}"), "instance_kind": "cpu"},
        }, tmp_path)
        dirs.append(build(recipe, signer=SignerConfig(keys.private_key), engines=False,
                          parameters={"cost_model": "1e-4,1e-8,1e-11"}).version_dir)
    doc = json.loads((dirs[0] / BOM_FILE).read_text())
    validate_bom(doc)
    sets = manifests_from_bom(doc)
    assert sets["source"] == safetensors_manifest(folder / "model.safetensors")
    assert sets["model.onnx"] == onnx_manifest(dirs[0] / "model.onnx") and len(sets["model.onnx"]) > 10
    [model] = [c for c in doc["components"] if c["type"] == "machine-learning-model"]
    props = {p["name"]: p["value"] for p in model["pedigree"]["ancestors"][0]["properties"]}
    assert props["model-factory:source-scan"].startswith("clean: ") and "safetensors" in props[
        "model-factory:source-scan"]
    run = CliRunner().invoke(main, ["diff", str(dirs[0]), str(dirs[1])])
    assert run.exit_code == 0, run.output
    lines = run.output.splitlines()
    source = lines.index(next(line for line in lines if line.startswith("source: ")))
    assert lines[source].startswith("source: 1 of ") and lines[source + 1].split()[:2] == ["changed", name]
    run = CliRunner().invoke(main, ["diff", str(dirs[0]), str(dirs[0].parent)])  # a model folder: its latest
    assert "source: identical weights" in run.output
    from model_factory.measure.report.changes import _tensors
    from model_factory.measure.report.release import latest_release

    said = _tensors(latest_release(tmp_path / "repo1", "tiny"), latest_release(tmp_path / "repo2", "tiny"))
    assert any(line.split()[:2] == ["changed", name] for line in said)
