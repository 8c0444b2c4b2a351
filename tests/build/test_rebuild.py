"""``rebuild --check`` refusals that need no build: each names the problem and the fix.

The rebuilds themselves (honest and tampered versions) are in test_reproducible.py (slow).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from model_factory.build.rebuild import RebuildReport, _compare, rebuild_check
from model_factory.errors import FactoryError

GOLDEN = Path(__file__).resolve().parents[1] / "signing" / "data"


def test_provenance_from_an_older_release_names_the_fix(tmp_path):
    shutil.copytree(GOLDEN / "golden-0.1.0", tmp_path / "g")
    with pytest.raises(FactoryError, match=r"lists no output digests .*Fix: build and sign the version again"):
        rebuild_check(tmp_path / "g" / "repo" / "golden" / "1")


def test_version_without_provenance(tmp_path):
    shutil.copytree(GOLDEN / "golden-oms-1.0", tmp_path / "g")
    with pytest.raises(FactoryError, match=r"has no signed provenance \(2.provenance.sig\)"):
        rebuild_check(tmp_path / "g" / "repo" / "golden" / "2")


def test_provenance_of_another_signature(tmp_path):
    shutil.copytree(GOLDEN / "golden-oms-1.0", tmp_path / "g")
    model = tmp_path / "g" / "repo" / "golden"
    shutil.copyfile(model / "2.sig", model / "1.sig")  # version 1's provenance no longer matches its signature
    with pytest.raises(FactoryError, match="is not the provenance of 1.sig"):
        rebuild_check(model / "1")


def test_provenance_without_recipe_location(tmp_path):
    # The golden provenance has output digests but no recipe file: the command asks for --recipe.
    shutil.copytree(GOLDEN / "golden-oms-1.0", tmp_path / "g")
    with pytest.raises(FactoryError, match="Fix: pass --recipe PATH"):
        rebuild_check(tmp_path / "g" / "repo" / "golden" / "1")


def test_not_a_version_folder(tmp_path):
    with pytest.raises(FactoryError, match="is not a model version folder"):
        rebuild_check(tmp_path)


def test_compare_names_every_kind_of_difference():
    recorded = {"config.pbtxt": ("a" * 64, True), "1/model.onnx": ("b" * 64, True), "1/gone": ("c" * 64, True),
                "1/model.fp16.plan": ("d" * 64, False)}
    rebuilt = {"config.pbtxt": "a" * 64, "1/model.onnx": "e" * 64, "1/new": "f" * 64, "1/model.fp16.plan": "0" * 64}
    identical, differences, not_compared = _compare(recorded, rebuilt)
    assert identical == ["config.pbtxt"]
    assert differences == [
        "1/gone: in the signed version, not produced by the rebuild",
        "1/model.onnx: differs (sha256 bbbbbbbbbbbbbbbb... signed, eeeeeeeeeeeeeeee... rebuilt)",
        "1/new: produced by the rebuild, not in the signed version"]
    assert not_compared == ["1/model.fp16.plan: TensorRT plan: the builder picks tactics by timing kernels, so two "
                            "builds differ"]
    assert not RebuildReport("m", 1, tuple(identical), tuple(differences), tuple(not_compared), ()).ok


def test_cli_refusal_is_one_line(tmp_path):
    from model_factory.cli.main import main

    shutil.copytree(GOLDEN / "golden-0.1.0", tmp_path / "g")
    out = CliRunner().invoke(main, ["rebuild", "--check", str(tmp_path / "g" / "repo" / "golden" / "1")])
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert out.output.startswith("Error: 1.provenance.sig lists no output digests")


def test_policy_verifies_before_rebuilding(tmp_path):
    shutil.copytree(GOLDEN / "golden-oms-1.0", tmp_path / "g")
    g = tmp_path / "g"
    (g / "policy.toml").write_text('[[keys]]\nname = "golden"\npath = "golden.pub"\n')
    (g / "repo" / "golden" / "1" / "weights.bin").write_bytes(b"swapped")
    with pytest.raises(FactoryError, match=r"fails verification, so its provenance is not trusted: file 1/weights.bin"):
        rebuild_check(g / "repo" / "golden" / "1", policy=g / "policy.toml")
