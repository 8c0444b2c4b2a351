"""The key and policy layout of docs/deployment.md works where compose puts the files.

The documented host layout (keys/policy.toml, keys/trust/*.pub) is made with the
real keygen and signing code, then copied where docker-compose.yml mounts it in
the triton container (/run/secrets/trust_policy, /run/secrets/trust/, /models),
and ``model-factory verify --json`` (the CI gate of examples/ci/deploy-*.yml)
must pass there, and fail with exit status 1 once a served file changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

signing = pytest.importorskip("model_factory.signing")
cli_signing = pytest.importorskip("model_factory.cli.signing")

# The policy as docs/deployment.md writes it.
POLICY = 'version = 1\n\n[[keys]]\nname = "factory-2026"\npath = "trust/signing-key.pub"\n'


@pytest.fixture
def container(tmp_path: Path) -> Path:
    """A signed repository and the trust files, laid out as the triton container sees them."""
    keys = tmp_path / "host" / "keys"
    pair = signing.generate_keypair(keys)
    (keys / "trust").mkdir()
    shutil.move(pair.public_key, keys / "trust" / "signing-key.pub")
    (keys / "policy.toml").write_text(POLICY)
    repo = tmp_path / "host" / "model_repository"
    (repo / "minilm" / "1").mkdir(parents=True)
    (repo / "minilm" / "config.pbtxt").write_text('name: "minilm"\nbackend: "python"\n')
    (repo / "minilm" / "1" / "model.py").write_text("# served code\n")
    signing.sign_repository(repo, signing.SignerConfig(pair.private_key, None, ()), None)

    root = tmp_path / "container"
    (root / "run" / "secrets").mkdir(parents=True)
    shutil.copy(keys / "policy.toml", root / "run" / "secrets" / "trust_policy")
    shutil.copytree(keys / "trust", root / "run" / "secrets" / "trust")
    shutil.copytree(repo, root / "models")
    assert not (root / "run" / "secrets" / "signing_key").exists()  # triton never gets it
    return root


def verify(root: Path) -> tuple[int, list[dict]]:
    res = CliRunner().invoke(cli_signing.verify, ["--json", "--policy", str(root / "run/secrets/trust_policy"),
                                                  str(root / "models")])
    return res.exit_code, json.loads(res.output) if res.output.strip().startswith("[") else res.output


def test_verify_passes_with_the_container_layout(container) -> None:
    code, records = verify(container)
    assert code == 0, records
    assert [(r["model"], r["version"], r["ok"], r["signer"]) for r in records] == [
        ("minilm", 1, True, "key:factory-2026")]


def test_a_changed_file_fails_the_gate(container) -> None:
    (container / "models" / "minilm" / "1" / "model.py").write_text("# swapped\n")
    code, records = verify(container)
    assert code == 1
    assert records[0]["ok"] is False and records[0]["reasons"]


def test_a_missing_trust_folder_is_a_clear_error(container) -> None:
    shutil.rmtree(container / "run" / "secrets" / "trust")
    res = CliRunner().invoke(cli_signing.verify, ["--policy", str(container / "run/secrets/trust_policy"),
                                                  str(container / "models")])
    assert res.exit_code == 1
    assert "signing-key.pub" in res.output and "Traceback" not in res.output
