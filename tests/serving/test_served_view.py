"""The repository Triton reads (serving/served_view.py): a copy of the served model's files without its signature
files, and a loaded version's folder left untouched by later syncs (neither modification nor status-change times:
Triton compares the later of the two), so Triton keeps that version loaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from model_factory.errors import FactoryError
from model_factory.serving.served_view import PYCACHE_BLOCKER, policy_versions, sync_model


def _model(repo: Path) -> Path:
    m = repo / "m"
    (m / "1" / "mf_backend").mkdir(parents=True)
    (m / "config.pbtxt").write_text('name: "m"\n')
    (m / "labels.txt").write_text("a\nb\n")
    (m / "1.sig").write_text("bundle")
    (m / "1.provenance.sig").write_text("provenance")
    (m / ".git").mkdir()
    (m / ".git" / "HEAD").write_text("ref")
    (m / "1" / "model.py").write_text("shim")
    (m / "1" / "model.onnx").write_bytes(b"\x08" * 64)
    (m / "1" / "mf_backend" / "model.py").write_text("backend")
    return m


def _tree(folder: Path) -> dict[str, tuple[int, int, int]]:
    """relpath -> (inode, mtime_ns, ctime_ns) of ``folder`` and every entry under it."""
    out = {}
    for p in [folder, *folder.rglob("*")]:
        st = p.stat()
        out[str(p.relative_to(folder))] = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    return out


def test_the_view_links_what_triton_reads_and_leaves_out_signatures(tmp_path: Path) -> None:
    src = _model(tmp_path / "repo")
    (src / "01").mkdir()  # a non-canonical version folder: never served (verification reports it)
    (src / "01" / "model.py").write_text("shim")
    view = sync_model(tmp_path / "repo", tmp_path / "served", "m")
    assert view == tmp_path / "served" / "m"
    assert sorted(p.name for p in view.iterdir()) == ["1", "config.pbtxt", "labels.txt"]
    for rel in ("config.pbtxt", "labels.txt", "1/model.py", "1/model.onnx", "1/mf_backend/model.py"):
        assert (view / rel).read_bytes() == (src / rel).read_bytes()
        assert (view / rel).stat().st_ino != (src / rel).stat().st_ino  # a copy: the repository's links are not ours
        assert (view / rel).stat().st_mtime_ns == (src / rel).stat().st_mtime_ns
    blocker = view / "1" / PYCACHE_BLOCKER
    assert blocker.is_file() and blocker.stat().st_size == 0  # Python cannot write a bytecode cache here
    assert not (src / "1" / PYCACHE_BLOCKER).exists()  # the signed repository is never written


def test_a_new_version_and_a_rewritten_config_leave_the_loaded_version_untouched(tmp_path: Path) -> None:
    """What Triton checks before keeping version 1 loaded: its folder and the model-level files other than
    config.pbtxt. Packaging version 2 links every file of version 1 into the new model folder and writes the
    labels and config.pbtxt again; signing rewrites the signatures."""
    src = _model(tmp_path / "repo")
    view = sync_model(tmp_path / "repo", tmp_path / "served", "m")
    v1 = _tree(view / "1")
    labels = _tree(view / "labels.txt")
    for f in [p for p in (src / "1").rglob("*") if p.is_file()]:
        os.link(f, f.with_name(f.name + ".link"))  # a new name for the same file: its status-change time moves
        os.unlink(f.with_name(f.name + ".link"))
    (src / "labels.txt").unlink()
    (src / "labels.txt").write_text("a\nb\n")  # the same labels, written again
    (src / "2").mkdir()
    (src / "2" / "model.py").write_text("shim 2")
    (src / "2.sig").write_text("bundle 2")
    (src / "1.sig").write_text("bundle again")
    (src / "config.pbtxt.new").write_text('name: "m"\nversion_policy { latest { num_versions: 1 } }\n')
    os.replace(src / "config.pbtxt.new", src / "config.pbtxt")
    sync_model(tmp_path / "repo", tmp_path / "served", "m", {"specific": {"versions": [1, 2]}})  # the switch
    assert _tree(view / "1") == v1
    assert _tree(view / "labels.txt") == labels
    assert (view / "config.pbtxt").read_text() == (src / "config.pbtxt").read_text()
    assert (view / "2" / "model.py").read_text() == "shim 2" and (view / "2" / PYCACHE_BLOCKER).is_file()
    assert not (view / "2.sig").exists()


def test_changed_and_removed_files_follow_the_repository_and_a_version_that_left_stays(tmp_path: Path) -> None:
    src = _model(tmp_path / "repo")
    view = sync_model(tmp_path / "repo", tmp_path / "served", "m")
    (src / "1" / "model.onnx").unlink()
    (src / "1" / "model.onnx").write_bytes(b"\x09" * 64)  # a new file (another inode), same size
    (src / "1" / "mf_backend" / "model.py").unlink()
    (src / "labels.txt").unlink()
    sync_model(tmp_path / "repo", tmp_path / "served", "m")
    assert (view / "1" / "model.onnx").read_bytes() == b"\x09" * 64
    assert not (view / "1" / "mf_backend" / "model.py").exists() and not (view / "labels.txt").exists()
    assert not list(view.rglob("*.mf-tmp"))
    # pull replaces a model folder with the version it brings: version 1 stays here (still loaded, it may be
    # loaded again within a rollout's grace period; the backend checks its bytes against the verified digests)
    (src / "2").mkdir()
    (src / "2" / "model.py").write_text("shim 2")
    for p in sorted((src / "1").rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    (src / "1").rmdir()
    sync_model(tmp_path / "repo", tmp_path / "served", "m")
    assert (view / "1" / "model.py").read_text() == "shim" and (view / "2" / "model.py").is_file()


def test_a_second_sync_copies_nothing_and_a_file_rewritten_alike_is_kept(tmp_path: Path) -> None:
    src = _model(tmp_path / "repo")
    view = sync_model(tmp_path / "repo", tmp_path / "served", "m")
    before = _tree(view)
    sync_model(tmp_path / "repo", tmp_path / "served", "m")
    assert _tree(view) == before
    os.utime(src / "1" / "model.onnx", ns=(1, 1))  # the same bytes, another time: small files are compared
    sync_model(tmp_path / "repo", tmp_path / "served", "m")
    assert _tree(view) == before


def test_a_view_that_cannot_be_written_is_a_user_error(tmp_path: Path) -> None:
    _model(tmp_path / "repo")
    (tmp_path / "served").write_text("a file where the folder should be")
    with pytest.raises(FactoryError, match="cannot lay out m for the server.*Fix:"):
        sync_model(tmp_path / "repo", tmp_path / "served", "m")


def test_only_the_versions_the_policy_loads_are_copied(tmp_path: Path) -> None:
    assert policy_versions(None, [1, 3, 2]) == [3]  # Triton's default: the latest
    assert policy_versions({"latest": {"num_versions": 2}}, [1, 3, 2]) == [2, 3]
    assert policy_versions({"all": {}}, [2, 1]) == [1, 2]
    assert policy_versions({"specific": {"versions": ["1", 3]}}, [1, 2, 3]) == [1, 3]
    src = _model(tmp_path / "repo")
    for v in (2, 3):
        (src / str(v)).mkdir()
        (src / str(v) / "model.onnx").write_bytes(b"\x00" * 1024)
    view = sync_model(tmp_path / "repo", tmp_path / "served", "m", {"specific": {"versions": [2]}})
    assert sorted(p.name for p in view.iterdir() if p.is_dir()) == ["2"]
    sync_model(tmp_path / "repo", tmp_path / "served", "m")  # latest: 3; version 2 stays
    assert sorted(p.name for p in view.iterdir() if p.is_dir()) == ["2", "3"]


def test_a_sparse_weight_file_stays_sparse_in_the_view(tmp_path: Path) -> None:
    """A weight file with holes (a sparse embedding table's unused rows) is copied with its holes where the file
    system has no reflinks: a dense copy took the file's whole size on disk again (4.3 GB for the large-model
    test's two 2.25 GB data files, which filled a CI machine's disk)."""
    src = _model(tmp_path / "repo")
    size, head, tail = 64 << 20, os.urandom(4096), os.urandom(100)
    with (src / "1" / "model.onnx.data").open("wb") as f:
        f.write(head)
        f.seek(size - len(tail))
        f.write(tail)
    data = src / "1" / "model.onnx.data"
    if data.stat().st_blocks * 512 >= size // 2:
        pytest.skip(f"this file system ({tmp_path}) stores no holes")
    view = sync_model(tmp_path / "repo", tmp_path / "served", "m")
    copy = view / "1" / "model.onnx.data"
    assert copy.stat().st_size == size
    assert copy.stat().st_blocks * 512 < 1 << 20  # the holes stayed holes (a reflink shares blocks: also small)
    with copy.open("rb") as f:
        assert f.read(len(head)) == head
        assert f.read(1 << 20) == bytes(1 << 20)
        f.seek(size - len(tail))
        assert f.read() == tail


def test_only_the_weight_files_its_loads_read_are_copied(tmp_path: Path) -> None:
    """A version packaged with every precision: the served one's files (and, for an encoder, FP32's; a degrade
    precision's) are copied, the others' are not; a package naming no precision gets every file."""
    from model_factory.serving.served_view import read_precisions

    src = _model(tmp_path / "repo")
    weights = ("model.onnx", "model.onnx.data", "model.fp16.onnx", "model.int8.onnx", "model.int8.onnx.data",
               "model.int4.onnx", "model.int4.onnx.data", "model.fp16.plan", "model.pt2")
    for name in weights:
        (src / "1" / name).write_bytes(b"\x01" * 32)
    (src / "1" / "tokenizer").mkdir()
    (src / "1" / "tokenizer" / "tokenizer.json").write_text("{}")
    (src / "1" / "generation.json").write_text("{}")

    views = iter(range(100))

    def copied(parameters: dict) -> set[str]:
        view = sync_model(tmp_path / "repo", tmp_path / f"served-{next(views)}", "m", None,
                          read_precisions(parameters))
        assert {"model.py", "generation.json"} <= {p.name for p in (view / "1").iterdir()}  # shared files always
        assert (view / "1" / "tokenizer" / "tokenizer.json").is_file()
        return {p.name for p in (view / "1").iterdir() if p.is_file() and p.name in weights}

    llm = copied({"precision": "int4", "task": "text-generation", "onnx_file": "model.int4.onnx"})
    assert llm == {"model.int4.onnx", "model.int4.onnx.data"}
    drafting = copied({"precision": "fp32", "task": "text-generation", "onnx_file": "model.onnx",
                       "speculative": "draft", "speculative_draft": "int4"})  # the draft's graph travels too
    assert drafting == {"model.onnx", "model.onnx.data", "model.pt2", "model.int4.onnx", "model.int4.onnx.data"}
    assert copied({"precision": "int8"}) == {"model.onnx", "model.onnx.data", "model.pt2", "model.int8.onnx",
                                             "model.int8.onnx.data"}
    assert copied({"precision": "fp16", "degrade_to": "int8"}) == {
        "model.onnx", "model.onnx.data", "model.pt2", "model.fp16.onnx", "model.fp16.plan", "model.int8.onnx",
        "model.int8.onnx.data"}
    assert copied({}) == set(weights)  # no precision named: every file
    assert read_precisions({}) is None


def test_a_precision_no_longer_read_leaves_the_view(tmp_path: Path) -> None:
    from model_factory.serving.served_view import read_precisions

    src = _model(tmp_path / "repo")
    (src / "1" / "model.int8.onnx").write_bytes(b"\x02" * 32)
    view = sync_model(tmp_path / "repo", tmp_path / "served", "m", None, read_precisions({"precision": "int8"}))
    assert (view / "1" / "model.int8.onnx").is_file()
    sync_model(tmp_path / "repo", tmp_path / "served", "m", None,
               read_precisions({"precision": "fp32", "task": "text-generation"}))
    assert not (view / "1" / "model.int8.onnx").exists() and (view / "1" / "model.onnx").is_file()


def test_an_adapter_version_set_by_a_rollout_is_the_one_its_base_finds_and_a_newer_one_keeps_its_weights(
        tmp_path: Path) -> None:
    """``sync_adapter``: the version a rollout sets is the newest holding ``adapter.json`` in the view (what the
    base's next load finds); a newer one there (an undone rollout's) loses only its ``adapter.json``, so a stub
    loaded before still reads its weights; setting it again brings the file back."""
    import json

    from model_factory.backend.lora_contract import adapter_entries
    from model_factory.serving.served_view import sync_adapter

    repo, served = tmp_path / "repo", tmp_path / "served"
    for v in (1, 2):
        (repo / "a" / str(v)).mkdir(parents=True)
        (repo / "a" / str(v) / "adapter.json").write_text(json.dumps({"base": "llm", "version": v}))
        (repo / "a" / str(v) / "adapter.npz").write_bytes(bytes([v]) * 8)
        (repo / "a" / f"{v}.sig").write_text("bundle")
    sync_adapter(repo, served, "a", 1)
    assert [f.name for _, f in adapter_entries(served, "llm")] == ["1"] and not (served / "a" / "2").exists()
    sync_adapter(repo, served, "a", 2)
    assert [f.name for _, f in adapter_entries(served, "llm")] == ["2"]
    assert not (served / "a" / "2.sig").exists()
    sync_adapter(repo, served, "a", 1)  # the undo
    assert [f.name for _, f in adapter_entries(served, "llm")] == ["1"]
    assert (served / "a" / "2" / "adapter.npz").read_bytes() == bytes([2]) * 8
    assert not (served / "a" / "2" / "adapter.json").exists()
    sync_adapter(repo, served, "a", 2)
    assert [f.name for _, f in adapter_entries(served, "llm")] == ["2"]


def test_a_version_marked_changed_has_a_newer_time_than_its_load_saw(tmp_path: Path) -> None:
    """``mark_changed``: the newest modification or status-change time under the version folder (what Triton 2.51
    compares to decide a reload) moves past what it was, and nothing else in the folder changes."""
    from model_factory.serving.served_view import mark_changed

    served = tmp_path / "served"
    _model(tmp_path / "repo")
    sync_model(tmp_path / "repo", served, "m")
    before = _tree(served / "m")
    newest = max(max(m, c) for _, m, c in before.values())
    mark_changed(served, "m", 1)
    after = _tree(served / "m")
    assert max(max(m, c) for _, m, c in after.values()) > newest
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed == {f"1/{PYCACHE_BLOCKER}"}, changed
