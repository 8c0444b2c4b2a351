"""The test registry fixtures of tests/distribution, for the chart's `oci` source test."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "distribution"))
from registry_helpers import fake_repo, oci_keys, reg_options, registry  # noqa: E402,F401
