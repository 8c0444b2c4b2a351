"""The factory builds the same bytes twice, and ``rebuild --check`` proves it from a version's provenance.

Two builds of one recipe, in other folders and at other times, give byte-identical ONNX files
(FP32, FP16, INT8), config.pbtxt, tokenizer, acceptance data and metadata; the times live only in
the signed provenance. TensorRT plans are the listed exception. These tests run real builds
(MiniLM: about a minute each on two cores), so they are marked slow.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "model_factory" / "examples" / "minilm.toml"


def digests(model_dir: Path) -> dict[str, str]:
    """Every file of a model folder, minus signatures, by sha256."""
    return {p.relative_to(model_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(model_dir.rglob("*")) if p.is_file() and not p.name.endswith(".sig")}


@pytest.fixture(scope="module")
def signed_minilm(tmp_path_factory):
    """The MiniLM example (FP32, FP16, INT8; engines as the recipe says) built once and signed with provenance."""
    pytest.importorskip("onnxruntime")
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe
    from model_factory.signing import SignerConfig, generate_keypair

    root = tmp_path_factory.mktemp("first")
    keys = generate_keypair(root / "keys")
    recipe = load_recipe(EXAMPLE, {"repository.path": str(root / "model_repository"),
                                   "repository.keep_all_precisions": True})
    result = build(recipe, signer=SignerConfig(keys.private_key))
    return recipe, result, keys


def test_rebuild_check_reproduces_every_file_of_an_honest_version(signed_minilm, tmp_path):
    from model_factory.build.rebuild import rebuild_check

    recipe, result, _ = signed_minilm
    report = rebuild_check(result.version_dir, keep=tmp_path / "rebuilt")
    assert report.ok, (report.differences, report.input_changes)
    # Byte for byte, beyond the digests: the rebuilt folder (elsewhere, later) against the first one.
    first, second = digests(result.model_dir), digests(tmp_path / "rebuilt" / recipe.name)
    # Plans are compared apart; the BOM is written when the version is signed (a fresh serial number and time),
    # and rebuild --check does not sign.
    plans = {p for p in first if p.endswith((".plan", ".plan.json")) or p == "1/bom.cdx.json"}
    assert {p: d for p, d in first.items() if p not in plans} == {p: d for p, d in second.items() if p not in plans}
    for name in ("1/config.pbtxt", "1/model.onnx", "1/model.fp16.onnx", "1/model.int8.onnx", "1/metadata.json",
                 "1/tokenizer/tokenizer.json", "1/export.json"):
        assert name in report.identical
    assert any(p.startswith("1/acceptance/") for p in report.identical)
    # Plans are listed as not compared, with the reason; nothing else is.
    assert sorted(line.split(":")[0] for line in report.not_compared) == sorted(plans)
    assert all(("TensorRT plan" in line) or line.startswith("1/bom.cdx.json: written at signing")
               for line in report.not_compared), report.not_compared
    # No time and no absolute path of the build machine in the packaged metadata.
    meta = json.loads((result.version_dir / "metadata.json").read_text())
    assert "created" not in meta and "stage_seconds" not in meta["build"]
    assert str(recipe.repository.path) not in json.dumps(meta)


def test_provenance_lists_every_output_digest(signed_minilm):
    from model_factory.signing.bundle import parse_bundle

    _, result, _ = signed_minilm
    statement = parse_bundle((result.model_dir / "1.provenance.sig").read_bytes()).statement()
    outputs = {b["name"]: b for b in statement["predicate"]["runDetails"]["byproducts"]
               if b.get("annotations", {}).get("kind") == "output"}
    on_disk = digests(result.model_dir)
    # The model's config.pbtxt is derived (the served version's own 1/config.pbtxt), outside the version's unit.
    assert on_disk.pop("config.pbtxt") == on_disk["1/config.pbtxt"]
    assert {p: o["digest"]["sha256"] for p, o in outputs.items()} == on_disk
    assert {p for p, o in outputs.items() if not o["annotations"]["reproducible"]} == \
        {p for p in on_disk if p.endswith((".plan", ".plan.json"))}
    internal = statement["predicate"]["buildDefinition"]["internalParameters"]
    assert internal["recipePath"] == str(EXAMPLE) and "queueCostModel" not in internal  # derived where served


def test_rebuild_check_names_the_onnx_built_from_other_calibration_data(signed_minilm, tmp_path):
    """A version whose INT8 ONNX was rebuilt from changed calibration data, re-signed with the honest provenance."""
    from model_factory.build.pipeline import build, provenance_for
    from model_factory.cli.main import main
    from model_factory.recipe import load_recipe
    from model_factory.signing import SignerConfig, sign_model_version

    recipe, result, keys = signed_minilm
    calibration = (EXAMPLE.parent / recipe.raw["quantization"]["calibration_data"]).read_text().splitlines()
    (tmp_path / "calibration.txt").write_text("\n".join(calibration[: len(calibration) // 2]) + "\n")
    other = build(load_recipe(EXAMPLE, {"repository.path": str(tmp_path / "other_repository"),
                                        "precisions": ["fp32", "int8"], "repository.keep_all_precisions": True,
                                        "quantization.calibration_data": str(tmp_path / "calibration.txt")}),
                  engines=False)
    assert digests(other.model_dir)["1/model.int8.onnx"] != digests(result.model_dir)["1/model.int8.onnx"]

    tampered = tmp_path / "model_repository" / recipe.name
    shutil.copytree(result.model_dir, tampered)
    (tampered / "1" / "model.int8.onnx").unlink()
    shutil.copyfile(other.version_dir / "model.int8.onnx", tampered / "1" / "model.int8.onnx")
    build_info = json.loads((tampered / "1" / "metadata.json").read_text())["build"]
    sign_model_version(tampered, 1, SignerConfig(keys.private_key), provenance=provenance_for(recipe, build_info, None))

    out = CliRunner().invoke(main, ["rebuild", "--check", str(tampered / "1")])
    assert out.exit_code == 1, out.output
    different = [line for line in out.output.splitlines() if line.startswith("DIFFERENT")]
    assert len(different) == 1 and different[0].split()[1] == "1/model.int8.onnx:", out.output
    assert "minilm version 1: NOT reproduced" in out.output


def test_two_builds_of_a_generic_torch_model_are_identical(tmp_path, monkeypatch):
    """A torch factory source (no Hugging Face), FP32/FP16/INT8 and TorchScript, built in two folders."""
    pytest.importorskip("torch")
    from tiny_torch_models import encoder_recipe, write_factory

    from model_factory.build.pipeline import build
    from model_factory.recipe import parse_recipe

    shared = tmp_path / "inputs"
    shared.mkdir()
    module = write_factory(shared, monkeypatch)
    rng = np.random.default_rng(0)
    for name in ("calibration", "heldout"):
        np.savez(shared / f"{name}.npz", input_ids=rng.integers(0, 50, (16, 9)),
                 attention_mask=np.ones((16, 9), np.int64))
    builds = []
    for run in ("a", "b"):
        data = encoder_recipe(f"{module}:make", torchscript=True) | {
            "precisions": ["fp32", "fp16", "int8"],
            "quantization": {"calibration_data": "calibration.npz", "heldout_data": "heldout.npz",
                             "min_accuracy": 0.01},
            "repository": {"path": str(tmp_path / run / "repo"), "keep_all_precisions": True}}
        monkeypatch.chdir(tmp_path)
        # isolate: each export in a fresh process, as model-factory build runs it (TorchScript renames a
        # class traced twice in one process, build_engines/reproducible.py).
        builds.append(digests(build(parse_recipe(data, shared), engines=False, isolate=True).model_dir))
    assert {"1/model.onnx", "1/model.fp16.onnx", "1/model.int8.onnx", "config.pbtxt", "1/metadata.json"} <= set(builds[0])
    # The torch engine's program: model.pt2 (torch.export), or a TorchScript trace where torch.export fails.
    assert {"1/model.pt2", "1/model.torchscript.pt"} & set(builds[0]), sorted(builds[0])
    assert builds[0] == builds[1], {p for p in builds[0] if builds[0][p] != builds[1].get(p)}
