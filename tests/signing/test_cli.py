"""The sign / verify / keygen commands through click's CliRunner: output, JSON and exit codes."""

from __future__ import annotations

import json
import stat

import click
import pytest
from click.testing import CliRunner

from model_factory.cli.signing import COMMANDS, keygen, sign, verify


@pytest.fixture
def runner():
    return CliRunner()


def test_every_command_has_help(runner):
    assert [c.name for c in COMMANDS] == ["sign", "verify", "keygen"]
    for cmd in COMMANDS:
        res = runner.invoke(cmd, ["--help"])
        assert res.exit_code == 0 and "Example" in res.output, cmd.name


def test_keygen(runner, tmp_path):
    pw = tmp_path / "pw.txt"
    pw.write_text("s3cret\n")
    res = runner.invoke(keygen, [str(tmp_path / "k"), "--curve", "P-384", "--password-file", str(pw),
                                 "--csr-subject", "CN=model-factory CI,O=Example Corp"])
    assert res.exit_code == 0, res.output
    assert "signing-key.csr" in res.output
    assert stat.S_IMODE((tmp_path / "k" / "signing-key.pem").stat().st_mode) == 0o600
    again = runner.invoke(keygen, [str(tmp_path / "k")])
    assert again.exit_code == 1 and "already exists" in again.output and "Traceback" not in again.output


def test_keygen_prompts_for_a_password(runner, tmp_path):
    res = runner.invoke(keygen, [str(tmp_path / "k"), "--ask-password"], input="pw\npw\n")
    assert res.exit_code == 0, res.output
    assert b"ENCRYPTED" in (tmp_path / "k" / "signing-key.pem").read_bytes()


def test_sign_and_verify(runner, repo, keys, key_policy):
    res = runner.invoke(sign, [str(repo), "--key", str(keys["trusted"].private)])
    assert res.exit_code == 0, res.output
    assert res.output.count("signed ") == 3
    policy = str(key_policy())
    res = runner.invoke(verify, ["--policy", policy, str(repo)])
    assert res.exit_code == 0, res.output
    assert "OK    encoder/1  signed by key:release (6 files)" in res.output
    assert res.output.strip().endswith("3 of 3 model versions verified")

    (repo / "encoder" / "1" / "model.onnx").write_bytes(b"tampered")
    res = runner.invoke(verify, ["--policy", policy, str(repo)])
    assert res.exit_code == 1
    assert "FAIL  encoder/1\n      - file 1/model.onnx changed" in res.output
    assert res.output.strip().endswith("2 of 3 model versions verified; 1 failed")


def test_verify_json(runner, repo, keys, key_policy):
    runner.invoke(sign, [str(repo), "--key", str(keys["trusted"].private)])
    (repo / "ranker" / "3" / "extra.txt").write_text("x")
    res = runner.invoke(verify, ["--json", "--policy", str(key_policy()), str(repo)])
    assert res.exit_code == 1
    records = json.loads(res.stdout)
    assert [(r["model"], r["version"], r["ok"]) for r in records] == [("encoder", 1, True), ("encoder", 2, True),
                                                                      ("ranker", 3, False)]
    assert set(records[0]) == {"model", "version", "ok", "reasons", "signer", "files"}
    assert records[2]["reasons"] == ["file 3/extra.txt is not covered by the signature (added after signing)"]
    assert records[0]["signer"] == "key:release" and records[0]["reasons"] == []


def test_sign_one_version_with_certificate_and_provenance(runner, repo, pki, ca_policy, tmp_path):
    facts = tmp_path / "build.json"
    facts.write_text(json.dumps({"source_model_digest": "a" * 64, "recipe": {}, "tool_versions": {"mf": "0.1.0"},
                                 "precisions": ["fp32"]}))
    args = [str(repo), "--key", str(pki.good.key), "--cert-chain", str(pki.good.cert), "--cert-chain",
            str(pki.intermediate), "--model", "encoder", "--version", "2", "--provenance", str(facts)]
    res = runner.invoke(sign, args)
    assert res.exit_code == 0, res.output
    assert (repo / "encoder" / "2.provenance.sig").is_file() and not (repo / "encoder" / "1.sig").exists()
    res = runner.invoke(verify, ["--json", "--policy", str(ca_policy(extra="[provenance]\nrequired = true")),
                                 str(repo)])
    ok = {(r["model"], r["version"]): r["ok"] for r in json.loads(res.stdout)}
    assert ok == {("encoder", 1): False, ("encoder", 2): True, ("ranker", 3): False} and res.exit_code == 1


def test_user_errors_are_clean(runner, repo, keys, tmp_path):
    bad_policy = tmp_path / "p.toml"
    bad_policy.write_text("[certificates]\n")
    res = runner.invoke(verify, ["--policy", str(bad_policy), str(repo)])
    assert res.exit_code == 1 and res.output.startswith("Error: trust policy field") and "Traceback" not in res.output
    res = runner.invoke(verify, ["--policy", str(tmp_path / "none.toml"), str(repo)])
    assert res.exit_code == 1 and "does not exist" in res.output
    res = runner.invoke(sign, [str(repo), "--key", str(keys["trusted"].private), "--model", "encoder"])
    assert res.exit_code == 2 and "--model and --version together" in res.output
    bad_json = tmp_path / "b.json"
    bad_json.write_text("{")
    res = runner.invoke(sign, [str(repo), "--key", str(keys["trusted"].private), "--provenance", str(bad_json)])
    assert res.exit_code == 1 and "is not JSON" in res.output


def test_commands_register_on_a_group():
    group = click.Group("model-factory")
    for cmd in COMMANDS:
        group.add_command(cmd)
    assert sorted(group.commands) == ["keygen", "sign", "verify"]
