"""Schema validation through check-jsonschema's vendored schemas (Compose spec, GitHub, GitLab)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def check_jsonschema(schema: str, *files: Path) -> None:
    """Validate files against a schema vendored by check-jsonschema; skip when it is not installed."""
    pytest.importorskip("check_jsonschema", reason="pip install check-jsonschema to validate against the schemas")
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, *map(str, files)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
