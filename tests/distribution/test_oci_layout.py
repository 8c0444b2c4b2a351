"""Push and pull through an OCI image layout on disk (no registry needed), references, layer types, release hook."""

from __future__ import annotations

import json

import pytest

from model_factory.distribution import modelpack as mp
from model_factory.distribution.oci_layout import OciLayout, fallback_tag
from model_factory.distribution.push_pull import pull, push
from model_factory.distribution.registry import parse_registry_ref
from model_factory.errors import FactoryError
from test_push_pull import snapshot


def test_references_parse_and_bad_ones_say_the_form():
    ref = parse_registry_ref("oci://registry.corp:5000/models/minilm:1")
    assert (ref.host, ref.name, ref.tag, ref.reference) == ("registry.corp:5000", "models/minilm", "1", "1")
    pinned = parse_registry_ref("oci://r/m@sha256:" + "a" * 64)
    assert pinned.reference == "sha256:" + "a" * 64
    for bad in ("registry/models/minilm:1", "oci://r/Models/X:1", "oci://r/m:bad tag"):
        with pytest.raises(FactoryError, match="oci://HOST"):
            parse_registry_ref(bad)
    with pytest.raises(FactoryError, match="neither"):
        push("repo", "m", "s3://bucket/x")


@pytest.mark.parametrize("path,media", [("1/model.onnx", mp.WEIGHT), ("1/model.int8.plan", mp.WEIGHT),
                                        ("1/model.onnx.data", mp.WEIGHT), ("1/mf_backend/executor.py", mp.CODE),
                                        ("1/model.py", mp.CODE), ("config.pbtxt", mp.WEIGHT_CONFIG),
                                        ("1/tokenizer/tokenizer.json", mp.WEIGHT_CONFIG),
                                        ("1/bom.cdx.json", mp.DOC), ("1/acceptance/inputs.json", mp.DATASET)])
def test_layer_media_types(path, media):
    assert mp.layer_media_type(path) == media


def test_layout_round_trip_and_tampering_in_the_layout(fake_repo, oci_keys, tmp_path):
    layout = tmp_path / "usb"
    pushed = push(fake_repo, "enc", f"oci-layout:{layout}:2")
    assert OciLayout(layout).tags() == ["2", fallback_tag(pushed.digest)]
    dest = tmp_path / "dest"
    pull(f"oci-layout:{layout}:2", dest, oci_keys["policy"])
    before = snapshot(dest)
    assert before == {k: v for k, v in snapshot(fake_repo).items() if k.startswith(("enc/2", "enc/config"))}

    # A swapped blob on the medium.
    manifest = json.loads((layout / "blobs" / "sha256" / pushed.digest[7:]).read_bytes())
    onnx = next(x for x in manifest["layers"] if x["annotations"][mp.FILEPATH] == "2/model.onnx")
    blob = layout / "blobs" / "sha256" / onnx["digest"][7:]
    original = blob.read_bytes()
    blob.write_bytes(original[::-1])
    with pytest.raises(FactoryError, match="does not match its digest"):
        pull(f"oci-layout:{layout}:2", dest, oci_keys["policy"])
    assert snapshot(dest) == before
    blob.write_bytes(original)

    # The referrers index without the signature.
    index_path = layout / "blobs" / "sha256" / OciLayout(layout).get_manifest(fallback_tag(pushed.digest))[1][7:]
    index = json.loads(index_path.read_bytes())
    index["manifests"] = [m for m in index["manifests"] if m["annotations"][mp.ROLE] != "signature"]
    OciLayout(layout).put_manifest(json.dumps(index).encode(), mp.OCI_MANIFEST.replace("manifest", "index"),
                                   fallback_tag(pushed.digest))
    with pytest.raises(FactoryError, match="no signature attached"):
        pull(f"oci-layout:{layout}:2", dest, oci_keys["policy"])
    assert snapshot(dest) == before


def test_release_files_travel_and_the_release_hook_can_refuse(fake_repo, oci_keys, tmp_path):
    """The attach point for the release layer: files attached at push, handed to a hook at pull."""
    release = tmp_path / "release"
    release.mkdir()
    (release / "timestamp.json").write_text('{"signed": {"version": 7}}')
    (release / "targets.json").write_text('{"signed": {"targets": {}}}')
    layout = f"oci-layout:{tmp_path / 'usb'}:2"
    pushed = push(fake_repo, "enc", layout, release_files=sorted(release.iterdir()))
    assert set(pushed.referrers) == {"signature", "bom", "release"}
    seen = {}

    def accept(model_dir, version, files):
        seen.update({p.name: p.read_text() for p in files}, model=model_dir.name, version=version)

    pull(layout, tmp_path / "dest", oci_keys["policy"], release_check=accept)
    assert seen == {"model": "enc", "version": 2, "timestamp.json": '{"signed": {"version": 7}}',
                    "targets.json": '{"signed": {"targets": {}}}'}

    def refuse(model_dir, version, files):
        raise FactoryError("release metadata says version 3 is current: rollback refused")

    before = snapshot(tmp_path / "dest")
    with pytest.raises(FactoryError, match="rollback refused"):
        pull(layout, tmp_path / "dest", oci_keys["policy"], release_check=refuse)
    assert snapshot(tmp_path / "dest") == before


def test_push_refuses_unsigned_or_changed_versions(fake_repo, tmp_path):
    (fake_repo / "enc" / "2.sig").unlink()
    with pytest.raises(FactoryError, match="not signed"):
        push(fake_repo, "enc", f"oci-layout:{tmp_path / 'l'}:2")
    (fake_repo / "enc" / "1" / "model.onnx").write_bytes(b"changed")
    with pytest.raises(FactoryError, match="changed since it was signed"):
        push(fake_repo, "enc", f"oci-layout:{tmp_path / 'l'}:1", version=1)


def test_bom_of_a_fake_model_validates_and_lists_every_other_file(fake_repo):
    from model_factory.distribution.bom import read_bom, validate_bom
    from model_factory.signing import signed_digests

    text, signed = read_bom(fake_repo, "enc", 1)
    doc = json.loads(text)
    validate_bom(doc)
    assert signed
    digests = signed_digests(fake_repo / "enc", 1)
    digests.pop("1/bom.cdx.json")
    assert {c["name"]: c["hashes"][0]["content"] for c in doc["components"] if c["type"] == "file"} == digests
    # A version signed without a BOM gets one built now from its files (and says so).
    (fake_repo / "enc" / "1" / "bom.cdx.json").unlink()
    text, signed = read_bom(fake_repo, "enc", 1)
    assert not signed
    validate_bom(text)
