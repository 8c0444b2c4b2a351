"""Every folder of tests is collected by the suite's own command (scripts/test.sh runs pytest over testpaths).

pytest skips folders whose names match ``norecursedirs``; its default list holds "build", and tests/build (the
tests of ``model_factory.build``: packaging, the generative builds, Gemma 3 270M, the upgrade, the sandbox) went
unrun by the suite until the list was set in pyproject.toml.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def test_no_test_folder_is_skipped_by_norecursedirs(pytestconfig: pytest.Config) -> None:
    patterns = pytestconfig.getini("norecursedirs")
    folders = {p.parent for p in ROOT.rglob("test_*.py")} - {ROOT}
    skipped = sorted(str(f.relative_to(ROOT)) for f in folders
                     if any(fnmatch.fnmatch(part, pat) for part in f.relative_to(ROOT).parts for pat in patterns))
    assert not skipped, f"pytest would not collect {skipped}: norecursedirs {patterns}"
