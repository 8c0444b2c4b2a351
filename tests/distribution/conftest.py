"""Fixtures for the distribution tests (defined in registry_helpers, shared with tests/deploy)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from registry_helpers import fake_repo, oci_keys, plain_registry, reg_options, registry, token_registry  # noqa: E402,F401
