"""Fixtures for the distribution tests: a real registry (started here), signing keys, a signed MiniLM build."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from registry_helpers import start_registry, stop_registry  # noqa: E402


def pytest_collection_modifyitems(config, items):
    missing = [b for b in ("docker-registry", "htpasswd") if shutil.which(b) is None]
    if missing:
        skip = pytest.mark.skip(reason=f"{', '.join(missing)} not installed (scripts/setup.sh installs them as root)")
        for item in items:
            if "registry" in item.fixturenames and str(Path(__file__).parent) in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    """docker-registry (CNCF Distribution 2.8) with TLS from a test CA and htpasswd auth, for the session."""
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    yield reg
    stop_registry(reg)


@pytest.fixture(scope="session")
def oci_keys(tmp_path_factory):
    """A trusted signing key (in ``policy``) and a foreign one, plus the policy file."""
    from cryptography.hazmat.primitives.asymmetric import ec

    sys.path.insert(0, str(Path(__file__).parents[1] / "signing"))
    from signing_helpers import write_key, write_pub

    d = tmp_path_factory.mktemp("oci-keys")
    out = {}
    for label in ("trusted", "foreign"):
        k = ec.generate_private_key(ec.SECP256R1())
        out[label] = (write_key(k, d / f"{label}.pem"), write_pub(k, d / f"{label}.pub"))
    policy = d / "policy.toml"
    policy.write_text(f'version = 1\n[[keys]]\nname = "release"\npath = "{out["trusted"][1]}"\n')
    out["policy"] = policy
    return out


@pytest.fixture
def fake_repo(tmp_path, oci_keys):
    """A repository with model ``enc``, versions 1 and 2, each with a BOM and signed by the trusted key."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "signing"))
    from signing_helpers import build_model

    from model_factory.distribution.bom import write_bom
    from model_factory.signing import SignerConfig, sign_model_version

    repo = tmp_path / "repo"
    build_model(repo / "enc", (1, 2))
    for v in (1, 2):
        write_bom(repo / "enc", v, {"tool_versions": {"onnx": "1.17.0"}, "precisions": ["fp32"]})
        sign_model_version(repo / "enc", v, SignerConfig(oci_keys["trusted"][0]))
    return repo


@pytest.fixture
def reg_options(registry, tmp_path):
    from model_factory.distribution.registry import RegistryOptions

    return RegistryOptions(config=registry.config, ca_file=registry.ca, state_dir=tmp_path / "upload-state")
