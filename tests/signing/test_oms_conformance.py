"""OMS v1.0 conformance: our bundles against the spec's JSON Schemas, and the spec's test vectors.

The schemas and vectors are vendored in ``data/oms-v1.0`` (see its README for the source commit).
The spec (§3.1) asks conformance suites to validate bundles against all four schemas: the bundle
schema pulls in the envelope schema, and the decoded payload goes through the statement schema,
which pulls in the predicate schema. The method check mirrors the spec's own validator
(``schemas/__init__.py``: ``validate_method_fields``).
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest

from model_factory.signing import SignerConfig, load_policy, sign_model_version, verify_repository
from model_factory.signing.bundle import BundleError, parse_bundle
from model_factory.signing.manifest import ManifestError, Manifest, parse_statement

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (extra: test)")
referencing = pytest.importorskip("referencing")

OMS = Path(__file__).parent / "data" / "oms-v1.0"
VECTORS = OMS / "test-vectors" / "v1.0"


def _validators():
    from referencing.jsonschema import DRAFT202012

    schemas = {p.name: json.loads(p.read_text()) for p in (OMS / "schemas" / "v1.0").glob("*.json")}
    registry = referencing.Registry().with_resources(
        (s["$id"], referencing.Resource.from_contents(s, default_specification=DRAFT202012)) for s in schemas.values())
    return (jsonschema.Draft202012Validator(schemas["bundle.schema.json"], registry=registry),
            jsonschema.Draft202012Validator(schemas["statement.schema.json"], registry=registry))


BUNDLE_SCHEMA, STATEMENT_SCHEMA = _validators()
METHOD_FIELD = {"key": "publicKey", "certificate": "x509CertificateChain", "sigstore": "certificate"}


def schema_errors(doc: dict, method: str | None = None) -> list[str]:
    """Every schema violation of a bundle document and of its decoded statement (empty = conforms)."""
    errors = [e.message for e in BUNDLE_SCHEMA.iter_errors(doc)]
    if errors:
        return errors
    statement = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"]))
    errors = [e.message for e in STATEMENT_SCHEMA.iter_errors(statement)]
    if method is not None:
        present = [m for m, field in METHOD_FIELD.items() if field in doc["verificationMaterial"]]
        if present != [method]:
            errors.append(f"verificationMaterial is for {present}, not the {method} method")
        if method == "sigstore" and not doc["verificationMaterial"].get("tlogEntries"):
            errors.append("a sigstore bundle needs tlogEntries")
    return errors


def _doc(path: Path) -> dict:
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- what we write


def test_key_bundles_conform(repo, keys):
    for label in ("trusted", "trusted384"):
        sig = sign_model_version(repo / "encoder", 1, SignerConfig(keys[label].private))
        assert schema_errors(_doc(sig), "key") == []


def test_p521_bundle_conforms_and_verifies(repo, tmp_path):
    from model_factory.signing import generate_keypair, signed_digests

    paths = generate_keypair(tmp_path / "k", "P-521")
    assert schema_errors(_doc(sign_model_version(repo / "encoder", 1, SignerConfig(paths.private_key))), "key") == []
    policy = tmp_path / "policy.toml"
    policy.write_text(f'version = 1\n[[keys]]\nname = "p521"\npath = "{paths.public_key}"\n')
    result = {(r.model, r.version): r for r in verify_repository(repo, load_policy(policy))}[("encoder", 1)]
    assert result.ok and result.signer == "key:p521", result.reasons
    # The digests serve hands to the backend's load-time check come from a P-521 verification too.
    assert "1/model.onnx" in signed_digests(repo / "encoder", 1, load_policy(policy))


def test_certificate_chain_bundle_conforms(repo, pki):
    sig = sign_model_version(repo / "encoder", 1, SignerConfig(pki.good.key, certificate_chain=pki.good.chain))
    assert schema_errors(_doc(sig), "certificate") == []


def test_bundle_with_empty_folders_and_provenance_conforms(repo, keys):
    # The model-factory annotation (version, empty folders) rides on a resource descriptor, which the
    # predicate schema leaves open; the predicate itself holds only resources and serialization.
    (repo / "encoder" / "1" / "tokenizer").mkdir()
    sig = sign_model_version(repo / "encoder", 1, SignerConfig(keys["trusted"].private), provenance={
        "source_model_digest": "0" * 64, "recipe": {"model": {"name": "encoder"}}, "tool_versions": {},
        "precisions": ["fp32"]})
    doc = _doc(sig)
    assert schema_errors(doc, "key") == []
    statement = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"]))
    assert set(statement["predicate"]) == {"resources", "serialization"}
    assert statement["predicate"]["resources"][0]["annotations"]["model_factory"]["empty_directories"] == \
        ["1/tokenizer"]
    # The provenance is a SLSA statement, not an OMS one: its bundle still has the OMS bundle's shape.
    assert [e.message for e in BUNDLE_SCHEMA.iter_errors(_doc(repo / "encoder" / "1.provenance.sig"))] == []


def test_shard_statement_conforms():
    # We verify shard manifests (model_signing writes them); their statement has the spec's shape.
    m = Manifest("m", (("1/w.bin:0:4096", "a" * 64), ("1/w.bin:4096:5000", "b" * 64)), "shards", 4096)
    assert [e.message for e in STATEMENT_SCHEMA.iter_errors(m.to_statement())] == []
    assert parse_statement(m.to_statement()).shard_size == 4096


def test_schema_refuses_the_old_predicate_member():
    # Why the format changed: 0.1 wrote a "model_factory" predicate member, which the schema forbids.
    golden = Path(__file__).parent / "data" / "golden-0.1.0" / "repo" / "golden" / "1.sig"
    errors = schema_errors(_doc(golden), "key")
    assert errors and "model_factory" in errors[0]


# --------------------------------------------------------------------------- the spec's vectors


@pytest.mark.parametrize("name, method", [("key", "key"), ("certificate", "certificate")])
def test_valid_vectors_parse(name, method):
    path = VECTORS / "valid" / f"{name}.bundle.json"
    assert schema_errors(_doc(path), method) == []
    bundle = parse_bundle(path.read_bytes())
    manifest = parse_statement(bundle.statement())
    assert manifest.method == "files" and [n for n, _ in manifest.items] == ["signme-1", "signme-2"]
    assert "ignore-me" in manifest.ignore_paths
    if method == "certificate":
        # The DSSE signature (PAE over the payload) checks out with the leaf's key: same encoding as ours.
        assert bundle.verify_with(bundle.chain()[0].public_key())


def test_valid_sigstore_vector_is_refused_clearly():
    # Schema-valid, but keyless signing needs the transparency log, which offline verification cannot check.
    path = VECTORS / "valid" / "sigstore.bundle.json"
    assert schema_errors(_doc(path), "sigstore") == []
    with pytest.raises(BundleError, match=r"sigstore \(keyless\) method.*Fix: sign with a key"):
        parse_bundle(path.read_bytes())


@pytest.mark.parametrize("name, message", [
    ("empty", "not JSON"),
    ("missing-envelope", "dsseEnvelope is missing"),
    ("missing-tlog-entries", "sigstore method's field and needs tlogEntries"),
    ("missing-verification-material", "verificationMaterial is missing"),
])
def test_invalid_vectors_are_refused(name, message):
    path = VECTORS / "invalid" / f"{name}.bundle.json"
    text = path.read_text()
    if text.strip():
        assert schema_errors(json.loads(text)) != []
    with pytest.raises(BundleError, match=message):
        parse_bundle(path.read_bytes())


def test_invalid_payload_vector_is_refused():
    path = VECTORS / "invalid-payload" / "wrong-predicate.bundle.json"
    assert schema_errors(_doc(path)) != []
    with pytest.raises(ManifestError, match="predicate type is 'https://example.com/wrong-predicate/v1.0'"):
        parse_statement(parse_bundle(path.read_bytes()).statement())


def test_vector_in_a_repository_gives_a_clear_reason(repo, keys, key_policy):
    # Dropped in as a model version's signature, the vector is refused with the reason, not a traceback.
    shutil.copyfile(VECTORS / "valid" / "sigstore.bundle.json", repo / "encoder" / "1.sig")
    result = {(r.model, r.version): r for r in verify_repository(repo, load_policy(key_policy()))}[("encoder", 1)]
    assert not result.ok and "sigstore (keyless) method" in result.reasons[0]


@pytest.mark.parametrize("sig, method", [("1.sig", "key"), ("2.sig", "certificate")])
def test_golden_bundles_of_this_format_conform(sig, method):
    # Kept forever beside golden-0.1.0 (test_golden.py checks that both keep verifying).
    path = Path(__file__).parent / "data" / "golden-oms-1.0" / "repo" / "golden" / sig
    assert schema_errors(_doc(path), method) == []


def test_historical_relaxations(repo, keys, key_policy):
    # OMS v1.0 11.2: pre-1.1 bundles name the key by rawBytes, keyid may be null or absent, no ignore_paths.
    sig = sign_model_version(repo / "ranker", 3, SignerConfig(keys["trusted"].private))
    doc = _doc(sig)
    doc["verificationMaterial"]["publicKey"] = {"rawBytes": base64.b64encode(b"pem bytes").decode()}
    for keyid in (None, "", "absent"):
        signature = doc["dsseEnvelope"]["signatures"][0]
        signature.pop("keyid", None)
        if keyid != "absent":
            signature["keyid"] = keyid
        sig.write_text(json.dumps(doc))
        assert parse_bundle(sig.read_bytes()).key_hint is None
        result = {(r.model, r.version): r for r in verify_repository(repo, load_policy(key_policy()))}[("ranker", 3)]
        assert result.ok and result.signer == "key:release", result.reasons


def test_an_empty_model_is_not_signed(tmp_path, keys):
    # OMS v1.0 6.1: at least one regular file after the exclusions.
    from model_factory.errors import FactoryError

    model = tmp_path / "repo" / "m"
    (model / "1" / "empty").mkdir(parents=True)
    (model / ".git").mkdir()
    (model / ".git" / "HEAD").write_text("ref")
    with pytest.raises(FactoryError, match="it holds no file"):
        sign_model_version(model, 1, SignerConfig(keys["trusted"].private))
