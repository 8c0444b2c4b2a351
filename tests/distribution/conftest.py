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
