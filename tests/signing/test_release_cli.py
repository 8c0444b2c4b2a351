"""``model-factory release init|add|timestamp|rotate-root|show`` and ``verify`` with a [release] policy, via CliRunner."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric import ec

from model_factory.cli.main import main
from model_factory.signing import SignerConfig, sign_model_version, sign_repository

from signing_helpers import build_model, write_key, write_pub

pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")


def _pair(d: Path, label: str) -> tuple[Path, Path]:
    k = ec.generate_private_key(ec.SECP256R1())
    return write_key(k, d / f"{label}.pem"), write_pub(k, d / f"{label}.pub")


def test_release_commands_and_verify(tmp_path: Path, keys) -> None:
    run = CliRunner().invoke
    repo = tmp_path / "repo"
    build_model(repo / "encoder", (1,))
    signer = SignerConfig(keys["trusted"].private)
    sign_repository(repo, signer)
    kd = tmp_path / "keys"
    kd.mkdir()
    (ra, _), (rb, _), (rn, _) = _pair(kd, "root-a"), _pair(kd, "root-b"), _pair(kd, "root-new")
    (tk, tp), (ok, op) = _pair(kd, "targets"), _pair(kd, "online")

    r = run(main, ["release", "init", str(repo), "--root-key", str(ra), "--root-key", str(rb), "--targets-pub", str(tp),
                   "--snapshot-pub", str(op), "--timestamp-pub", str(op)])
    assert r.exit_code == 0, r.output
    trust = tmp_path / "trust"
    trust.mkdir()
    shutil.copy(repo / ".release" / "1.root.json", trust / "release-root.json")
    policy = trust / "policy.toml"
    policy.write_text(f'version = 1\n[[keys]]\nname = "release"\npath = "{keys["trusted"].public}"\n'
                      f'[release]\nroot = "release-root.json"\nstate_dir = "{tmp_path / "state"}"\n')
    add = ["release", "add", str(repo), "--targets-key", str(tk), "--snapshot-key", str(ok), "--timestamp-key", str(ok),
           "--policy", str(policy)]
    r = run(main, add)
    assert r.exit_code == 0 and "release 1: encoder [1]" in r.output, r.output
    r = run(main, ["verify", "--policy", str(policy), str(repo)])
    assert r.exit_code == 0, r.output

    old = tmp_path / "old"
    shutil.copytree(repo, old)
    build_model(repo / "encoder", (2,))
    sign_model_version(repo / "encoder", 2, signer)
    assert run(main, add).exit_code == 0
    assert run(main, ["release", "timestamp", str(repo), "--timestamp-key", str(ok), "--hours", "2"]).exit_code == 0
    r = run(main, ["release", "rotate-root", str(repo), "--old-root-key", str(ra), "--old-root-key", str(rb),
                   "--new-root-key", str(rn)])
    assert r.exit_code == 0 and "2.root.json" in r.output, r.output
    assert run(main, add).exit_code == 0
    r = run(main, ["verify", "--json", "--policy", str(policy), str(repo)])
    assert r.exit_code == 0 and all(x["ok"] for x in json.loads(r.output)), r.output
    r = run(main, ["release", "show", "--json", str(repo)])
    info = json.loads(r.output)
    assert (info["release"], info["root_version"], info["models"]) == (3, 2, {"encoder": [1, 2]})
    assert "release 3, root 2" in run(main, ["release", "show", str(repo)]).output

    # Rolled back: verify exits 1 and names the attack on every version; --no-release checks signatures only.
    shutil.rmtree(repo)
    shutil.copytree(old, repo)
    r = run(main, ["verify", "--policy", str(policy), str(repo)])
    assert r.exit_code == 1 and "rollback attack" in r.output, r.output
    assert run(main, ["verify", "--no-release", "--policy", str(policy), str(repo)]).exit_code == 0


def test_every_release_command_has_help() -> None:
    group = main.commands["release"]
    assert set(group.commands) == {"init", "add", "timestamp", "rotate-root", "show"}
    for name in group.commands:
        r = CliRunner().invoke(main, ["release", name, "--help"])
        assert r.exit_code == 0 and len(group.commands[name].help or "") > 20, name


def test_release_user_errors_are_clean(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    build_model(repo / "encoder", (1,))
    r = CliRunner().invoke(main, ["release", "show", str(repo)])
    assert r.exit_code == 1 and "Fix:" in r.output and "Traceback" not in r.output
