"""Trust policy TOML: a good policy parses into frozen dataclasses, a bad one names field and fix."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from model_factory.errors import FactoryError
from model_factory.signing import load_policy


def write(tmp_path, text):
    p = tmp_path / "policy.toml"
    p.write_text(text)
    return p


def test_full_policy(tmp_path, keys, pki):
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "release.pub").write_bytes(keys["trusted"].public.read_bytes())
    p = write(tmp_path, f'''
version = 1

[[keys]]
name = "release-2026"
path = "keys/release.pub"
expires = 2027-06-30

[[keys]]
name = "release-2027"
path = "{keys["trusted384"].public}"

[certificates]
roots = ["{pki.root}"]
intermediates = ["{pki.intermediate}"]
crls = ["{pki.root_crl}", "{pki.intermediate_crl}"]
subjects = ["CN=model-factory release,O=Example Corp"]
sans = ["email:ml-release@example.com", "uri:https://ci.example.com"]

[provenance]
required = true
builder_ids = ["https://ci.example.com/model-factory"]
''')
    policy = load_policy(p)
    assert [k.name for k in policy.keys] == ["release-2026", "release-2027"]
    assert policy.keys[0].path == tmp_path / "keys" / "release.pub"  # relative to the policy file
    assert policy.keys[0].expires == dt.datetime(2027, 6, 30, 23, 59, 59, tzinfo=dt.timezone.utc)
    assert policy.keys[1].expires is None
    assert len(policy.certificates.roots) == 1 and len(policy.certificates.crls) == 2
    assert policy.certificates.sans == ("email:ml-release@example.com", "uri:https://ci.example.com")
    assert policy.provenance.required and policy.provenance.builder_ids == ("https://ci.example.com/model-factory",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.keys = ()  # type: ignore[misc]


@pytest.mark.parametrize("body, message", [
    ("", "trusts no one"),
    ("version = 2\n[[keys]]\nname='a'\npath='{pub}'\n", "field 'version'"),
    ("color = 'blue'\n", "field 'color': unknown key"),
    ("[[keys]]\npath='{pub}'\n", r"field 'keys\[0\].name': missing"),
    ("[[keys]]\nname='a'\npath='missing.pub'\n", r"field 'keys\[0\].path': .*missing.pub does not exist"),
    ("[[keys]]\nname='a'\npath='{priv}'\n", r"field 'keys\[0\].path'.*not a PEM public key"),
    ("[[keys]]\nname='a'\npath='{pub}'\ncolour='x'\n", r"field 'keys\[0\].colour': unknown key"),
    ("[[keys]]\nname='a'\npath='{pub}'\n[[keys]]\nname='a'\npath='{pub}'\n", "duplicate key names"),
    ("[[keys]]\nname='a'\npath='{pub}'\nexpires='soon'\n", "expected a TOML date"),
    ("[certificates]\nroots=[]\nany_identity=true\n", "no CA root given"),
    ("[certificates]\nroots=['{root}']\n", "no allowed signer identity"),
    ("[certificates]\nroots=['{root}']\nsans=['ml@example.com']\n", "has no type prefix"),
    ("[certificates]\nroots=['{root}']\nsubjects=['nonsense']\n", "not an RFC 4514 name"),
    ("[certificates]\nroots=['{root}']\nany_identity='yes'\n", "expected true or false"),
    ("[certificates]\nroots='{root}'\nany_identity=true\n", "expected a list of strings"),
    ("[certificates]\nroots=['{root}']\ncrls=['{root}']\nany_identity=true\n", "is not a readable CRL"),
    ("[[keys]]\nname='a'\npath='{pub}'\n[provenance]\nrequired=1\n", "field 'provenance.required'"),
    ("[[keys]]\nname='a'\npath='{pub}'\n[provenance]\nbuilders=[]\n", "field 'provenance.builders': unknown"),
    ("this is not toml", "not valid TOML"),
])
def test_bad_policies(tmp_path, keys, pki, body, message):
    p = write(tmp_path, body.format(pub=keys["trusted"].public, priv=keys["trusted"].private, root=pki.root))
    with pytest.raises(FactoryError, match=message):
        load_policy(p)


def test_missing_policy_file(tmp_path):
    with pytest.raises(FactoryError, match="does not exist. Fix: pass the policy file"):
        load_policy(tmp_path / "nope.toml")
