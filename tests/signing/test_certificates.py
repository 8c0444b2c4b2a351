"""Certificate mode: chain to the policy's root, validity now, CRLs, identities, code-signing usage."""

from __future__ import annotations

import pytest
from cryptography import x509

from model_factory.errors import FactoryError
from model_factory.signing import SignerConfig, load_policy, sign_model_version, verify_repository
from model_factory.signing.certificates import check_chain, identity_matches, load_certificates, load_crl
from model_factory.signing.keys import parse_subject
from signing_helpers import DAY, GOOD_EMAIL, GOOD_SUBJECT, NOW, build_model, make_cert, name


@pytest.fixture
def one_model(tmp_path):
    repo = tmp_path / "repo"
    build_model(repo / "encoder", (1,))
    return repo


def verify_one(repo, policy_path):
    (r,) = verify_repository(repo, load_policy(policy_path))
    return r


def sign_with(repo, leaf, **kw):
    sign_model_version(repo / "encoder", 1, SignerConfig(leaf.key, None, leaf.chain), **kw)


def test_good_certificate(one_model, pki, ca_policy):
    sign_with(one_model, pki.good)
    r = verify_one(one_model, ca_policy())
    assert r.ok, r.reasons
    assert r.signer == f"cert:{pki.good.certificate.subject.rfc4514_string()}"


def test_identity_by_san_and_any_identity(one_model, pki, ca_policy):
    sign_with(one_model, pki.good)
    assert verify_one(one_model, ca_policy(identity=f'sans = ["email:{GOOD_EMAIL}"]')).ok
    assert verify_one(one_model, ca_policy(identity="any_identity = true")).ok


def test_identity_not_allowed(one_model, pki, ca_policy):
    sign_with(one_model, pki.good)
    r = verify_one(one_model, ca_policy(identity='subjects = ["CN=someone else,O=Example Corp"]\n'
                                                 'sans = ["email:other@example.com"]'))
    assert not r.ok
    assert r.reasons == (f"signer {pki.good.certificate.subject.rfc4514_string()} (email:{GOOD_EMAIL}) is not an "
                         "identity allowed by the trust policy. Fix: add it to [certificates] subjects or sans if it "
                         "should be trusted",)


def test_certificate_from_another_ca(one_model, pki, ca_policy):
    sign_with(one_model, pki.other_ca_leaf)
    r = verify_one(one_model, ca_policy())
    assert not r.ok and r.signer is None
    assert len(r.reasons) == 1
    assert "does not chain to a CA trusted by the policy (CN=Example Root CA,O=Example Corp)" in r.reasons[0]


def test_expired_certificate(one_model, pki, ca_policy, tmp_path):
    # Sign while "valid": build the bundle with the expired leaf directly (sign refuses an expired one).
    with pytest.raises(FactoryError, match="cannot sign with certificate"):
        sign_with(one_model, pki.expired)
    _force_sign(one_model, pki.expired)
    r = verify_one(one_model, ca_policy())
    assert not r.ok
    assert r.reasons[0].startswith("signing certificate CN=model-factory release,O=Example Corp expired on ")


def test_not_yet_valid_certificate(one_model, pki, ca_policy):
    _force_sign(one_model, pki.not_yet_valid)
    r = verify_one(one_model, ca_policy())
    assert not r.ok and "is not valid yet" in r.reasons[0]


def test_revoked_certificate(one_model, pki, ca_policy):
    sign_with(one_model, pki.revoked)
    r = verify_one(one_model, ca_policy())
    assert not r.ok
    serial = f"{pki.revoked.certificate.serial_number:x}"
    assert r.reasons == (f"certificate CN=model-factory release,O=Example Corp (serial {serial}) was revoked on "
                         f"{r.reasons[0].split('revoked on ')[1].split(' per')[0]} per CRL intermediate.crl",)
    # Without CRLs in the policy, revocation is not checked (documented limit).
    assert verify_one(one_model, ca_policy(crls=())).ok


