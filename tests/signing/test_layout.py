"""The unit of a model version: what is covered and what is left to other versions."""

from __future__ import annotations

import os

from model_factory.signing.layout import (model_entries, other_version_ignores, outside_unit, provenance_path,
                                          scan_unit, signature_path)
from signing_helpers import build_model


def test_unit_is_the_model_folder_minus_other_versions_and_signatures(tmp_path):
    model = build_model(tmp_path / "m", (1, 2), extra={"labels.txt": b"a\n", ".gitattributes": b"x\n",
                                                       "notes/readme.md": b"hi", ".git/HEAD": b"ref",
                                                       "1/.github/x": b"y"})
    for name in ("1.sig", "2.sig", "2.provenance.sig", "7.sig"):
        (model / name).write_text("{}")
    scan = scan_unit(model, 1)
    # OMS v1.0 6.2.1: the default exclusions are top-level components of the model root only.
    assert scan.files == ("1/.github/x", "1/metadata.json", "1/mf_backend/__init__.py", "1/mf_backend/model.py",
                          "1/model.onnx", "1/model.py", "config.pbtxt", "labels.txt", "notes/readme.md")
    assert scan.problems == () and scan.empty_dirs == ()
    assert "2/model.py" in scan_unit(model, 2).files and "1/model.py" not in scan_unit(model, 2).files


def test_names_that_look_like_signatures_but_are_not_excluded(tmp_path):
    model = build_model(tmp_path / "m", (1,))
    (model / "01.sig").write_text("x")  # not canonical
    (model / "1.sig.bak").write_text("x")
    (model / "2").write_text("a plain file named 2 is not a version folder")
    (model / "1" / "3.sig").write_text("x")  # signatures live only at the top of the model folder
    scan = scan_unit(model, 1)
    assert {"01.sig", "1.sig.bak", "2", "1/3.sig"} <= set(scan.files)


def test_problems_and_empty_dirs(tmp_path):
    model = build_model(tmp_path / "m", (1,))
    (model / "1" / "empty" / "inner").mkdir(parents=True)
    (model / "1" / "link").symlink_to("/etc/hostname")
    os.mkfifo(model / "1" / "fifo")
    (model / "01").mkdir()
    (model / "01" / "x").write_text("x")
    scan = scan_unit(model, 1)
    assert scan.empty_dirs == ("1/empty/inner",)
    assert scan.not_regular == ("1/fifo", "1/link")
    assert scan.problems == (
        "folder 01 looks like a model version with a non-canonical number; rename it to 1 or remove it",
        "1/fifo is a fifo, not a regular file",
        "1/link is a symlink (to /etc/hostname); symlinks are never signed or followed",
    )


def test_symlinked_model_folder(tmp_path):
    model = build_model(tmp_path / "m", (1,))
    (tmp_path / "alias").symlink_to(model, target_is_directory=True)
    assert "is a symlink" in scan_unit(tmp_path / "alias", 1).problems[0]


def test_entries_and_ignores(tmp_path):
    model = build_model(tmp_path / "m", (1, 3))
    (model / "3.sig").write_text("{}")
    (model / "5.sig").write_text("{}")
    entries = model_entries(model)
    assert entries.versions == (1, 3) and entries.signed_versions == (3, 5)
    assert other_version_ignores(model, 1) == [".git", ".gitattributes", ".github", ".gitignore", "1.provenance.sig",
                                               "1.sig", "3", "3.provenance.sig", "3.sig", "5.sig"]
    assert signature_path(model, 3) == model / "3.sig"
    assert provenance_path(model, 3) == model / "3.provenance.sig"


def test_outside_unit():
    assert outside_unit("2/model.onnx", 1) and outside_unit("1.sig", 1) and outside_unit("9.provenance.sig", 1)
    assert not outside_unit("1/model.onnx", 1) and not outside_unit("config.pbtxt", 1)
    assert not outside_unit("1/2.sig", 1) and not outside_unit("02/x", 1)
    assert outside_unit(".git/HEAD", 1) and outside_unit(".gitignore", 1) and not outside_unit("1/.git/HEAD", 1)
