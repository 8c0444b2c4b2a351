"""Signed build provenance: built from the pipeline's facts, bound to the signed model version."""

from __future__ import annotations

import datetime as dt
import hashlib
import shutil
from pathlib import Path

import pytest

from model_factory.errors import FactoryError
from model_factory.signing import (BuildProvenance, SignerConfig, load_policy, provenance_path, sign_model_version,
                                   sign_repository, verify_repository)
from model_factory.signing.bundle import parse_bundle

FACTS = {
    "source_model_digest": "sha256:" + hashlib.sha256(b"model").hexdigest(),
    "source_model": "sentence-transformers/all-MiniLM-L6-v2",
    "calibration_data_digest": hashlib.sha256(b"calib").hexdigest(),
    "recipe": {"model": {"name": "encoder", "version": 1}, "source": {"path": Path("/models/minilm")}},
    "tool_versions": {"model-factory": "0.1.0", "onnx": "1.17.0", "tensorrt-rtx": "1.7.1.116"},
    "precisions": ["fp32", "fp16", "int8"],
    "accuracy_report": {"int8": {"cosine_mean": 0.993, "passed": True}},
    "builder_id": "https://ci.example.com/model-factory",
    "started_on": dt.datetime(2026, 11, 29, 10, 0, tzinfo=dt.timezone.utc),
    "finished_on": "2026-11-29T10:05:00Z",
}


def by_version(repo, policy):
    return {(r.model, r.version): r for r in verify_repository(repo, load_policy(policy))}


def test_statement_content(repo, keys):
    sign_model_version(repo / "encoder", 1, SignerConfig(keys["trusted"].private), provenance=FACTS)
    sig = parse_bundle((repo / "encoder" / "1.sig").read_text()).statement()
    prov = parse_bundle(provenance_path(repo / "encoder", 1).read_text()).statement()
    assert prov["predicateType"] == "https://slsa.dev/provenance/v1"
    assert prov["subject"] == sig["subject"]  # the very model version that was signed
    bd, run = prov["predicate"]["buildDefinition"], prov["predicate"]["runDetails"]
    assert bd["resolvedDependencies"] == [
        {"name": "source-model", "digest": {"sha256": hashlib.sha256(b"model").hexdigest()},
         "uri": "sentence-transformers/all-MiniLM-L6-v2"},
        {"name": "calibration-data", "digest": {"sha256": hashlib.sha256(b"calib").hexdigest()}}]
    assert bd["externalParameters"]["recipe"]["source"]["path"] == "/models/minilm"
    assert bd["externalParameters"]["precisions"] == ["fp32", "fp16", "int8"]
    assert run["builder"] == {"id": FACTS["builder_id"], "version": FACTS["tool_versions"]}
    assert run["metadata"] == {"startedOn": "2026-11-29T10:00:00Z", "finishedOn": "2026-11-29T10:05:00Z"}
    assert run["byproducts"][0]["annotations"] == FACTS["accuracy_report"]


def test_statement_lists_every_output_and_the_rebuild_facts(repo, keys, key_policy):
    # The signer adds every file of the signed unit with its digest; TensorRT plans are marked as the
    # files a rebuild cannot reproduce. The recipe file, cost model and stage times ride along.
    (repo / "encoder" / "1" / "model.fp16.plan").write_bytes(b"plan")
    (repo / "encoder" / "1" / "model.fp16.plan.json").write_text("{}")
    facts = FACTS | {"recipe_path": "/recipes/encoder.toml", "queue_cost_model": [0.002, 1e-6, 1e-9],
                     "stage_seconds": {"export": 12.5}}
    sign_model_version(repo / "encoder", 1, SignerConfig(keys["trusted"].private), provenance=facts)
    signed = parse_bundle((repo / "encoder" / "1.sig").read_text()).statement()["predicate"]["resources"]
    prov = parse_bundle(provenance_path(repo / "encoder", 1).read_text()).statement()["predicate"]
    outputs = {b["name"]: b for b in prov["runDetails"]["byproducts"] if b["annotations"].get("kind") == "output"}
    assert {n: b["digest"]["sha256"] for n, b in outputs.items()} == {r["name"]: r["digest"] for r in signed}
    assert sorted(n for n, b in outputs.items() if not b["annotations"]["reproducible"]) == [
        "1/model.fp16.plan", "1/model.fp16.plan.json"]
    assert prov["buildDefinition"]["internalParameters"] == {
        "toolVersions": FACTS["tool_versions"], "recipePath": "/recipes/encoder.toml",
        "queueCostModel": [0.002, 1e-6, 1e-9]}
    assert {"name": "stage-seconds", "annotations": {"export": 12.5}} in prov["runDetails"]["byproducts"]
    assert by_version(repo, key_policy())[("encoder", 1)].ok


