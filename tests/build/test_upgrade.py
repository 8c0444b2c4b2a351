"""The documented upgrade (docs/operations.md): ``build --key`` of version 2 beside the signed, released version 1,
then ``release add``, as written: version 1 keeps verifying, since each version carries its own signed
``config.pbtxt`` and the model's one is derived from the served version's (signing/model_config.py).

Real commands end to end (CliRunner) on a small torch source: build (walled), keygen, release init/add, verify.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from model_factory.cli.main import main

pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")
pytest.importorskip("torch")
pytest.importorskip("onnx")

FACTORY = '''
import torch


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.proj(x).sum(dim=1)


def make():
    torch.manual_seed(0)
    return Scale(), {"x": torch.randn(2, 5, 4)}
'''

RECIPE = '''
[model]
name = "scale"
task = "generic"
version = {version}

[source]
kind = "torch"
factory = "scale_factory:make"

[[inputs]]
name = "x"
dtype = "FP32"
dims = [-1, 4]

[[outputs]]
name = "y"
dtype = "FP32"
dims = [3]

[shapes]
max_batch = 4
max_sequence_length = 16
sequence_buckets = [16]

[repository]
path = "model_repository"
instance_kind = "cpu"
'''


def _ok(result) -> str:
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.slow
def test_building_version_2_beside_released_version_1_keeps_it_verifying(tmp_path: Path, monkeypatch) -> None:
    from model_factory.signing import signed_digests

    run = CliRunner().invoke
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scale_factory.py").write_text(FACTORY)
    recipe = tmp_path / "recipe.toml"
    for name in ("signing", "root", "targets", "online"):
        _ok(run(main, ["keygen", f"keys/{name}"]))
    repo = tmp_path / "model_repository"
    model_dir = repo / "scale"

    recipe.write_text(RECIPE.format(version=1))
    _ok(run(main, ["build", str(recipe), "--key", "keys/signing/signing-key.pem"]))
    _ok(run(main, ["release", "init", "model_repository", "--root-key", "keys/root/signing-key.pem",
                   "--targets-pub", "keys/targets/signing-key.pub", "--snapshot-pub", "keys/online/signing-key.pub",
                   "--timestamp-pub", "keys/online/signing-key.pub"]))
    trust = tmp_path / "trust"
    trust.mkdir()
    shutil.copy(repo / ".release" / "1.root.json", trust / "release-root.json")
    shutil.copy("keys/signing/signing-key.pub", trust / "signing.pub")
    policy = trust / "policy.toml"
    policy.write_text('version = 1\n[[keys]]\nname = "release"\npath = "signing.pub"\n'
                      f'[release]\nroot = "release-root.json"\nstate_dir = "{tmp_path / "state"}"\n')
    add = ["release", "add", "model_repository", "--policy", str(policy), "--targets-key",
           "keys/targets/signing-key.pem", "--snapshot-key", "keys/online/signing-key.pem",
           "--timestamp-key", "keys/online/signing-key.pem"]
    assert "release 1: scale [1]" in _ok(run(main, add))
    v1_config = (model_dir / "config.pbtxt").read_bytes()

    # The upgrade as docs/operations.md writes it: version 2 built and signed beside version 1, then released.
    recipe.write_text(RECIPE.format(version=2))
    _ok(run(main, ["build", str(recipe), "--key", "keys/signing/signing-key.pem"]))
    assert "release 2: scale [1, 2]" in _ok(run(main, add))  # refused before: "scale/1: file config.pbtxt changed"
    # Each version carries its configuration; the model's is the served (newest) version's copy.
    assert (model_dir / "1" / "config.pbtxt").read_bytes() == v1_config
    assert (model_dir / "config.pbtxt").read_bytes() == (model_dir / "2" / "config.pbtxt").read_bytes() != v1_config
    verified = json.loads(_ok(run(main, ["verify", "--json", "--policy", str(policy), "model_repository"])))
    assert [(r["version"], r["ok"]) for r in verified] == [(1, True), (2, True)], verified
    for version in (1, 2):  # each signature covers the version's own configuration, not the derived one
        signed = signed_digests(model_dir, version)
        assert f"{version}/config.pbtxt" in signed and "config.pbtxt" not in signed

    # A tampered model-level config.pbtxt fails the version it serves (2), not version 1.
    tampered = b'parameters {\n  key: "cpu_threads"\n  value {\n    string_value: "64"\n  }\n}\n'
    (model_dir / "config.pbtxt").write_bytes((model_dir / "2" / "config.pbtxt").read_bytes() + tampered)
    failed = run(main, ["verify", "--json", "--no-release", "--policy", str(policy), "model_repository"])
    assert failed.exit_code == 1
    records = {r["version"]: r for r in json.loads(failed.output)}
    assert records[1]["ok"] and not records[2]["ok"]
    assert any(r.startswith("config.pbtxt serves version 2 but is not its signed configuration (2/config.pbtxt)")
               and "Fix:" in r for r in records[2]["reasons"]), records[2]
    # Tampered to serve version 1 with other parameters: version 1 fails.
    (model_dir / "config.pbtxt").write_bytes(v1_config + tampered)
    records = {r["version"]: r for r in json.loads(run(main, ["verify", "--json", "--no-release", "--policy",
                                                              str(policy), "model_repository"]).output)}
    assert not records[1]["ok"] and records[2]["ok"], records
    # Version 1's own configuration, put back to serve it again, is trusted as signed.
    (model_dir / "config.pbtxt").write_bytes(v1_config)
    _ok(run(main, ["verify", "--no-release", "--policy", str(policy), "model_repository"]))
