"""The signed statement: OMS v1.0 layout, strict parsing, readable differences."""

from __future__ import annotations

import copy
import hashlib

import pytest

from model_factory.signing.digests import root_digest
from model_factory.signing.manifest import (PREDICATE_TYPE, ManifestError, build_manifest, check_relpath,
                                            describe_differences, parse_statement)

D = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("config.pbtxt", "1/a", "1/a-b/c", "1/a/b")}


def statement():
    return build_manifest("encoder", D, 1, empty_dirs=["1/tok"], ignore_paths=["2", "1.sig"]).to_statement()


def test_statement_layout():
    st = statement()
    assert st["_type"] == "https://in-toto.io/Statement/v1"
    assert st["predicateType"] == PREDICATE_TYPE
    # OMS v1.0 5.2.1: code point order ('-' < '/'), not model_signing's component order.
    assert [r["name"] for r in st["predicate"]["resources"]] == ["1/a", "1/a-b/c", "1/a/b", "config.pbtxt"]
    assert set(st["predicate"]) == {"resources", "serialization"}
    assert st["subject"] == [{"name": "encoder", "digest": {"sha256": root_digest(
        r["digest"] for r in st["predicate"]["resources"])}}]
    assert st["predicate"]["serialization"] == {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
                                                "ignore_paths": ["1.sig", "2"]}
    first, *rest = st["predicate"]["resources"]
    assert first["annotations"] == {"model_factory": {"format": 2, "version": 1, "empty_directories": ["1/tok"]}}
    assert not any("annotations" in r for r in rest)


def test_legacy_predicate_member_still_read():
    # model-factory 0.1 wrote the version and empty folders as a predicate member.
    st = statement()
    st["predicate"]["resources"][0].pop("annotations")
    st["predicate"]["model_factory"] = {"format": 1, "version": 1, "empty_directories": ["1/tok"]}
    m = parse_statement(st)
    assert m.version == 1 and m.empty_dirs == ("1/tok",)


def _ext(st):
    return st["predicate"]["resources"][0]["annotations"]["model_factory"]


def test_parse_round_trip():
    m = parse_statement(statement())
    assert m.digests() == D and m.version == 1 and m.empty_dirs == ("1/tok",) and m.model_name == "encoder"
    assert m.ignore_paths == ("1.sig", "2")


def _broken(edit):
    st = copy.deepcopy(statement())
    edit(st)
    return st


def _refresh_root(st):
    st["subject"][0]["digest"]["sha256"] = root_digest(r["digest"] for r in st["predicate"]["resources"])


@pytest.mark.parametrize("edit, message", [
    (lambda st: st.update(_type="x"), "statement type"),
    (lambda st: st.update(predicateType="https://model_signing/Digests/v0.1"), "pre-1.0 format"),
    (lambda st: st.update(predicateType="https://slsa.dev/provenance/v1"), "predicate type"),
    (lambda st: st.update(subject=[]), "exactly one subject"),
    (lambda st: st["predicate"]["serialization"].update(hash_type="blake3"), "hash type 'blake3'"),
    (lambda st: st["predicate"]["serialization"].update(method="tensors"), "method 'tensors'"),
    (lambda st: st["predicate"]["resources"][0].update(digest="abc"), "has no sha256 digest"),
    (lambda st: st["predicate"]["resources"].append(dict(st["predicate"]["resources"][0])), "listed twice"),
    (lambda st: (st["predicate"]["resources"][0].update(name="1/./a"), _refresh_root(st)), "not a normalized path"),
    (lambda st: (st["predicate"]["resources"][0].update(name="a/../../b"), _refresh_root(st)), "through '..'"),
    (lambda st: st["predicate"]["resources"].pop(), "statement is inconsistent"),
    (lambda st: _ext(st).update(format=9), "unknown format"),
    (lambda st: _ext(st).update(empty_directories=["/tmp"]), "absolute path"),
    (lambda st: st["predicate"].update(extra={}), "OMS v1.0 does not allow"),
    (lambda st: st.update(extra={}), "statement does not allow"),
    (lambda st: st["predicate"]["serialization"].update(allow_symlinks=True), "allow_symlinks = true"),
    (lambda st: (st["predicate"].update(resources=[]), _refresh_root(st)), "lists no file"),
    (lambda st: st["predicate"]["resources"][1].update(annotations={"model_factory": {"format": 2}}),
     "2 model-factory annotations"),
])
def test_parse_rejects(edit, message):
    with pytest.raises(ManifestError, match=message):
        parse_statement(_broken(edit))


def test_check_relpath():
    assert check_relpath("1/model.onnx") is None
    for bad in ("", "/abs", "../x", "a//b", "a/", "./a", "a\x00b", 3):
        assert check_relpath(bad) is not None, bad


def test_differences():
    m = build_manifest("encoder", D, 1, empty_dirs=["1/tok"])
    actual = {p: (d,) for p, d in D.items()}
    assert describe_differences(m, actual, ["1/tok"]) == []
    actual["1/renamed"] = actual.pop("1/a")
    actual["config.pbtxt"] = ("0" * 64,)
    del actual["1/a/b"]
    actual["1/new"] = ("1" * 64,)
    assert describe_differences(m, actual, ["1/other"]) == [
        "file 1/a was renamed to 1/renamed (same content, path not signed)",
        "file 1/a/b is signed but missing",
        "file 1/new is not covered by the signature (added after signing)",
        f"file config.pbtxt changed: sha256 {'0' * 16}... on disk, {D['config.pbtxt'][:16]}... signed",
        "empty folder 1/tok is signed but missing (or no longer empty)",
        "empty folder 1/other is not covered by the signature",
    ]