@pytest.mark.parametrize("change, message", [
    ({"colour": "red"}, "provenance key 'colour' is unknown"),
    ({"source_model_digest": None}, "'source_model_digest' is missing"),
    ({"source_model_digest": "md5:abc"}, "is not a sha256 hex digest"),
    ({"tool_versions": {"onnx": 1}}, "must map tool names to version strings"),
    ({"precisions": "fp32"}, "must be a list of strings"),
    ({"recipe": {"x": object()}}, "holds a object, which is not JSON data"),
    ({"accuracy_report": {"x": float("nan")}}, "which JSON cannot carry"),
    ({"started_on": "yesterday"}, "is not an ISO 8601 time"),
])
def test_bad_facts(change, message):
    with pytest.raises(FactoryError, match=message):
        BuildProvenance.from_mapping({**FACTS, **change})


def test_required_provenance(repo, keys, key_policy):
    signer = SignerConfig(keys["trusted"].private)
    sign_repository(repo, signer)
    sign_model_version(repo / "encoder", 2, signer, provenance=FACTS)
    results = by_version(repo, key_policy("[provenance]\nrequired = true\n"))
    assert results[("encoder", 2)].ok
    assert results[("encoder", 1)].reasons == ("no signed provenance (1.provenance.sig), which the trust policy "
                                               "requires. Fix: sign this version with the build's provenance "
                                               "(model-factory build, or sign --provenance)",)
    assert by_version(repo, key_policy())[("encoder", 1)].ok  # not required: absence is fine


def test_provenance_from_another_version_is_refused(repo, keys, key_policy):
    signer = SignerConfig(keys["trusted"].private)
    sign_repository(repo, signer, provenance=FACTS)
    shutil.copyfile(provenance_path(repo / "encoder", 2), provenance_path(repo / "encoder", 1))
    r = by_version(repo, key_policy())[("encoder", 1)]
    assert r.reasons == ("1.provenance.sig: provenance is for another build or version (its subject does not match "
                         "the signed model version). Fix: re-sign this version with its own provenance",)


def test_tampered_or_untrusted_provenance(repo, keys, key_policy):
    sign_repository(repo, SignerConfig(keys["trusted"].private), provenance=FACTS)
    p = provenance_path(repo / "ranker", 3)
    p.write_text(p.read_text().replace('"sig":"', '"sig":"AAAA', 1))
    sign_model_version(repo / "encoder", 2, SignerConfig(keys["trusted"].private))
    sign_model_version(repo / "encoder", 1, SignerConfig(keys["trusted"].private))
    from model_factory.signing.keys import load_private_key
    from model_factory.signing.provenance import BuildProvenance as BP, provenance_statement
    from model_factory.signing.bundle import sign_statement
    from model_factory.signing.manifest import parse_statement
    root = parse_statement(parse_bundle((repo / "encoder" / "1.sig").read_text()).statement()).root_digest
    rogue = sign_statement(provenance_statement("encoder", root, BP.from_mapping(FACTS)),
                           load_private_key(keys["other"].private))
    provenance_path(repo / "encoder", 1).write_text(rogue.to_json())
    results = by_version(repo, key_policy())
    assert results[("ranker", 3)].reasons[0].startswith("provenance 3.provenance.sig: the bundle's signature does "
                                                        "not verify with key release")
    assert results[("encoder", 1)].reasons[0].startswith("provenance 1.provenance.sig: signed by an unknown key")
    assert results[("encoder", 2)].ok  # re-signed without provenance: the old one was removed
    assert not provenance_path(repo / "encoder", 2).exists()


def test_builder_ids(repo, keys, key_policy):
    sign_repository(repo, SignerConfig(keys["trusted"].private), provenance=FACTS)
    assert by_version(repo, key_policy(f'[provenance]\nbuilder_ids = ["{FACTS["builder_id"]}"]\n'))[("encoder", 1)].ok
    r = by_version(repo, key_policy('[provenance]\nbuilder_ids = ["https://other"]\n'))[("encoder", 1)]
    assert "provenance builder 'https://ci.example.com/model-factory' is not allowed" in r.reasons[0]