def test_stale_crl_and_missing_crl(one_model, pki, ca_policy):
    sign_with(one_model, pki.good)
    r = verify_one(one_model, ca_policy(crls=(pki.root_crl, pki.stale_intermediate_crl)))
    assert not r.ok and "is out of date" in r.reasons[0] and "fetch a current CRL" in r.reasons[0]
    r = verify_one(one_model, ca_policy(crls=(pki.intermediate_crl,)))
    assert not r.ok
    assert r.reasons[0].startswith("no CRL from CN=Example Root CA,O=Example Corp in the trust policy")


def test_leaf_not_for_code_signing(one_model, pki, ca_policy):
    _force_sign(one_model, pki.server_only)
    r = verify_one(one_model, ca_policy())
    assert not r.ok and "is not allowed to sign code" in r.reasons[0]


def test_certificate_bundle_needs_ca_in_policy(one_model, pki, key_policy):
    sign_with(one_model, pki.good)
    r = verify_one(one_model, key_policy())
    assert not r.ok and "the trust policy has no [certificates] section" in r.reasons[0]


def test_key_bundle_needs_keys_in_policy(one_model, keys, ca_policy):
    sign_model_version(one_model / "encoder", 1, SignerConfig(keys["trusted"].private))
    r = verify_one(one_model, ca_policy())
    assert not r.ok and "the trust policy lists no [[keys]]" in r.reasons[0]


def test_sign_refuses_a_chain_for_another_key(one_model, pki):
    with pytest.raises(FactoryError, match="is not for this private key"):
        sign_model_version(one_model / "encoder", 1, SignerConfig(pki.good.key, None, pki.revoked.chain))


def test_check_chain_names_an_expired_intermediate(pki, tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec
    root = load_certificates(pki.root)
    root_key = ec.generate_private_key(ec.SECP256R1())
    root2 = make_cert(name("Root 2"), root_key, None, root_key, ca=True, not_before=NOW - 9 * DAY)
    int_key = ec.generate_private_key(ec.SECP256R1())
    inter = make_cert(name("Old CA"), int_key, root2, root_key, ca=True, not_before=NOW - 9 * DAY,
                      not_after=NOW - DAY)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = make_cert(name("leaf"), leaf_key, inter, int_key, ca=False, not_before=NOW - 9 * DAY)
    res = check_chain([leaf, inter], (root2,), (), (), NOW)
    assert res.problems == (f"CA certificate CN=Old CA,O=Example Corp expired on "
                            f"{inter.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC. "
                            "Fix: re-sign with a current certificate",)
    assert check_chain([leaf, inter], tuple(root), (), (), NOW).problems  # wrong root
    assert check_chain([leaf, inter], (root2,), (), (), NOW - 2 * DAY).ok  # valid back then


def test_identity_matching_ignores_attribute_order(pki):
    leaf = pki.good.certificate
    assert identity_matches(leaf, (parse_subject(GOOD_SUBJECT),), ())
    assert identity_matches(leaf, (parse_subject("O=Example Corp,CN=model-factory release"),), ())
    assert not identity_matches(leaf, (parse_subject("CN=model-factory release"),), ())
    assert identity_matches(leaf, (), (f"email:{GOOD_EMAIL}",))


def test_load_errors(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(FactoryError, match="holds no readable X.509 certificate"):
        load_certificates(bad)
    with pytest.raises(FactoryError, match="is not a readable CRL"):
        load_crl(bad)


def _force_sign(repo, leaf) -> None:
    """Sign as sign_model_version would, skipping its own validity check (to make bad bundles)."""
    from model_factory.signing import layout
    from model_factory.signing.sign import _LoadedSigner, _sign_loaded
    from model_factory.signing.keys import load_private_key
    chain = tuple(c for p in leaf.chain for c in load_certificates(p))
    _sign_loaded(repo / "encoder", 1, _LoadedSigner(load_private_key(leaf.key), chain), None)
    assert layout.signature_path(repo / "encoder", 1).is_file()
    assert isinstance(chain[0], x509.Certificate)
